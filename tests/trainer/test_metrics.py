"""Every metric and every target as bp.BPTT has them.

The reference is ``bp.BPTT`` on the whole batch from the same parameters on the same batches: parameters
after several Adam steps, the detailed and report history of every metric with its shape and dtype, and the
report lines. Tolerance: float32 round-off of sums taken in another order (``RTOL, ATOL`` of helpers).
"""

import re
import warnings

import brainpy as bp
import brainpy.math as bm
import jax.numpy as jnp
import numpy as np
import pytest

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.core._metrics import MetricRule, combine_on_host
from helpers import ATOL, RTOL, make_batches, make_model, params_of, streaming_budget

SIZES = (10, 10)  # uneven splits: 10 = 4 + 4 + 2 at num_micro_batch=3 (bp.BPTT's history of per-sample metrics
#                  needs batches of one size: it stacks them), test batches of 9 = 3 x 3


def metrics_loss(time_first: bool):
  """MSE and six metrics: per-sample (B,), per-step (B, T) or (T, B), a batch maximum and minimum, a count, a
  mean."""
  sample_axes = (0, 2) if time_first else (1, 2)

  def loss_fun(predicts, targets):
    loss = bp.losses.mean_squared_error(predicts, targets)
    return loss, {'per_sample': bm.mean((predicts - targets) ** 2, axis=sample_axes),
                  'per_step': bm.mean(predicts, axis=-1),
                  'max_out': bm.max(predicts),
                  'min_out': bm.min(predicts),
                  'n_pos': bm.sum(predicts[..., 0] > 0.5),
                  'mean_out': bm.mean(predicts)}

  return loss_fun


DECLARED = {'max_out': 'max', 'min_out': 'min', 'n_pos': 'sum'}


def fit(trainer_cls, time_first=False, sizes=SIZES, lr=0.05, loss=None, capsys=None, test_size=9, n_in=3, num_time=5,
        trainers=None, before_fit=None, **kwargs):
  """Train the tiny RNN two epochs (with a test pass); return parameters, history, reports, warnings.

  The reports are what ``fun_after_report`` receives, ``(phase, idx, {metric: value})``, and, with ``capsys``,
  the same parsed from the printed report lines. ``before_fit(trainer)`` runs after the trainer is built.
  """
  model = make_model('rnn', **({} if n_in == 3 else {'n_in': n_in}))
  reports = []
  kwargs.setdefault('progress_bar', False)
  trainer = trainer_cls(model, loss or metrics_loss(time_first), optimizer=bp.optim.Adam(lr=lr), loss_has_aux=True,
                        data_first_axis='T' if time_first else 'B', **kwargs)
  batches = make_batches(sizes, time_first=time_first, n_in=n_in, num_time=num_time)
  test = make_batches((test_size,), seed=1, time_first=time_first, n_in=n_in, num_time=num_time)
  if trainers is not None:
    trainers.append(trainer)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    if before_fit is not None:
      before_fit(trainer)
    trainer.fit(batches, test_data=test, num_epoch=2,
                fun_after_report=lambda idx, means, phase: reports.append((phase, idx, dict(means))))
  history = {(phase, which, name): trainer.get_hist_metric(phase, name, which)
             for phase, names in (('fit', trainer._detailed_train_metrics), ('test', trainer._detailed_test_metrics))
             for name in names for which in ('detailed', 'report')}
  if capsys is not None:
    reports = (reports, report_lines(capsys.readouterr().out))
  return params_of(model), history, reports, [str(w.message) for w in caught]


def report_lines(out: str):
  """``(phase, idx, {metric: value})`` of every printed report line."""
  parsed = []
  for line in out.splitlines():
    match = re.match(r'(Train|Test) (\d+) epoch, use [0-9.]+ s, (.*) \(batch', line)
    if match:
      values = dict(item.split(' ') for item in match.group(3).split(', '))
      parsed.append(('fit' if match.group(1) == 'Train' else 'test', int(match.group(2)),
                     {k: float(v) for k, v in values.items()}))
  return parsed


def assert_same_reports(reports, expected):
  assert [(p, i, sorted(m)) for p, i, m in reports] == [(p, i, sorted(m)) for p, i, m in expected]
  for (_, _, got), (_, _, want) in zip(reports, expected):
    for key in want:
      np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=RTOL, atol=ATOL, err_msg=key)


