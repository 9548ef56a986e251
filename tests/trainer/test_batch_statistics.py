"""Batch statistics in the loss (``batch_mean``, ``batch_sum``): the default mode trains a loss that is a mean over
samples plus any function of batch statistics as bp.BPTT trains it on the whole batch (parameters after several
updates, losses, metrics), at one micro-batch's memory; other uses of a statistic are warned of by name."""

import warnings

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brainpy_accum import AccumBPTT, batch_mean, batch_sum, micro_batched_grad
from brainpy_accum.core._batch_stats import StatisticsError
from brainpy_accum.memory._stream import chunk_sizes
from helpers import assert_trees_close, make_batches, make_model, params_of


def rate_regularised(predicts, targets):
  """A mean squared error plus e-prop's regulariser: each hidden neuron's rate over the batch and time."""
  outs, monitors = predicts
  error = bm.mean((outs - targets) ** 2)
  rate = batch_mean(monitors['spike'], axis=(0, 1), name='rate')
  reg = 2. * bm.sum((rate - 0.2) ** 2)
  return error + reg, {'reg': reg, 'rate': rate, 'per_sample': bm.mean((outs - targets) ** 2, axis=(1, 2))}


def summed_with_rate(predicts, targets):
  """For grad_reduction='sum': a squared error summed over samples, plus the rate regulariser once."""
  outs, monitors = predicts
  rate = batch_mean(monitors['spike'], axis=(0, 1))
  reg = 2. * bm.sum((rate - 0.2) ** 2)
  return bm.sum((outs - targets) ** 2) + reg, {'reg': reg}


def two_statistics(predicts, targets):
  """A batch-wide variance (two means) and a squared spike count summed over the batch."""
  outs, monitors = predicts
  error = bm.mean((outs - targets) ** 2)
  variance = batch_mean(outs ** 2, axis=(0, 1)) - batch_mean(outs, axis=(0, 1)) ** 2
  count = batch_sum(monitors['spike'])
  return error + bm.sum((variance - 0.5) ** 2) + 1e-4 * count ** 2, {'count': count}


def centred_per_sample(predicts, targets):
  """A statistic read per sample: not a function of batch statistics alone."""
  outs, _ = predicts
  return bm.mean((outs - batch_mean(outs, axis=0, name='centre')) ** 2) + bm.mean((outs - targets) ** 2)


def _fit(trainer_class, loss, batches, lr=0.05, **options):
  model = make_model('snn')
  trainer = trainer_class(model, loss, optimizer=bp.optim.Adam(lr=lr), loss_has_aux=loss is not centred_per_sample,
                          monitors={'spike': model.lif.spike}, progress_bar=False, **options)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    trainer.fit(batches, num_epoch=1)
  return trainer, params_of(model), [str(w.message) for w in caught]


def _history(trainer, names):
  return {name: np.asarray(trainer.get_hist_metric('fit', name, 'detailed')) for name in names}


@pytest.mark.parametrize('loss, names, options', [
  (rate_regularised, ('reg', 'rate', 'per_sample'), {}),
  pytest.param(two_statistics, ('count',), {}, marks=pytest.mark.long),
  pytest.param(summed_with_rate, ('reg',), {'grad_reduction': 'sum'}, marks=pytest.mark.long),
], ids=['rate', 'two-statistics', 'sum'])
def test_statistics_train_as_bptt_on_the_whole_batch(loss, names, options):
  """Three updates of batches of 10 in micro-batches of 4, 4 and 2: parameters, losses and metrics as bp.BPTT's,
  without a warning. Taken per micro-batch, the statistics would move the parameters by far more than this
  tolerance (``test_a_statistic_taken_per_micro_batch_trains_another_objective``)."""
  batches = make_batches([10, 10, 10])
  expected, expected_params, _ = _fit(bp.BPTT, loss, batches)
  trainer, params, caught = _fit(AccumBPTT, loss, batches, num_micro_batch=3, **options)
  assert trainer.plan_for(10).describe_cuts() == '2 x 4 + 2'
  assert not [c for c in caught if 'couples' in c or 'metric' in c], caught
  assert_trees_close(params, expected_params, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5, atol=1e-6)
  for name, values in _history(expected, names).items():
    np.testing.assert_allclose(_history(trainer, names)[name], values, rtol=1e-5, atol=1e-6)


