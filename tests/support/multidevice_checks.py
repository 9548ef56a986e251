"""AccumBPTT over a mesh of 8 simulated CPU devices, against bp.BPTT on one device.

JAX fixes its device count when it starts, so these checks run in their own
pytest session with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(``test_mesh.py`` starts it). They are skipped when fewer devices exist.
"""

import warnings

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from brainpy_accum import AccumBPTT, count_all_reduces, plan_micro_batches
from helpers import assert_trees_close, make_batches, make_model, optimizer_state, params_of
from test_equivalence import Scenario, run
from test_metric_layouts import layout_loss
from test_metric_layouts import make_batches as label_batches
from test_metric_layouts import train as train_with_layouts
from test_metrics import DECLARED, assert_same_history
from test_metrics import fit as fit_with_metrics
from test_training_loop import ClippedBPTT, _variable_length_batches, concat, masked_mse, train, windows
from test_written_state import data, written_warnings
from test_written_state import fit as fit_written

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason='needs 8 (simulated) devices')

SIZES = (24, 24, 16)  # multiples of 8 devices (shares of 3, 3, 2 samples); the last one smaller


@pytest.fixture(scope='module')
def mesh():
  return Mesh(np.array(jax.devices()[:8]), ('batch',))


def _compare(scenario, mesh, **kwargs):
  expected_params, expected_metrics, _ = run(scenario)
  params, metrics, trainer = run(scenario, AccumBPTT, mesh=mesh, **kwargs)
  assert_trees_close(params, expected_params)
  assert_trees_close(metrics, expected_metrics)
  return trainer


@pytest.mark.parametrize('model, num_micro_batch', [('rnn', 1), ('snn', 3)])  # one share whole; uneven (2 + 1)
def test_eight_devices_equal_one_device(mesh, model, num_micro_batch):
  """Params after 6 Adam steps, per-batch losses, metrics and test losses equal bp.BPTT's (3: uneven shares)."""
  trainer = _compare(Scenario(model=model, sizes=SIZES, test_size=8), mesh, num_micro_batch=num_micro_batch)
  assert trainer.compilations['fit'] == 2  # one per batch size
  share = plan_micro_batches(3, num_micro_batch=num_micro_batch).describe().split(' = ')[1]
  assert trainer.describe_batch(24) == f'batch 24 = 8 devices x ({share})'


@pytest.mark.parametrize('saved_on_mesh', [True, False])
def test_a_window_saved_on_eight_devices_resumes_on_one_and_the_reverse(mesh, saved_on_mesh, tmp_path):
  from test_mesh import resume_across_mesh
  resume_across_mesh(saved_on_mesh, tmp_path / 'run.ckpt', mesh, 8)


def test_time_first_dict_inputs_and_summed_loss(mesh):
  _compare(Scenario(sizes=SIZES, time_first=True, dict_inputs=True, model='dict_rnn', test_size=8), mesh, num_micro_batch=2)
  _compare(Scenario(sizes=SIZES, loss='sum', test_size=8), mesh, num_micro_batch=2, grad_reduction='sum')


def test_class_targets_with_time_first_inputs(mesh):
  _compare(Scenario(sizes=SIZES, time_first=True, loss='last_step', test_size=8), mesh, micro_batch_size=1)


def test_accumulate_steps_over_devices(mesh):
  """Two batches per update, with a short last window: bp.BPTT on the concatenated batches."""
  batches = make_batches((16, 8, 16, 24, 8))  # windows 16+8, 16+24 and the short last 8
  params, trainer = train(AccumBPTT, batches, num_micro_batch=2, accumulate_steps=2, mesh=mesh)
  expected, _ = train(bp.BPTT, windows(batches, 2))
  assert_trees_close(params, expected)
  assert trainer.compilations['fit'] == 3  # collecting at 16; updating at 8 and at 24


def test_nonfinite_batch_is_dropped_on_every_device(mesh):
  """A NaN in one device's share drops the whole batch from its window, on all devices alike."""
  batches = make_batches((16, 8, 16, 8))
  bad_x = batches[1][0].copy()
  bad_x[5, 2, 0] = np.nan  # sample 5: the share of device 5 only
  batches[1] = (bad_x, batches[1][1])
  params, trainer = train(AccumBPTT, batches, num_micro_batch=2, accumulate_steps=2, skip_nonfinite=True,
                          mesh=mesh)
  expected, _ = train(bp.BPTT, [batches[0], concat(batches[2:])])
  assert_trees_close(params, expected)
  assert int(trainer.skipped_steps.value) == 2  # once per epoch


