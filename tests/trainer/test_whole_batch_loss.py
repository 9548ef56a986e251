"""``whole_batch_loss=True`` (two passes) against ``bp.BPTT`` on the whole batch, and the default mode's check.

The losses couple the samples of a batch, so the default accumulation would train another objective; the
two-pass mode must give ``bp.BPTT``'s parameters, losses and metrics after several Adam steps (rtol 1e-5,
atol 1e-6), on uneven splits, for a rate and a spiking network.
"""

import warnings

import brainpy as bp
import brainpy.math as bm
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, optimizer_state, params_of, step_bytes



def rate_regulariser(predicts, targets):
  """Cross-entropy-like term plus ``sum over units of (mean over batch and time - f0)^2``."""
  out, mons = predicts
  rate = bm.mean(mons['spike'], axis=(0, 1))
  return bp.losses.mean_squared_error(out, targets) + 2. * bm.sum((rate - 0.1) ** 2), {'rate': bm.mean(rate)}


def sum_and_square_regulariser(predicts, targets):
  """The SurrogateGrad-LIF example's form: ``1e-2 * sum(spikes) + 1e-2 * mean((sum over batch, time)^2)``."""
  out, mons = predicts
  spikes = mons['spike']
  return (bp.losses.mean_squared_error(out, targets) + 1e-2 * bm.sum(spikes)
          + 1e-2 * bm.mean(bm.sum(spikes, axis=(0, 1)) ** 2)), {}


def batch_max(predicts, targets):
  """A loss normalised by the batch's largest error."""
  err = bm.mean((predicts - targets) ** 2, axis=(1, 2))
  return bm.mean(err) + bm.max(err), {'max_err': bm.max(err)}


def contrastive(predicts, targets):
  """InfoNCE over the batch: each sample's mean output against every sample's mean target."""
  z, t = bm.mean(predicts, axis=1), bm.mean(targets, axis=1)
  z = z / (bm.linalg.norm(z, axis=1, keepdims=True) + 1e-6)
  t = t / (bm.linalg.norm(t, axis=1, keepdims=True) + 1e-6)
  logits = 5. * z @ t.T
  return bp.losses.cross_entropy_loss(logits, bm.arange(z.shape[0])), {}


CASES = {  # name: (model, loss, monitors, batch sizes)
  'rate_regulariser_snn': ('snn', rate_regulariser, True, (10, 7, 10)),
  'sum_square_snn': ('snn', sum_and_square_regulariser, True, (11, 9)),
  'batch_max_rnn': ('rnn', batch_max, False, (10, 7, 10)),
  'contrastive_rnn': ('rnn', contrastive, False, (9, 12)),
  'batch_max_snn': ('snn', batch_max, False, (10, 8)),
}


def _trainer(cls, case, **kwargs):
  model_name, loss, monitored, _ = CASES[case]
  model = make_model(model_name)
  monitors = {'spike': model.lif.spike} if monitored else None
  return cls(model, loss, optimizer=bp.optim.Adam(lr=2e-2), loss_has_aux=True, monitors=monitors,
             progress_bar=False, **kwargs)


def _fit(trainer, case, num_epoch=2, drive=1.):
  batches = [(x * drive, y) for x, y in make_batches(CASES[case][3])]
  trainer.fit(batches, test_data=batches[:1], num_epoch=num_epoch)
  return trainer