def test_a_statistic_taken_per_micro_batch_trains_another_objective():
  """The test above can fail: with the rate taken over each micro-batch (``bm.mean``), the parameters move
  away from bp.BPTT's by more than its tolerance."""
  def per_micro_batch(predicts, targets):
    outs, monitors = predicts
    rate = bm.mean(monitors['spike'], axis=(0, 1))
    return bm.mean((outs - targets) ** 2) + 2. * bm.sum((rate - 0.2) ** 2), {}

  batches = make_batches([10, 10, 10])
  _, expected_params, _ = _fit(bp.BPTT, per_micro_batch, batches)
  _, params, caught = _fit(AccumBPTT, per_micro_batch, batches, num_micro_batch=3)
  assert any('couples the samples' in c and 'batch_mean' in c for c in caught), caught
  assert max(np.max(np.abs(p - e)) for p, e in zip(params, expected_params)) > 1e-4


def test_a_statistic_read_per_sample_is_warned_of_by_name():
  _, _, caught = _fit(AccumBPTT, centred_per_sample, make_batches([10]), num_micro_batch=3)
  coupled = [c for c in caught if 'couples the samples' in c]
  assert len(coupled) == 1 and 'beyond its batch statistics (centre' in coupled[0], caught


def test_a_mean_that_leaves_the_batch_out_is_refused_before_the_first_step():
  def per_sample_mean(predicts, targets):
    return bm.mean((batch_mean(predicts, axis=1) - bm.mean(targets, axis=1)) ** 2)

  model = make_model('rnn')
  before = params_of(model)
  trainer = AccumBPTT(model, per_sample_mean, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, num_micro_batch=3)
  with pytest.raises(StatisticsError, match=r'batch statistic #0 of loss_fun has shape \(4, 2\).*leaves the batch out'):
    trainer.fit(make_batches([10]), num_epoch=1)
  assert_trees_close(params_of(model), before, rtol=0, atol=0)


@pytest.mark.parametrize('axis', [3, (0, 'a'), 1.5])
def test_a_bad_axis_names_the_value(axis):
  with pytest.raises(ValueError, match=r'is not a valid axis .* of an array of shape \(2, 3\)'):
    batch_mean(jnp.ones((2, 3)), axis=axis)


def test_outside_a_step_they_are_means_and_sums():
  x = jnp.arange(24.).reshape(2, 3, 4)
  np.testing.assert_array_equal(batch_mean(x, axis=(0, 1)), jnp.mean(x, axis=(0, 1)))
  np.testing.assert_array_equal(batch_sum(bm.asarray(x), axis=0), jnp.sum(x, axis=0))
  assert float(batch_mean(x)) == float(jnp.mean(x))


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_micro_batched_grad_sees_the_whole_batch_statistics(reduction):
  """The functional core: a mean (or sum) over samples plus functions of a batch mean and a batch sum, against
  brainstate's whole-batch grad: gradient and loss."""
  import brainstate
  w = brainstate.ParamState(jnp.asarray([0.5, -1., 2.]))
  per_sample = jnp.mean if reduction == 'mean' else jnp.sum

  def loss_fn(x, y):
    out = jnp.tanh(x @ w.value)
    return per_sample((out - y) ** 2) + (batch_mean(out, axis=0) - 0.3) ** 2 + 0.1 * batch_sum(out ** 2) ** 2

  x = jnp.asarray(np.random.RandomState(0).rand(11, 3), jnp.float32)
  y = jnp.asarray(np.random.RandomState(1).rand(11), jnp.float32)
  whole_grads, whole_loss = brainstate.transform.grad(loss_fn, {'w': w}, return_value=True)(x, y)
  grads, loss = micro_batched_grad(loss_fn, {'w': w}, num_micro_batch=4, return_value=True,
                                   grad_reduction=reduction)(x, y)
  assert_trees_close(grads, whole_grads, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)