def test_masked_loss_weights_add_up_over_devices(mesh):
  """loss_weight_fn: the devices' weighted sums make the whole batch's normalised masked loss."""
  batches = _variable_length_batches()
  valid_steps = lambda inputs, targets: targets['mask'].sum()
  params, _ = train(AccumBPTT, batches, loss=masked_mse, num_micro_batch=1, loss_weight_fn=valid_steps, mesh=mesh)
  expected, _ = train(bp.BPTT, batches, loss=masked_mse)
  assert_trees_close(params, expected)


def test_clipping_and_memory_planner_over_devices(mesh):
  """clip_grad_norm clips the gradient combined over devices; 'auto' plans each device's share."""
  batches = make_batches((16, 8))
  params, _ = train(AccumBPTT, batches, num_micro_batch=2, clip_grad_norm=ClippedBPTT.max_norm, mesh=mesh)
  expected, _ = train(ClippedBPTT, batches)
  assert_trees_close(params, expected)
  params, trainer = train(AccumBPTT, batches, num_micro_batch='auto', memory_budget='1MiB', mesh=mesh)
  expected, _ = train(bp.BPTT, batches)
  assert_trees_close(params, expected)
  plan, used = trainer.memory_plans[16]
  assert plan.batch_size == 2 and used <= 2 ** 20  # 16 samples: 2 per device, planned per device


def test_all_reduce_once_per_update_whatever_num_micro_batch(mesh):
  """The compiled step adds the devices' gradients in one all-reduce, outside every loop, for any N."""
  x, y = make_batches((64,))[0]
  counts = []
  for num_micro_batch in (1, 2, 4, 8):
    model = make_model('rnn')
    model.reset(64)
    trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=num_micro_batch, mesh=mesh)
    counts.append(count_all_reduces(trainer.compile_step(x, y).as_text()))
  num_params = sum(p.size for p in params_of(model))
  assert [c.total for c in counts] == [1] * 4, counts
  assert [c.in_loops for c in counts] == [0] * 4, counts
  assert all(num_params <= c.elements <= num_params + 4 for c in counts), (num_params, counts)


def test_window_steps_do_not_reduce_gradients(mesh):
  """With accumulate_steps the gradients cross devices only in the step that updates."""
  x, y = make_batches((64,))[0]
  model = make_model('rnn')
  model.reset(64)
  trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=4, mesh=mesh, accumulate_steps=4)
  num_params = sum(p.size for p in params_of(model))
  collect = count_all_reduces(trainer.compile_step(x, y, update=False).as_text())
  update = count_all_reduces(trainer.compile_step(x, y, update=True).as_text())
  assert collect.in_loops == update.in_loops == 0
  assert collect.elements < 8 <= num_params <= update.elements, (collect, update)  # only the loss and weights


@pytest.mark.parametrize('options', [dict(num_micro_batch=1), dict(num_micro_batch=2),
                                     dict(num_micro_batch=1, accumulate_steps=2)])
def test_written_weights_over_devices(mesh, options):
  """A layer whose update clips its weights, batch 16 over 8 devices (with accumulate_steps, two batches of 8):
  every device's micro-batches start from the step's weights (bp.BPTT's parameters and time-step counter). A
  Hebbian term written into the weights is warned of, also with one micro-batch per device, where only the
  devices' (or the window's batches') writes differ."""
  x, y = data(batch=16)
  batches = [(x[:8], y[:8]), (x[8:], y[8:])] if 'accumulate_steps' in options else [(x, y)]
  params, caught = fit_written(AccumBPTT, 'clip', 'adam', batches=batches, mesh=mesh, **options)
  assert_trees_close(params, fit_written(bp.BPTT, 'clip', 'adam', batches=[(x, y)])[0])
  assert not written_warnings(caught), caught
  _, caught = fit_written(AccumBPTT, 'hebb', batches=batches, mesh=mesh, **options)
  found = written_warnings(caught)
  assert len(found) == 1 and '.W is written' in found[0], caught