def assert_same_history(history, expected):
  assert history.keys() == expected.keys()
  for key, want in expected.items():
    got = history[key]
    assert got.shape == want.shape and got.dtype == want.dtype, (key, got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=str(key))


def assert_trained_alike(expected, actual):
  """``(parameters, recorded losses)`` of two runs agree to float32 round-off."""
  np.testing.assert_allclose(actual[1], expected[1], rtol=RTOL, atol=ATOL)
  for p, e in zip(actual[0], expected[0]):
    np.testing.assert_allclose(p, e, rtol=RTOL, atol=ATOL)


_REFERENCE = {}


def reference(time_first=False, **kwargs):
  key = (time_first, tuple(sorted(kwargs.items())))
  if key not in _REFERENCE:
    _REFERENCE[key] = fit(bp.BPTT, time_first, **kwargs)
  return _REFERENCE[key]


@pytest.mark.parametrize('time_first, options', [
  (False, dict(num_micro_batch=3, aux_reduction=DECLARED)),
  pytest.param(True, dict(num_micro_batch=3, aux_reduction=DECLARED), marks=pytest.mark.long),  # README suite time
  (False, dict(num_micro_batch=3)),
  (False, dict(num_micro_batch=3, whole_batch_loss=True)),
], ids=['default-B', 'default-T', 'found', 'whole_batch_loss'])
def test_every_metric_equals_bptt(capsys, time_first, options):
  """Per-sample metrics stitched (uneven splits too), a max, a min and a count (int32 kept), declared or found
  by the first-batch check, a mean: the history (shape, dtype, values; the first batch's too), the report lines
  and the parameters equal bp.BPTT's, and nothing warns."""
  expected_params, expected, expected_reports, _ = reference(time_first)
  capsys.readouterr()
  params, history, (reports, lines), caught = fit(AccumBPTT, time_first, capsys=capsys, **options)
  for p, e in zip(params, expected_params):
    np.testing.assert_allclose(p, e, rtol=RTOL, atol=ATOL)
  assert_same_history(history, expected)
  assert history['fit', 'detailed', 'per_sample'].shape == (4, 10)
  assert history['fit', 'detailed', 'per_step'].shape == ((4, 5, 10) if time_first else (4, 10, 5))
  assert history['fit', 'detailed', 'n_pos'].dtype == np.int32
  assert_same_reports(reports, expected_reports)
  assert_same_reports(lines, expected_reports)  # the printed lines say the same
  assert not [c for c in caught if 'metric' in c or 'couples' in c], caught


@pytest.mark.parametrize('declared', [DECLARED, None], ids=['declared', 'found'])
def test_window_records_bptt_metrics(declared):
  """With a learning rate of 0 every batch is evaluated at the same parameters, so the metrics of the batches
  of an ``accumulate_steps`` window equal bp.BPTT's batch by batch, their reductions declared or found."""
  _, expected, _, _ = reference(lr=0.)
  _, windowed, _, caught = fit(AccumBPTT, lr=0., num_micro_batch=3, accumulate_steps=2, aux_reduction=declared)
  assert_same_history(windowed, expected)
  assert not [c for c in caught if 'metric' in c], caught


@pytest.mark.long  # the long suite (--long): README suite time
def test_per_sample_metrics_of_batches_of_different_sizes_are_kept():
  """bp.BPTT cannot stack per-sample metrics of a batch of 10 and one of 7 (its fit fails at the end of the
  epoch); AccumBPTT keeps them: each batch's array as bp.BPTT computes it batch by batch (one fit per batch,
  which trains as one fit of both), an object array of them as the detailed history, and every epoch's report
  the mean over its 17 samples."""
  sizes, loss = (10, 7), metrics_loss(False)
  batches = make_batches(sizes)
  model = make_model('rnn')
  ref = bp.BPTT(model, loss, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True, progress_bar=False)
  expected = {'loss': [], 'per_sample': [], 'per_step': []}
  for _ in range(2):
    for batch in batches:
      ref.fit([batch], num_epoch=1)
      for name in expected:
        expected[name].append(ref.get_hist_metric('fit', name, 'detailed')[0])
  trainer = AccumBPTT(make_model('rnn'), loss, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True,
                      progress_bar=False, num_micro_batch=3, aux_reduction=DECLARED)
  trainer.fit(batches, num_epoch=2)
  for p, e in zip(params_of(trainer.target), params_of(model)):
    np.testing.assert_allclose(p, e, rtol=RTOL, atol=ATOL)
  for name, want in expected.items():
    got = trainer.get_hist_metric('fit', name, 'detailed')
    assert len(got) == 4, name
    for g, w in zip(got, want):
      assert np.shape(g) == np.shape(w), name
      np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name)
    report = trainer.get_hist_metric('fit', name, 'report')
    means = [np.mean(np.concatenate([np.ravel(v) for v in want[i:i + 2]])) for i in (0, 2)]
    np.testing.assert_allclose(report, means, rtol=RTOL, atol=ATOL, err_msg=name)
  assert trainer.get_hist_metric('fit', 'per_sample', 'detailed').dtype == object
  assert trainer.get_hist_metric('fit', 'loss', 'detailed').shape == (4,)