def _assert_same_run(actual, expected):
  assert_trees_close(params_of(actual.target), params_of(expected.target))
  assert_trees_close(optimizer_state(actual), optimizer_state(expected))
  np.testing.assert_allclose(actual.train_losses, expected.train_losses, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(actual.test_losses, expected.test_losses, rtol=1e-5, atol=1e-6)
  for key in expected._detailed_train_metrics:
    np.testing.assert_allclose(actual.get_hist_metric('fit', key), expected.get_hist_metric('fit', key),
                               rtol=1e-5, atol=1e-6)


QUICK_CASES = ('rate_regulariser_snn',)  # the others run in the long suite (--long)


def _long_unless_quick(cases):
  return [pytest.param(case, marks=() if case in QUICK_CASES else pytest.mark.long) for case in cases]


@pytest.mark.parametrize('case', _long_unless_quick(sorted(CASES)))
def test_two_passes_equal_bptt_on_the_whole_batch(case):
  expected = _fit(_trainer(bp.BPTT, case), case)
  with warnings.catch_warnings():
    warnings.simplefilter('error', UserWarning)  # no coupled-loss warning in this mode
    actual = _fit(_trainer(AccumBPTT, case, num_micro_batch=3, whole_batch_loss=True), case)
  _assert_same_run(actual, expected)


def regularised_trainer(cls, **kwargs):
  """A trainer of the rate network whose loss is a batch maximum plus a weight regulariser that reads the
  model's parameters itself."""
  model = make_model('rnn')
  params = list(model.train_vars().unique().values())

  def loss(predicts, targets):
    value, aux = batch_max(predicts, targets)
    return value + 0.05 * sum(bm.sum(p.value ** 2) for p in params), aux
  return cls(model, loss, optimizer=bp.optim.Adam(lr=2e-2), loss_has_aux=True, progress_bar=False, **kwargs)


def test_two_passes_differentiate_terms_that_read_the_parameters():
  """A term of the loss that reads the model's parameters itself (a weight regulariser beside a batch maximum)
  reaches them through no output: its gradient is taken with the loss of the whole batch and added once to the
  outputs' pulled back, as bp.BPTT's gradient holds it."""
  batches = make_batches((10, 7))
  expected = regularised_trainer(bp.BPTT)
  actual = regularised_trainer(AccumBPTT, num_micro_batch=3, whole_batch_loss=True)
  for run in (expected, actual):
    run.fit(batches, test_data=batches[:1], num_epoch=2)
  _assert_same_run(actual, expected)


def test_what_the_loss_writes_and_draws_is_the_steps_last_word():
  """A loss that draws random numbers and writes a Variable of its own: the second pass replays the forward pass
  from its start, but the key the loss advanced and the Variable it set end the step as the loss left them, as in
  bp.BPTT (else every step's loss would draw the same numbers)."""
  def trainer(cls, **kwargs):
    model = make_model('rnn')
    model.store = bm.Variable(bm.zeros(()))

    def loss(predicts, targets):
      value, aux = batch_max(predicts, targets)
      value = value + bm.mean(predicts * bm.random.normal(size=predicts.shape))
      model.store.value = model.store.value + value
      return value, aux
    return cls(model, loss, optimizer=bp.optim.Adam(lr=2e-2), loss_has_aux=True, progress_bar=False, **kwargs)

  batches = make_batches((10, 7))
  expected = trainer(bp.BPTT)
  expected.fit(batches, num_epoch=2)
  actual = trainer(AccumBPTT, num_micro_batch=3, whole_batch_loss=True)  # (built after: the same random key)
  actual.fit(batches, num_epoch=2)
  assert_trees_close(params_of(actual.target), params_of(expected.target))
  np.testing.assert_allclose(actual.train_losses, expected.train_losses, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(actual.target.store.value), float(expected.target.store.value), rtol=1e-5)


def test_two_passes_warn_where_the_loss_reads_a_state_the_model_writes():
  """A loss that reads the model's hidden state itself, not through an output: after the micro-batches' forward
  passes that is not the whole batch's value, and no gradient flows back through it: a warning names the state
  and the fix (monitor it), once."""
  model = make_model('rnn')
  state = next(name for name, v in model.vars().unique().items() if not isinstance(v, bm.TrainVar))

  def loss(predicts, targets):
    return batch_max(predicts, targets)[0] + bm.mean(model.vars().unique()[state].value ** 2)
  trainer = AccumBPTT(model, loss, optimizer=bp.optim.Adam(lr=2e-2), num_micro_batch=3, whole_batch_loss=True,
                      progress_bar=False)
  with pytest.warns(UserWarning, match=f'loss_fun reads {state} itself.*monitor it instead') as caught:
    trainer.fit(make_batches((10, 10)), num_epoch=1)
  assert sum('loss_fun reads' in str(w.message) for w in caught) == 1


class _Elementwise(bp.DynamicalSystem):
  """``tanh(x * w + b)``: a model without a matmul."""

  def __init__(self):
    super().__init__()
    self.w, self.b = bm.TrainVar(bm.asarray([0.5, -0.7, 1.1])), bm.TrainVar(bm.asarray([0.1, 0.2, -0.3]))

  def update(self, x):
    return bm.tanh(x * self.w + self.b)


def test_two_passes_pull_back_without_a_matmul_of_their_own():
  """The second pass pulls the whole batch's cotangents back through each micro-batch as a product and a sum, not
  a matmul (``jnp.vdot``): at a TPU's default precision a matmul rounds its operands to bfloat16, so the
  cotangents reached the model rounded (bp.BPTT's do not). Simulated on the CPU by rounding every
  ``dot_general``'s operands, that moved this model's parameters by 2e-4 (relative L2) from bp.BPTT's after 6
  Adam steps, and by 2e-8 without the matmul. So a model without a matmul traces a step without one."""
  with bm.training_environment():
    model = _Elementwise()
  trainer = AccumBPTT(model, lambda p, t: batch_max(p, t)[0], optimizer=bp.optim.Adam(lr=2e-2), num_micro_batch=3,
                      whole_batch_loss=True, progress_bar=False)
  x, y = make_batches((10,), n_in=3, n_out=3)[0]
  with trainer._steps.for_plan(None) as step:
    text = step.lower(bp.tools.DotDict(fit=True), x, y).as_text()
  assert 'dot_general' not in text and 'stablehlo.dot' not in text


@pytest.mark.long  # the long suite (--long)
@pytest.mark.parametrize('options', [dict(remat=2), dict(clip_grad_norm=0.05, skip_nonfinite=True),
                                     dict(micro_batch_size=1)], ids=['remat', 'clip_skip', 'one_sample_each'])
def test_two_passes_compose_with_remat_clipping_skipping(options):
  case = 'rate_regulariser_snn'
  clip = {k: v for k, v in options.items() if k == 'clip_grad_norm'}
  expected = _fit(_trainer(AccumBPTT, case, **clip), case)  # N=1: bp.BPTT's step with the same clipping
  options = {'num_micro_batch': 4, **options} if 'micro_batch_size' not in options else options
  actual = _fit(_trainer(AccumBPTT, case, whole_batch_loss=True, **options), case)
  _assert_same_run(actual, expected)


@pytest.mark.long  # the long suite (--long)
def test_two_passes_under_the_memory_planner_count_the_stored_predictions():
  case = 'batch_max_rnn'
  expected = _fit(_trainer(bp.BPTT, case), case)
  # between the two-pass step of the batch of 10 in one piece and in micro-batches of 5 (XLA's bytes on this
  # device): the batches of 10 are cut
  measure = _trainer(AccumBPTT, case, num_micro_batch='auto', memory_budget='1GiB', whole_batch_loss=True)
  x, y = make_batches(CASES[case][3])[0]
  whole, halves = (step_bytes(measure, x, y, 10, micro, via_window=False) for micro in (10, 5))
  budget = (whole + halves) // 2
  assert halves < budget < whole, (halves, whole)
  actual = _trainer(AccumBPTT, case, num_micro_batch='auto', memory_budget=budget, whole_batch_loss=True)
  _fit(actual, case)
  _assert_same_run(actual, expected)
  assert any(plan.num_micro_batches > 1 for plan, _ in actual.memory_plans.values())
  assert all(used <= budget for _, used in actual.memory_plans.values())


@pytest.mark.long  # the long suite (--long)
def test_both_passes_see_the_same_random_numbers():
  """With dropout and a per-sample loss, the two-pass gradient is the default mode's (same draws, same order)."""

  class Noise(bp.DynamicalSystem):  # bp.dnn.Dropout branches on the traced fit flag on brainpy 2.9
    def update(self, x):
      return x * (bm.random.rand(*x.shape) < 0.5) * 2.

  def make():
    bm.random.seed(3)
    with bm.training_environment():
      return bp.Sequential(bp.dyn.RNNCell(3, 8), Noise(), bp.dnn.Dense(8, 2))

  batches = make_batches((10, 7))
  runs = []
  for whole in (False, True):
    bm.random.seed(11)
    trainer = AccumBPTT(make(), 'mean_squared_error', optimizer=bp.optim.Adam(lr=1e-2), num_micro_batch=3,
                        whole_batch_loss=whole, progress_bar=False)
    trainer.fit(batches, num_epoch=2)
    runs.append(trainer)
  assert_trees_close(params_of(runs[1].target), params_of(runs[0].target))
  np.testing.assert_allclose(runs[1].train_losses, runs[0].train_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('case', [pytest.param(case, marks=() if case == 'rate_regulariser_snn' else pytest.mark.long)
                                  for case in ['rate_regulariser_snn', 'batch_max_rnn', 'contrastive_rnn']])
def test_default_mode_warns_once_with_the_measured_difference(case):
  # The check compares the loss at random outputs in place of the network's, so it warns whatever the
  # network does on the first batch.
  with pytest.warns(UserWarning, match=r'whole_batch_loss=True') as record:
    _fit(_trainer(AccumBPTT, case, num_micro_batch=3), case, num_epoch=2, drive=4.)
  coupled = [w for w in record if 'couples the samples' in str(w.message)]
  assert len(coupled) == 1
  assert 'difference' in str(coupled[0].message)


# (BrainPy's mean_squared_error skips the check: tests/trainer/test_coupled_loss.py)
@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.parametrize('loss', ['cross_entropy'])
def test_default_mode_is_silent_on_a_mean_over_samples(loss):
  def cross_entropy(predicts, targets):
    return bp.losses.cross_entropy_loss(predicts.sum(axis=1), targets)

  sizes = (10, 7)
  batches = make_batches(sizes)
  if loss == 'cross_entropy':
    batches = [(x, np.arange(len(x)) % 2) for x, _ in batches]
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    trainer = AccumBPTT(make_model('snn'), loss if loss != 'cross_entropy' else cross_entropy,
                        num_micro_batch=3, progress_bar=False)
    trainer.fit(batches, num_epoch=1)
  assert not [w for w in record if 'couples' in str(w.message) or 'Could not check' in str(w.message)]


@pytest.mark.long  # the long suite (--long): README suite time
def test_the_check_changes_nothing():
  """The first batch's check (loss_fun at random outputs) changes nothing but how the metrics it finds combine: the
  run equals one whose check is skipped and whose batch maximum is declared as the check finds it."""
  case = 'batch_max_rnn'
  runs = []
  for checked in (True, False):
    trainer = _trainer(AccumBPTT, case, num_micro_batch=3, aux_reduction=None if checked else {'max_err': 'max'})
    trainer._loss_checked = not checked
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UserWarning)
      runs.append(_fit(trainer, case))
  _assert_same_run(runs[0], runs[1])


@pytest.mark.parametrize('options, match', [
  (dict(accumulate_steps=2), 'accumulate_steps'),
  (dict(grad_reduction='sum'), 'grad_reduction'),
  (dict(loss_weight_fn=lambda x, y: 1.), 'loss_weight_fn'),
  (dict(whole_batch_loss='yes'), 'whole_batch_loss'),
])
def test_whole_batch_loss_refuses_what_cannot_be_exact(options, match):
  options = {'whole_batch_loss': True, **options}
  error = TypeError if options['whole_batch_loss'] == 'yes' else ValueError
  with pytest.raises(error, match=match):
    AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, **options)