def test_counter_sees_a_reduction_inside_the_loop(mesh):
  """Control for the tests above: a psum inside a scan body is found and counted as in a loop."""
  def per_step(x):
    return jax.lax.scan(lambda c, xi: (c + jax.lax.psum(xi.sum(), 'batch'), None), 0., x)[0]
  fn = jax.jit(jax.shard_map(per_step, mesh=mesh, in_specs=PartitionSpec('batch'), out_specs=PartitionSpec()))
  count = count_all_reduces(fn.lower(jnp.ones((8 * 100, 4))).compile().as_text())  # 100 steps per device
  assert count.in_loops >= 1


def test_batch_not_divisible_by_devices_is_rejected_before_any_change(mesh):
  model = make_model('rnn')
  trainer = AccumBPTT(model, 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.1), num_micro_batch=2,
                      mesh=mesh, progress_bar=False)
  params, opt_state = params_of(model), optimizer_state(trainer)
  with pytest.raises(ValueError, match=r'batch_size=12 does not split evenly over the 8 devices .* 8 or 16'):
    trainer.fit(make_batches((12,)), num_epoch=1)
  # in a list, after batches that do split, or among the test batches: refused before the first of them trains
  with pytest.raises(ValueError, match=r'Batch 1 of train_data: batch_size=12 does not split .* nothing has changed'):
    trainer.fit(make_batches((16, 12)), num_epoch=1)
  with pytest.raises(ValueError, match=r'Batch 0 of test_data: batch_size=12 does not split evenly'):
    trainer.fit(make_batches((16,)), test_data=make_batches((12,)), num_epoch=1)
  assert_trees_close(params_of(model), params, rtol=0, atol=0)
  assert_trees_close(optimizer_state(trainer), opt_state, rtol=0, atol=0)


def test_listed_batches_are_checked_as_fit_traces_them(mesh):
  """The up-front check of a list's batches traces the model where target axes are ambiguous (8 steps, 8 samples):
  in fit's setting (brainstate.environ fit=True), which the model reads; a target list of numbers still gets the
  loop's own message (its place and np.asarray), not the check's."""
  import brainstate

  class Net(bp.DynamicalSystem):
    def __init__(self):
      super().__init__()
      self.rnn, self.out = bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, 2)

    def update(self, x):
      return self.out(self.rnn(x) * (1. if brainstate.environ.get('fit') else 0.5))

  data, losses = make_batches((8, 8), num_time=8), []
  for on in (None, mesh):
    bm.random.seed(0)
    with bm.training_environment():
      model = Net()
    trainer = AccumBPTT(model, bp.losses.mean_squared_error, num_micro_batch=2, progress_bar=False, mesh=on)
    trainer.fit(data, num_epoch=1)
    losses.append(np.asarray(trainer.train_losses))
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
  with pytest.raises(ValueError, match=r'targets as a Python list of 8 numbers in batch 1.*np\.asarray'):
    trainer.fit([data[0], (data[1][0], [0.5] * 8)], num_epoch=2)


@pytest.mark.parametrize('batch, num_micro_batch', [(8, 1), (8, 3), (16, 3), (40, 2), (4, 1), (20, 2), (1, 1)])
def test_batch_sizes_against_devices_and_micro_batches_train_as_bptt_or_are_refused(mesh, batch, num_micro_batch):
  """Batch sizes against 8 devices and N: a multiple of 8 trains as bp.BPTT (N larger than a device's share
  runs one sample per micro-batch); any other size is refused with ValueError before anything changes."""
  data = make_batches((batch,), seed=batch)
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.1),
                      num_micro_batch=num_micro_batch, mesh=mesh, progress_bar=False)
  before = params_of(trainer.target) + optimizer_state(trainer)
  if batch % 8:
    with pytest.raises(ValueError, match=f'batch_size={batch} does not split evenly over the 8 devices'):
      trainer.fit(data, num_epoch=1)
    assert_trees_close(params_of(trainer.target) + optimizer_state(trainer), before, rtol=0, atol=0)
    return
  trainer.fit(data, num_epoch=1)
  reference = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.1), progress_bar=False)
  reference.fit(data, num_epoch=1)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))