def _streamed_fit(loss, reduction: str, sent_ahead: bool):
  """bp.BPTT on whole batches of 23 and AccumBPTT with a budget that streams each from the host in chunks, the last
  shorter (2 updates,
  then a test batch streamed alike; ``sent_ahead``: in pieces sent to the device ahead, an accelerator's path);
  both trainers and the chunk size."""
  from helpers import streaming_budget
  from brainpy_accum.trainer._feed import overlapping

  batches = make_batches([23, 23, 23], num_time=20, n_in=64)

  def trainer_of(trainer_class, **options):
    model = make_model('snn', n_in=64)
    return trainer_class(model, loss, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True, progress_bar=False,
                         monitors={'spike': model.lif.spike}, **options)

  def fitted(one):  # (built just before its fit: the model's reset draws from the random key make_model sets)
    with warnings.catch_warnings(), overlapping(sent_ahead):
      warnings.simplefilter('error', UserWarning)
      one.fit(batches[:2], test_data=batches[2:], num_epoch=1)
    return one

  probe = trainer_of(AccumBPTT, num_micro_batch='auto', memory_budget='1GiB', cache=False, grad_reduction=reduction)
  budget = streaming_budget([probe], batches)
  expected = fitted(trainer_of(bp.BPTT))
  trainer = fitted(trainer_of(AccumBPTT, num_micro_batch='auto', memory_budget=budget, cache=False,
                              grad_reduction=reduction))
  return expected, trainer, trainer.stream_chunks[23]