def test_history_of_different_shapes_survives_a_checkpoint():
  """A report window holding per-sample arrays of 10 and 7 samples goes through a checkpoint's state and back."""
  from brainpy_accum.trainer._pass import PhaseLog
  log = PhaseLog('Train')
  for n in (10, 7, 10):
    log.record(np.float32(n), {'per_sample': np.arange(n, dtype=np.float32), 'm': np.float32(1.)}, '')
    if n == 7:
      log.close_window(0, 'steps')
  state = log.state()
  assert set(state) >= {'shapes/detailed/per_sample', 'window/per_sample'}
  again = PhaseLog('Train')
  again.restore(state)
  again.close_window(1, 'steps')
  log.close_window(1, 'steps')
  for a, b in zip(again.arrays(), log.arrays()):
    assert a.keys() == b.keys()
    for key in a:
      assert a[key].shape == b[key].shape, key
      for x, y in zip(a[key], b[key]):
        np.testing.assert_array_equal(x, y)
  assert [len(v) for v in log.arrays()[1]['per_sample']] == [10, 7, 10]


@pytest.mark.long
@pytest.mark.parametrize('declared', [DECLARED, pytest.param(None, marks=pytest.mark.extended)], ids=['declared', 'found'])
def test_streamed_chunks_record_bptt_metrics(declared):
  """Batches streamed from the host in chunks (no step that holds a whole batch fits the budget): the metrics
  combine chunk by chunk on the host, by the same rules, and equal bp.BPTT's batch by batch (learning rate 0, as
  above). Found: the check runs on the first chunk, after planning compiled its step, which is then traced
  again."""
  shape = dict(n_in=64, num_time=100)
  _, expected, _, _ = reference(lr=0., **shape)
  probe = AccumBPTT(make_model('rnn', n_in=64), metrics_loss(False), loss_has_aux=True, aux_reduction=DECLARED,
                    num_micro_batch='auto', memory_budget='1GiB', progress_bar=False)
  # the test batch of 9, the smallest: XLA's bytes on this device of its whole step, and of a chunk of one
  budget = streaming_budget([probe], make_batches((9,), seed=1, **shape), chunk=1)
  trainers = []
  _, streamed, _, caught = fit(AccumBPTT, lr=0., num_micro_batch='auto', memory_budget=budget,
                               aux_reduction=declared, trainers=trainers, **shape)
  assert set(trainers[0].stream_chunks) == {10, 9}
  assert_same_history(streamed, expected)
  assert not [c for c in caught if 'metric' in c], caught


def test_chunks_combine_by_rule():
  """The host-side combination of streamed chunks: stitched on the batch axis, weighted mean, int sum, max."""
  rules = [MetricRule(1, 'stitch'), MetricRule(None, 'mean'), MetricRule(None, 'sum'), MetricRule(None, 'max')]
  chunks = [{'a': np.ones((2, 3)), 'b': np.float32(1.), 'c': np.int32(2), 'd': np.float32(5.)},
            {'a': np.zeros((2, 1)), 'b': np.float32(4.), 'c': np.int32(3), 'd': np.float32(7.)}]
  out = combine_on_host(chunks, [3., 1.], [3, 1], rules, True)
  assert out['a'].shape == (2, 4) and out['a'][:, 3].sum() == 0
  assert out['b'] == pytest.approx(1.75) and out['b'].dtype == np.float32
  assert out['c'] == 5 and out['c'].dtype == np.int32
  assert out['d'] == 7.