def test_two_axis_mesh_splits_the_named_axis():
  """A mesh from jax.make_mesh (Explicit axis types) with a replica axis: only 'batch' splits the batch."""
  grid = jax.make_mesh((4, 2), ('batch', 'replica'))
  _compare(Scenario(sizes=(8, 8, 4), test_size=4), grid, num_micro_batch=2, mesh_axis='batch')  # shares 2, 2, 1


def test_memory_per_device_falls_with_devices(mesh):
  """XLA's per-device temporary memory of the step shrinks as more devices share the batch."""
  x, y = make_batches((64,), num_time=10)[0]
  temps = []
  for count in (1, 2, 4, 8):
    model = make_model('rnn', n_hidden=16)
    model.reset(64)
    sub = Mesh(np.array(jax.devices()[:count]), ('batch',))
    trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2, mesh=sub)
    temps.append(trainer.compile_step(x, y).memory_analysis().temp_size_in_bytes)
  assert temps == sorted(temps, reverse=True) and temps[-1] < 0.3 * temps[0], temps


def test_devices_draw_different_random_numbers(mesh):
  """A model with noise inside the step: the same sample on two devices gets different noise."""
  class Noisy(bp.DynamicalSystem):
    def __init__(self):
      super().__init__()
      self.out = bp.dnn.Dense(3, 2)

    def update(self, x):
      return self.out(x + bm.random.normal(size=x.shape))

  bm.random.seed(0)
  with bm.training_environment():
    model = Noisy()
  seen = []

  def loss(predicts, targets):
    jax.debug.callback(lambda p: seen.append(np.asarray(p)), predicts)
    return bp.losses.mean_squared_error(predicts, targets)

  trainer = AccumBPTT(model, loss, num_micro_batch=1, mesh=mesh, progress_bar=False)
  x = np.ones((8, 4, 3), 'float32')  # identical samples, one per device
  batches = [(x, np.zeros((8, 4, 2), 'float32'))]
  trainer.fit(batches, num_epoch=1)
  # The first batch's loss check records too, beside the step (in any order): at each of its three random points
  # (two random outputs and a third at other levels), the 8 one-sample micro-batch losses and the whole batch's:
  # 27 calls, 3 on the whole batch. The step: one call per device.
  assert len(seen) == 35
  assert sorted(s.shape for s in seen) == [(1, 4, 2)] * 32 + [(8, 4, 2)] * 3
  seen.clear()
  trainer.fit(batches, num_epoch=1)  # the step alone (the check runs once)
  assert len(seen) == 8
  outputs = np.concatenate([s.reshape(-1, 2) for s in seen])
  assert len(np.unique(outputs.round(5), axis=0)) == len(outputs)


def test_devices_benchmark_measures():
  """``python -m brainpy_accum.bench.mesh`` at a tiny size: figures come out and the table is written."""
  from brainpy_accum.bench.mesh import markdown, measure_one
  from brainpy_accum.bench.workloads import Shape

  tiny = Shape(batch=16, time=4, hidden=8, inputs=4)
  rows = [measure_one('rnn', tiny, devices, 2, steps=1) for devices in (None, 8)]
  assert rows[0]['all_reduce'] == 0 and rows[1]['all_reduce'] == 1 and rows[1]['all_reduce_in_loops'] == 0
  assert rows[1]['temp'] < rows[0]['temp'] and rows[1]['step_s'] > 0
  assert '| rnn | no mesh | 2 |' in markdown(rows, '# Scaling') and '| rnn | 8 | 2 |' in markdown(rows, '#')


def test_stateful_chunks_and_predict_over_devices(mesh):
  """reset_state=False carries each sample's state on its device; predict after fit sees the same model, with its
  progress bar asked for (an ordered host callback: JAX refuses it in a program over the mesh's devices)."""
  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, {'num_micro_batch': 2, 'mesh': mesh})):
    model = make_model('snn')
    trainer = cls(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                  **kwargs)
    model.reset(16)
    trainer.fit(make_batches((16, 16, 16)), num_epoch=1, reset_state=False)
    state = [np.asarray(model.lif.V), np.asarray(model.lif.t_last_spike)]
    trainer.progress_bar = True
    predicted = np.asarray(trainer.predict(make_batches((8,), seed=3)[0][0], reset_state=True))
    results.append((params_of(model), np.asarray(trainer.train_losses), state, predicted))
  assert_trees_close(results[1], results[0])