@pytest.mark.parametrize('loss, names, reduction, sent_ahead', [
  (rate_regularised, ('reg', 'rate', 'per_sample'), 'mean', False),
  pytest.param(summed_with_rate, ('reg',), 'sum', False, marks=pytest.mark.long),
  pytest.param(rate_regularised, ('reg', 'rate', 'per_sample'), 'mean', True, marks=pytest.mark.long),
], ids=['mean', 'sum', 'pieces-sent-ahead'])
def test_a_streamed_batch_sees_the_statistics_of_all_its_chunks(loss, names, reduction, sent_ahead):
  """A batch streamed from the host in chunks: a pass over every chunk first takes the whole batch's statistics,
  which every chunk's step then sees, so the updates, the losses (grad_reduction='sum': the statistics' term
  once, not once per chunk), the metrics and the streamed test batch's loss are bp.BPTT's on the whole batch."""
  expected, trainer, chunk = _streamed_fit(loss, reduction, sent_ahead)
  assert len(set(chunk_sizes(23, chunk))) == 2, chunk  # (streamed: several chunks, the last shorter)
  assert_trees_close(params_of(trainer.target), params_of(expected.target), rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(trainer.get_hist_metric('test', 'loss'), expected.get_hist_metric('test', 'loss'),
                             rtol=1e-5, atol=1e-6)
  for name, values in _history(expected, names).items():
    np.testing.assert_allclose(_history(trainer, names)[name], values, rtol=1e-5, atol=1e-6)


@pytest.mark.long  # two trainers' compilations
def test_streamed_with_accumulate_steps_each_batch_has_its_own_statistics():
  """accumulate_steps=2, grad_reduction='sum': streamed batches of 23 in chunks train as the same batches on the
  device in one piece each (whose statistics span each batch, tested against bp.BPTT batch by batch above):
  parameters after two updates and the losses."""
  from helpers import streaming_budget

  batches = make_batches([23, 23, 23, 23], num_time=20, n_in=64)

  def trainer_of(**options):
    model = make_model('snn', n_in=64)
    return AccumBPTT(model, summed_with_rate, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True,
                     progress_bar=False, monitors={'spike': model.lif.spike}, grad_reduction='sum', cache=False,
                     **options)

  def fitted(**options):
    trainer = trainer_of(accumulate_steps=2, **options)
    with warnings.catch_warnings():
      warnings.simplefilter('error', UserWarning)
      trainer.fit(batches, num_epoch=1)
    return trainer

  budget = streaming_budget([trainer_of(num_micro_batch='auto', memory_budget='1GiB')], batches)
  expected = fitted(num_micro_batch=1)
  trainer = fitted(num_micro_batch='auto', memory_budget=budget)
  assert len(chunk_sizes(23, trainer.stream_chunks[23])) > 1
  assert_trees_close(params_of(trainer.target), params_of(expected.target), rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.long  # one streamed fit
def test_a_streamed_model_that_draws_noise_reads_the_statistics_of_its_own_forward_passes():
  """With noise drawn in the forward pass, the statistics pass draws, chunk after chunk, what the chunks' steps
  then draw: the rate every step reads is the mean of the per-sample rates of the forward passes the steps ran
  (a pass that put the random keys back after each chunk would read other noise than the steps ran)."""
  import helpers
  from helpers import streaming_budget

  class Noisy(helpers.SpikingNet):
    def update(self, x):
      current = self.inp(x)
      return self.out(self.lif(current + bm.random.normal(0., 1., current.shape)))

  def loss(predicts, targets):
    outs, monitors = predicts
    rate = batch_mean(monitors['spike'], axis=(0, 1), name='rate')
    return (bm.mean((outs - targets) ** 2) + 2. * bm.sum((rate - 0.2) ** 2),
            {'rate': rate, 'own': bm.mean(monitors['spike'], axis=1)})

  helpers.MODELS['noisy'] = Noisy
  batches = make_batches([23], num_time=20, n_in=64)

  def trainer_of(**options):
    model = make_model('noisy', n_in=64)
    return AccumBPTT(model, loss, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True, progress_bar=False,
                     monitors={'spike': model.lif.spike}, cache=False, num_micro_batch='auto', **options)

  budget = streaming_budget([trainer_of(memory_budget='1GiB')], batches)
  trainer = trainer_of(memory_budget=budget)
  trainer.fit(batches, num_epoch=1)
  assert len(chunk_sizes(23, trainer.stream_chunks[23])) > 1
  rate, own = (np.asarray(trainer.get_hist_metric('fit', name, 'detailed'))[0] for name in ('rate', 'own'))
  np.testing.assert_allclose(rate, own.mean(axis=0), rtol=1e-5, atol=1e-7)


def level_regularised(predicts, targets):
  """A rate RNN's squared error plus a function of its mean output over the batch and time."""
  return bm.mean((predicts - targets) ** 2) + bm.sum((batch_mean(predicts, axis=(0, 1)) - 0.3) ** 2)


@pytest.mark.long  # two trainers' compilations
def test_with_accumulate_steps_a_statistic_spans_its_batch():
  """accumulate_steps=2: each update is the weighted mean of its two batches' whole-batch gradients, each batch's
  statistic over that batch alone (as whole_batch_loss=True's loss is each batch's), computed here with bp.BPTT's
  own gradient function batch by batch; two updates."""
  batches = make_batches([10, 7, 10, 9])
  reference = bp.BPTT(make_model('rnn'), level_regularised, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  for pair in (batches[:2], batches[2:]):
    grads = []
    for x, y in pair:
      reference.target.reset(len(x))
      grads.append((len(x), reference.f_grad(bp.tools.DotDict(fit=True), x, y)[0]))
    total = sum(n for n, _ in grads)
    reference.optimizer.update({k: sum(n * g[k] for n, g in grads) / total for k in grads[0][1]})
  trainer = AccumBPTT(make_model('rnn'), level_regularised, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                      num_micro_batch=3, accumulate_steps=2)
  with warnings.catch_warnings():
    warnings.simplefilter('error', UserWarning)
    trainer.fit(batches, num_epoch=1)
  assert_trees_close(params_of(trainer.target), params_of(reference.target), rtol=2e-5, atol=2e-6)


@pytest.mark.long  # four compilations of the step
def test_the_step_keeps_the_statistics_not_the_whole_batch_outputs():
  """XLA's analysis of the train step at the same cut: with the rate a batch statistic the step holds one
  micro-batch's spikes and the statistics, below whole_batch_loss=True's, which keeps the whole batch's spikes,
  and the gap grows with the batch (4 micro-batches of 16 and of 64 samples, 20 time steps, 64 neurons)."""
  def fixed_rate(predicts, targets):
    outs, monitors = predicts
    rate = bm.mean(monitors['spike'], axis=(0, 1))
    return bm.mean((outs - targets) ** 2) + 2. * bm.sum((rate - 0.2) ** 2), {}

  gaps = []
  for batch in (64, 256):
    x, y = make_batches([batch], num_time=20)[0]
    sizes = {}
    for name, loss, options in (('statistics', rate_regularised, {}),
                                ('whole', fixed_rate, {'whole_batch_loss': True})):
      model = make_model('snn', n_hidden=64)
      trainer = AccumBPTT(model, loss, optimizer=bp.optim.Adam(lr=0.01), loss_has_aux=True, progress_bar=False,
                          monitors={'spike': model.lif.spike}, num_micro_batch=4, **options)
      model.reset(batch)
      sizes[name] = trainer.compiled_step_bytes(trainer.plan_for(batch), bp.tools.DotDict(fit=True), x, y)
    gaps.append(sizes['whole'] - sizes['statistics'])
    assert sizes['statistics'] < sizes['whole'], sizes
  assert gaps[1] > 3 * gaps[0], gaps