def _budget_for_two_micro_batches(batch):
  """A memory budget between the train steps of micro-batches of 5 and of 10 samples (measured, not assumed):
  'auto' plans a batch of 10 as two micro-batches of 5."""
  x, y = batch
  probe = AccumBPTT(make_model('rnn'), metrics_loss(False), loss_has_aux=True, num_micro_batch='auto',
                    memory_budget='1GiB', aux_reduction=DECLARED, cache=False)
  probe.target.reset(len(x))
  need = [probe.compiled_step_bytes(plan_micro_batches(10, micro_batch_size=n), {}, x, y) for n in (5, 10)]
  assert need[0] < need[1], need
  return (need[0] + need[1]) // 2


@pytest.mark.long  # the long suite (--long); test_every_metric_equals_bptt[found] is the quick one
@pytest.mark.parametrize('planned', ['in_fit', 'before_fit', 'cached'])
def test_found_reductions_with_auto_plans_equal_bptt(planned, tmp_path):
  """num_micro_batch='auto': the check finds the max, min and count before the planner compiles the step that
  training runs (``in_fit``), or before the first step where the plan comes from the plan cache (``cached``:
  nothing to search); where the batch was planned (its step compiled and kept) before fit, the step is traced
  again with what it found. Either way the history equals bp.BPTT's, dtypes too, and nothing warns."""
  _, expected, _, _ = reference()
  budget = _budget_for_two_micro_batches(make_batches(SIZES)[0])
  cache = tmp_path if planned == 'cached' else False
  if planned == 'cached':  # a first run leaves its plan in the cache
    fit(AccumBPTT, num_micro_batch='auto', memory_budget=budget, cache=cache)

  def plan_first(trainer):
    if planned == 'before_fit':
      x, y = make_batches(SIZES)[0]
      trainer.target.reset(len(x))
      trainer.plan_memory(x, y)

  trainers = []
  _, history, _, caught = fit(AccumBPTT, num_micro_batch='auto', memory_budget=budget, trainers=trainers,
                              before_fit=plan_first, cache=cache)
  assert trainers[0].num_micro_batch_for(10) == 2
  assert_same_history(history, expected)
  assert not [c for c in caught if 'metric' in c], caught


def summary_metrics(predicts, targets):
  """MSE, a batch maximum, a count and a mean: no per-sample metric (bp.BPTT stacks those, so its batches would
  need one size)."""
  return bp.losses.mean_squared_error(predicts, targets), {'max_out': bm.max(predicts),
                                                           'n_pos': bm.sum(predicts[..., 0] > 0.5),
                                                           'mean_out': bm.mean(predicts)}


def rms_error(predicts, targets):
  """Not a mean over samples: the first batch cut into micro-batches warns."""
  return bm.sqrt(bm.mean((predicts - targets) ** 2))


@pytest.mark.parametrize('sizes, options', [
  ((1, 10), dict(num_micro_batch=3)), pytest.param((5, 10), dict(micro_batch_size=5), marks=pytest.mark.long),
  ((4, 10), 'auto'), pytest.param((10, 4), 'auto', marks=pytest.mark.long), ((10, 4), 'planned')])  # (README time)