@pytest.mark.parametrize('case', ['rate_regulariser_snn', 'batch_max_rnn', 'contrastive_rnn'])
def test_whole_batch_loss_over_devices_equals_bptt(mesh, case):
  """Coupled losses on 8 devices: outputs gathered, the loss of the whole batch on every device, each device
  pulls back its own share; one gradient all-reduce. Batches of 16 and 24: 2 and 3 samples per device."""
  from test_whole_batch_loss import CASES, _assert_same_run, _trainer
  model, loss, monitored, _ = CASES[case]
  CASES[case + '_mesh'] = (model, loss, monitored, (16, 24, 16))
  try:
    batches = make_batches((16, 24, 16))
    expected = _trainer(bp.BPTT, case + '_mesh')
    expected.fit(batches, test_data=batches[:1], num_epoch=2)
    actual = _trainer(AccumBPTT, case + '_mesh', num_micro_batch=2, whole_batch_loss=True, mesh=mesh)
    actual.fit(batches, test_data=batches[:1], num_epoch=2)
    _assert_same_run(actual, expected)
    x, y = batches[0]
    actual.target.reset(16)
    assert count_all_reduces(actual.compile_step(x, y).as_text()).in_loops == 0
  finally:
    del CASES[case + '_mesh']


@pytest.mark.parametrize('options', [{'num_micro_batch': 1}, {'num_micro_batch': 'auto', 'memory_budget': '1GiB'}])
def test_whole_batch_loss_with_one_micro_batch_per_device_equals_bptt(mesh, options):
  """A device's share in one micro-batch (a plan of one, 'auto' with room, a short batch of one sample per
  device): shard_map's first trace sees every device's samples, so the one micro-batch must be cut to the share
  like any other (it ran uncut: the loss got 8 x 16 outputs against 16 targets, TypeError)."""
  from test_whole_batch_loss import CASES, _assert_same_run, _trainer
  model, loss, monitored, _ = CASES['batch_max_rnn']
  CASES['one_mesh'] = (model, loss, monitored, (16, 8))
  try:
    batches = make_batches((16, 8))
    expected = _trainer(bp.BPTT, 'one_mesh')
    expected.fit(batches, test_data=batches[:1], num_epoch=2)
    actual = _trainer(AccumBPTT, 'one_mesh', whole_batch_loss=True, mesh=mesh, **options)
    actual.fit(batches, test_data=batches[:1], num_epoch=2)
    _assert_same_run(actual, expected)
  finally:
    del CASES['one_mesh']


def test_whole_batch_loss_over_devices_differentiates_terms_that_read_the_parameters(mesh):
  """A weight regulariser in loss_fun beside a batch maximum: every device differentiates the whole batch's loss
  with respect to the parameters it reads and adds its 1/8 share, so the one all-reduce sums that part once."""
  from test_whole_batch_loss import _assert_same_run, regularised_trainer
  batches = make_batches((16, 24))
  expected = regularised_trainer(bp.BPTT)
  actual = regularised_trainer(AccumBPTT, num_micro_batch=2, whole_batch_loss=True, mesh=mesh)
  for run_ in (expected, actual):
    run_.fit(batches, test_data=batches[:1], num_epoch=2)
  _assert_same_run(actual, expected)


@pytest.mark.parametrize('time_first, options', [(False, dict(num_micro_batch=2, aux_reduction=DECLARED)),
                                                 (False, dict(num_micro_batch=2, whole_batch_loss=True))])
def test_metrics_over_devices_equal_bptt(mesh, time_first, options):
  """Per-sample metrics gathered from the devices' shares (3 samples each: 2 + 1), a declared max (pmax) and an
  int32 count (in the step's one all-reduce), a mean: the history equals bp.BPTT's, shapes and dtypes too."""
  expected_params, expected, _, _ = fit_with_metrics(bp.BPTT, time_first, sizes=(24, 24), test_size=16)
  params, history, _, caught = fit_with_metrics(AccumBPTT, time_first, sizes=(24, 24), test_size=16, mesh=mesh,
                                                **options)
  assert_trees_close(params, expected_params)
  assert_same_history(history, expected)
  assert history['fit', 'detailed', 'n_pos'].dtype == np.int32
  assert not [c for c in caught if c.startswith('The metric')], caught


@pytest.mark.parametrize('loss, options', [('rate', {}), ('sum', {'grad_reduction': 'sum'})])
def test_batch_statistics_over_devices_equal_bptt(mesh, loss, options):
  """A loss with batch statistics on 8 devices: their sums added over the devices (with the batch's weight) in the
  statistics' pass, every share's micro-batches seeing the whole batch's; with 'sum', the statistics' term counted
  once over the devices. Parameters, losses and metrics equal bp.BPTT's."""
  from test_batch_statistics import _fit, _history, rate_regularised, summed_with_rate
  loss = {'rate': rate_regularised, 'sum': summed_with_rate}[loss]
  batches = make_batches((24, 24))  # (bp.BPTT cannot stack the per-sample metric of batches of other sizes)
  expected, expected_params, _ = _fit(bp.BPTT, loss, batches)
  trainer, params, caught = _fit(AccumBPTT, loss, batches, num_micro_batch=2, mesh=mesh, **options)
  assert not [c for c in caught if 'couples' in c or 'metric' in c], caught
  assert_trees_close(params, expected_params, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5, atol=1e-6)
  names = ('reg',)
  np.testing.assert_allclose(_history(trainer, names)['reg'], _history(expected, names)['reg'], rtol=1e-5, atol=1e-6)


def test_flattened_metrics_over_devices_equal_bptt(mesh):
  """The gallery's time-major ``(T * B, 3)`` outputs and a batch-major copy (issue 56), gathered from the devices'
  shares (3 samples each: 2 + 1) block by block: bp.BPTT's parameters and history of both."""
  loss, data = layout_loss(['time_major', 'batch_major'], time_first=True), label_batches(2, 24)
  expected = train_with_layouts(bp.BPTT, loss, data)
  run = train_with_layouts(AccumBPTT, loss, data, num_micro_batch=2, mesh=mesh)
  assert run.error is None, run.error
  assert_trees_close(run.params, expected.params)
  assert_trees_close(run.history, expected.history)


def test_first_batch_check_on_the_host_beside_the_device(monkeypatch):
  """The chip's path (a TPU beside its host's CPU), with device 1 standing for the host and device 0 for the chip:
  the check of a batch of NumPy data is compiled for device 1, the Variables' values copied there, and sees a
  coupled loss as on the default device (one warning), and a mean as silent; a batch held on device 0 keeps its
  check there (no copy of the data), and so does a check too large for the host's available memory."""
  import test_coupled_loss
  from brainpy_accum.memory import _device
  from brainpy_accum.trainer import _coupled_loss, _fit_check
  ran_on, real = [], _fit_check.CheckProgram.compile

  def recorded(program):
    compiled, values = real(program)
    ran_on.append({d for leaf in jax.tree_util.tree_leaves(values) for d in leaf.devices()})
    return compiled, values

  monkeypatch.setattr(_coupled_loss, 'check_device', lambda: jax.devices()[1])
  monkeypatch.setattr(_fit_check.CheckProgram, 'compile', recorded)
  with pytest.warns(UserWarning, match='couples the samples') as record:
    test_coupled_loss._fit(test_coupled_loss.batch_normalised, model='rnn')
  assert len(test_coupled_loss._coupled(record)) == 1 and ran_on == [{jax.devices()[1]}], ran_on
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    trainer = AccumBPTT(make_model('rnn'), lambda p, t: bm.mean((p - t) ** 2), num_micro_batch=3, progress_bar=False)
    trainer.fit([(jax.device_put(x, jax.devices()[0]), y) for x, y in make_batches((10,))], num_epoch=1)
  assert not [w for w in record if 'couples' in str(w.message) or 'Could not check' in str(w.message)], record
  assert ran_on[1:] == [{jax.devices()[0]}], ran_on
  monkeypatch.setattr(_fit_check, 'host_available_bytes', lambda: 2 * 1024)  # (the check takes more than 1 KiB)
  with pytest.warns(UserWarning, match='couples the samples') as record:
    test_coupled_loss._fit(test_coupled_loss.batch_normalised, model='rnn')
  assert len(test_coupled_loss._coupled(record)) == 1 and ran_on[2:] == [{jax.devices()[0]}], ran_on