def test_the_first_batch_cut_is_checked_whichever_batch_it_is(sizes, options):
  """The check ran once per trainer, on the first batch, also where that batch trains in one micro-batch and
  there is nothing to compare: the batches cut after it combined undeclared maxima and counts as means (a count
  of 9 recorded as 3.0), and a coupled loss never warned; with 'auto' a check still running for a cut batch was
  dropped, unreported, when the next batch planned trained whole (found by a reviewer's run). Now the first batch
  cut is checked: the history equals bp.BPTT's, dtypes too, and a coupled loss warns once."""
  x, y = make_batches((10,))[0]
  before_fit = None
  if options == 'planned':  # planned before fit: its check starts after its first step, and runs beside the next
    before_fit = lambda trainer: (trainer.target.reset(10), trainer.plan_memory(x, y))  # noqa: E731
  if options in ('auto', 'planned'):
    probe = AccumBPTT(make_model('rnn'), summary_metrics, loss_has_aux=True, num_micro_batch='auto',
                      memory_budget='1GiB', cache=False)
    probe.target.reset(10)
    need = [probe.compiled_step_bytes(plan_micro_batches(10, micro_batch_size=n), {}, x, y) for n in (5, 10)]
    if need[0] >= need[1]:  # (a TPU v5e: 1,109,504 bytes against 77,312; its tiles pad this tiny model's scan)
      pytest.skip(f'here the step of this small model in micro-batches of 5 takes no less memory than whole '
                  f'({need[0]} against {need[1]} bytes): no budget makes the planner cut a batch of 10')
    options = dict(num_micro_batch='auto', memory_budget=(need[0] + need[1]) // 2, cache=False)
  _, expected, _, _ = reference(sizes=sizes, loss=summary_metrics)
  trainers = []
  _, history, _, caught = fit(AccumBPTT, sizes=sizes, loss=summary_metrics, trainers=trainers, before_fit=before_fit,
                              **options)
  counts = {size: trainers[0].num_micro_batch_for(size) for size in sizes}
  assert counts[10] > 1 and all(counts[size] == 1 for size in sizes if size < 10), counts
  assert_same_history(history, expected)
  assert not [c for c in caught if 'metric' in c or 'couples' in c], caught
  coupled = AccumBPTT(make_model('rnn'), rms_error, progress_bar=False, **options)  # (no metrics: checked beside)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    if before_fit is not None:
      before_fit(coupled)
    coupled.fit(make_batches(sizes), num_epoch=2)
  assert len([c for c in caught if 'couples the samples' in str(c.message)]) == 1, [str(c.message) for c in caught]


def test_metrics_whose_reduction_cannot_be_found_warn_and_a_declared_one_wins():
  """Undeclared: a spread (no combination of its micro-batch values gives it) and a constant (a mean, a max and a
  min all do) each warn, naming aux_reduction, and combine as means; the count is found silently. Declared
  'mean' for the maximum wins over what the check would find: it combines as a mean (below bp.BPTT's maximum)
  and warns as before."""
  def loss(predicts, targets):
    return bp.losses.mean_squared_error(predicts, targets), {
      'spread': bm.std(predicts), 'constant': jnp.float32(2.), 'max_out': bm.max(predicts),
      'n_pos': bm.sum(predicts[..., 0] > 0.5)}

  batches = make_batches((10,))
  reference_trainer = bp.BPTT(make_model('rnn'), loss, loss_has_aux=True, progress_bar=False)
  reference_trainer.fit(batches, num_epoch=1)
  trainer = AccumBPTT(make_model('rnn'), loss, loss_has_aux=True, num_micro_batch=3, aux_reduction={'max_out': 'mean'},
                      progress_bar=False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    trainer.fit(batches, num_epoch=1)
  warned = {name: str(w.message) for w in caught for name in ('spread', 'constant', 'max_out', 'n_pos')
            if str(w.message).startswith(f"The metric metrics['{name}']")}
  assert set(warned) == {'spread', 'constant', 'max_out'}, [str(w.message) for w in caught]
  assert "aux_reduction={'spread': ...}" in warned['spread'] and 'no combination' in warned['spread']
  assert 'mean, max, min' in warned['constant'] and "aux_reduction={'constant': ...}" in warned['constant']
  got = lambda name: trainer.get_hist_metric('fit', name, 'detailed')
  want = lambda name: reference_trainer.get_hist_metric('fit', name, 'detailed')
  assert got('n_pos').dtype == np.int32 and np.array_equal(got('n_pos'), want('n_pos'))
  np.testing.assert_allclose(got('constant'), want('constant'))
  assert got('max_out')[0] < want('max_out')[0] - 1e-3  # the mean of the micro-batches' maxima


@pytest.mark.parametrize('aux_reduction, error, message', [
  ({'max_out': 'median'}, ValueError, "aux_reduction\\['max_out'\\]='median' is unknown"),
  (['max_out'], TypeError, 'must be a dict'),
  ({3: 'max'}, TypeError, 'aux_reduction key 3'),
])
def test_aux_reduction_is_checked_when_built(aux_reduction, error, message):
  with pytest.raises(error, match=message):
    AccumBPTT(make_model('rnn'), metrics_loss(False), loss_has_aux=True, num_micro_batch=2,
              aux_reduction=aux_reduction)
  with pytest.raises(ValueError, match='loss_has_aux=True'):
    AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, aux_reduction={'a': 'max'})


@pytest.mark.parametrize('aux_reduction, message', [
  ({'nope': 'max'}, "aux_reduction names \\['nope'\\], which loss_fun does not return"),
  ({'per_sample': 'mean'}, "declares 'mean' for metrics\\['per_sample'\\], but it holds one value per sample"),
])
def test_aux_reduction_that_does_not_fit_the_metrics_is_refused_before_any_change(aux_reduction, message):
  model = make_model('rnn')
  before = params_of(model)
  trainer = AccumBPTT(model, metrics_loss(False), optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True,
                      num_micro_batch=3, aux_reduction=aux_reduction, progress_bar=False)
  with pytest.raises(ValueError, match=message):
    trainer.fit(make_batches((10,)), num_epoch=1)
  for p, e in zip(params_of(model), before):
    np.testing.assert_array_equal(p, e)


# ---------------------------------------------------------------- targets whose batch axis is ambiguous

def _class_targets(batch=5):
  """Time-first inputs and one-hot labels (batch, n_class) with n_class == batch; loss on the last step."""
  rng = np.random.RandomState(0)
  x = rng.rand(4, batch, 3).astype('float32')
  y = np.eye(batch, dtype='float32')[rng.randint(0, batch, batch)]
  return [(x, y)] * 3, lambda p, t: bp.losses.cross_entropy_loss(p[-1], t), batch


def _step_targets(batch=5):
  """Time-first inputs with T == batch and (batch, T) targets."""
  rng = np.random.RandomState(1)
  x = rng.rand(batch, batch, 3).astype('float32')
  y = rng.rand(batch, batch).astype('float32')
  return [(x, y)] * 3, lambda p, t: bp.losses.mean_squared_error(p[..., 0].T, t), 1


@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.parametrize('case', [_class_targets, _step_targets], ids=['n_class==B', 'T==B'])
def test_target_with_two_axes_of_the_batch_size_trains_as_bptt(case):
  """The batch axis is decided from evidence (the loss traced with each choice), not guessed."""
  batches, loss, n_out = case()
  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, dict(num_micro_batch=2))):
    bm.random.seed(0)
    with bm.training_environment():
      model = bp.Sequential(bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, n_out))
    trainer = cls(model, loss, optimizer=bp.optim.Adam(lr=0.05), data_first_axis='T', progress_bar=False, **kwargs)
    trainer.fit(batches, num_epoch=1)
    results.append((params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert_trained_alike(*results)

@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended

def test_loss_drawing_random_numbers_without_jit_is_placed_checked_and_trains_as_bptt():
  """jit=False, a loss with a metric that draws from bm.random, and one-hot targets whose batch axis is found by
  tracing the loss: the loss is traced for shapes with brainstate's eval_shape, which leaves the random key as
  it was (JAX's own made BrainPy refuse the tracer written into the key: every target axis was rejected, and
  the first-batch check said 'Could not check')."""
  batches, loss, n_out = _class_targets()

  def noisy(predicts, targets):
    return loss(predicts, targets) + 0. * bm.random.normal(), {'mean_out': bm.mean(predicts)}

  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, dict(num_micro_batch=2))):
    bm.random.seed(0)
    with bm.training_environment():
      model = bp.Sequential(bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, n_out))
    trainer = cls(model, noisy, optimizer=bp.optim.Adam(lr=0.05), data_first_axis='T', progress_bar=False,
                  jit=False, loss_has_aux=True, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      trainer.fit(batches, num_epoch=1)
    assert not [w for w in caught if 'check' in str(w.message) or 'couples' in str(w.message)], caught
    results.append((params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert_trained_alike(*results)


def test_target_that_evidence_cannot_place_is_refused_naming_target_batch_axis():
  """A loss that broadcasts either way gives no evidence: the error names target_batch_axis and the shape,
  before anything changes; target_batch_axis=0 then trains."""
  batches, _, _ = _step_targets()
  loss = lambda p, t: bm.mean((bm.mean(p) - t) ** 2)
  model = make_model('rnn', n_out=1)
  before = params_of(model)
  trainer = AccumBPTT(model, loss, num_micro_batch=2, data_first_axis='T', progress_bar=False)
  with pytest.raises(ValueError, match=r'targets of shape \(5, 5\).*ambiguous.*target_batch_axis'):
    trainer.fit(batches, num_epoch=1)
  for p, e in zip(params_of(model), before):
    np.testing.assert_array_equal(p, e)
  AccumBPTT(model, loss, num_micro_batch=2, data_first_axis='T', target_batch_axis=0,
            progress_bar=False).fit(batches, num_epoch=1)


# ---------------------------------------------------------------- whole_batch_loss with a monitored parameter

def test_whole_batch_loss_carries_the_gradient_of_a_monitored_parameter():
  """``0.05 * mean(W ** 2)`` of a monitored read-out weight, beside a batch maximum: the two-pass mode pulls
  its gradient back (through the last micro-batch) and equals bp.BPTT; it is not treated as a constant."""
  def loss(outputs, targets):
    predicts, monitors = outputs
    return (bp.losses.mean_squared_error(predicts, targets) + 0.05 * bm.mean(monitors['W'] ** 2)
            + 0.01 * bm.mean(bm.max(predicts, axis=0) ** 2))

  batches = make_batches((7, 7, 7))
  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, dict(num_micro_batch=3, whole_batch_loss=True))):
    model = make_model('rnn')
    trainer = cls(model, loss, optimizer=bp.optim.Adam(lr=0.05), monitors={'W': 'out.W'}, progress_bar=False,
                  **kwargs)
    trainer.fit(batches, num_epoch=1)
    results.append((params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert_trained_alike(*results)


# ---------------------------------------------------------------- smaller edges

class FlatStateNet(bp.DynamicalSystem):
  """A (batch,) state Variable declared without batch_axis."""

  def __init__(self):
    super().__init__()
    self.dense = bp.dnn.Dense(3, 1)
    self.total = bm.Variable(jnp.zeros(7))

  def reset_state(self, batch_size=None, **kwargs):
    self.total.value = jnp.zeros(batch_size or 7)

  def update(self, x):
    self.total.value = self.total.value + self.dense(x)[:, 0]
    return self.total.value[:, None]


def test_one_dimensional_state_without_batch_axis_gets_the_named_error():
  bm.random.seed(0)
  with bm.training_environment():
    model = FlatStateNet()
  before = params_of(model)
  trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=3, progress_bar=False)
  x, y = np.ones((7, 4, 3), 'float32'), np.zeros((7, 4, 1), 'float32')
  with pytest.raises(ValueError, match=r'Model state .*total of shape \(7,\) has no batch_axis.*batch_axis=0'):
    trainer.fit([(x, y)], num_epoch=1)
  for p, e in zip(params_of(model), before):
    np.testing.assert_array_equal(p, e)


def test_numpy_integers_are_accepted_as_ints():
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=np.int64(3), target_batch_axis=np.int8(0),
                      accumulate_steps=np.int32(2), remat=np.int64(2), clip_grad_norm=np.float32(1.))
  assert trainer.plan_for(10).sizes == (4, 4, 2) and type(trainer.num_micro_batch) is int
  assert trainer.accumulate_steps == 2 and type(trainer.remat) is int
  assert AccumBPTT(make_model('rnn'), 'mean_squared_error', micro_batch_size=np.int32(4)).micro_batch_size == 4
  assert AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch='auto',
                   memory_budget=np.int64(1 << 20)).memory_budget == 1 << 20


@pytest.mark.long
def test_numpy_integers_work_wherever_ints_do():
  """Sizes from array arithmetic (np.int64) for the options and fit's counts: the same run as with ints."""
  batches = make_batches((10, 7))
  results = []
  for n, epochs in ((3, 2), (np.int64(3), np.int64(2))):
    model = make_model('rnn')
    AccumBPTT(model, 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), num_micro_batch=n,
              accumulate_steps={np.int64(0): np.int32(1)}, clip_grad_norm=np.float32(10.), progress_bar=False,
              ).fit(batches, num_epoch=epochs, num_report=np.int64(-1))
    results.append(params_of(model))
  for p, e in zip(*results):
    np.testing.assert_array_equal(p, e)


def test_inputs_without_a_time_axis_get_a_value_error_naming_the_layout():
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, progress_bar=False)
  with pytest.raises(ValueError, match=r"inputs has shape \(6,\), which has no time axis.*\(batch, time, \.\.\.\)"):
    trainer.fit([(np.ones(6, 'float32'), np.ones((6, 2), 'float32'))], num_epoch=1)
