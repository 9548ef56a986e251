"""The default mode's first-batch check sees a coupled loss at random outputs, whatever the model's first outputs."""

import contextlib
import gc
import threading
import warnings

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.trainer._coupled_loss import MEANS_OVER_ELEMENTS, _could_not_check, conclude
from brainpy_accum.trainer._feed import overlapping
from brainpy_accum.trainer._fit_check import check_device, check_on_host
from brainpy_accum.trainer._random_outputs import CheckNames, loss_at_random_outputs
from helpers import SIMULATED_DEVICE, assert_trees_close, make_batches, make_model, params_of
from simulated_device import simulated_device

SIZES = (10, 7)


def spike_count_penalties(predicts, targets):
  """Mean-squared error plus ``1e-5 * sum(spikes)`` and a squared spike count summed over the batch (the kind
  of regulariser BrainPy's SNN tutorial adds): both 0 in value while no neuron spikes, not in gradient."""
  out, mons = predicts
  spikes = mons['spike']
  return (bp.losses.mean_squared_error(out, targets) + 1e-5 * bm.sum(spikes)
          + 1e-5 * bm.sum(bm.sum(spikes, axis=(0, 1)) ** 2))


def squared_spike_count(predicts, targets):
  """Only the squared count: its gradient is 0 too while no neuron spikes."""
  out, mons = predicts
  return bp.losses.mean_squared_error(out, targets) + 1e-3 * bm.sum(bm.sum(mons['spike'], axis=(0, 1)) ** 2)


def error_per_spike(predicts, targets):
  """Squared error divided by the batch's spike count: at outputs that are never 0 the count is every entry (a
  mean over elements, exact); with 0-or-1 spikes it is not."""
  out, mons = predicts
  return bm.sum((out - targets) ** 2) / bm.maximum(bm.sum(mons['spike'] != 0), 1)


def batch_normalised(predicts, targets):
  """Errors of outputs standardised by the batch's own mean and spread."""
  z = (predicts - bm.mean(predicts, axis=0)) / (bm.std(predicts, axis=0) + 1e-3)
  return bm.mean((z - targets) ** 2)


def _fit(loss, model='snn', drive=1., **kwargs):
  net = make_model(model)
  monitors = {'spike': net.lif.spike} if model == 'snn' else None
  trainer = AccumBPTT(net, loss, num_micro_batch=3, monitors=monitors, progress_bar=False, **kwargs)
  trainer.fit([(x * drive, y) for x, y in make_batches(SIZES)], num_epoch=1)
  return trainer


def _coupled(record):
  return [str(w.message) for w in record if 'couples the samples' in str(w.message)]


@pytest.mark.parametrize('loss, point', [  # the counts in the long suite: README suite time
  pytest.param(spike_count_penalties, 'uniform', marks=pytest.mark.long), pytest.param(squared_spike_count, 'uniform', marks=pytest.mark.long),
  (error_per_spike, '0 or 1')])
def test_quiet_first_batch_warns(loss, point):
  """No spike at all in the first batch (no input): the penalties are 0 on every micro-batch, as on the whole
  batch, so the model's own outputs would hide the coupling; random outputs in their place show it."""
  with pytest.warns(UserWarning, match='couples the samples') as record:
    _fit(loss, drive=0.)
  (message,) = _coupled(record)
  assert f'random outputs ({point}' in message and 'micro-batches is' in message
  assert 'whole_batch_loss=True' in message


def test_loss_normalised_by_batch_statistics_warns():
  with pytest.warns(UserWarning, match='couples the samples') as record:
    _fit(batch_normalised, model='rnn')
  assert len(_coupled(record)) == 1


def test_check_on_the_host_warns_as_on_the_device():
  """The chip's path forced on the CPU, end to end (whose host is the device: the rules are tested apart below,
  and eight simulated devices in ``multidevice_checks.py`` tell host and device apart): the check lowered for the
  host's CPU, with the Variables' values placed there, sees the coupling too."""
  with check_on_host(True), pytest.warns(UserWarning, match='couples the samples') as record:
    assert check_device().platform == 'cpu'
    _fit(batch_normalised, model='rnn')
  assert len(_coupled(record)) == 1
  with check_on_host(False):
    assert check_device() is None


class _Jitted:
  """A check's ``bm.jit`` as :class:`CheckProgram` uses it (``jitted_fun.lower``); ``host_fails``: its
  compilation for values on a device (the host's copies; the defaults' are NumPy here) raises."""

  def __init__(self, host_fails=False):
    self.jitted_fun, self._host_fails = self, host_fails
    self._jit = jax.jit(lambda values, x, y: (values, jnp.sum(values[0]) + jnp.sum(x) + jnp.sum(y)))

  def lower(self, values, *args):
    lowered = self._jit.lower(values, *args)
    if self._host_fails and isinstance(values[0], jax.Array):
      lowered.compile = lambda **options: (_ for _ in ()).throw(RuntimeError('no such op on this backend'))
    return lowered


@pytest.mark.parametrize('case', ['host', 'no device', 'room unknown', 'room small', 'over the cap', 'host fails'])
def test_check_program_runs_on_the_host_only_where_it_should(case, monkeypatch):
  """Where the check compiles, by each rule of :class:`CheckProgram`: the host's CPU, with the Variables' values
  copied there, only where it is given, its compilation succeeds and the program fits the host's room and the cap;
  else the default device, on the values as they are (NumPy here: which values come back tells the two apart)."""
  from brainpy_accum.trainer import _fit_check
  values, x, y = [np.ones(3, np.float32)], np.ones((2, 4), np.float32), np.zeros(2, np.float32)
  monkeypatch.setattr(_fit_check, 'host_available_bytes', {'room unknown': lambda: None, 'room small': lambda: 256}
                      .get(case, lambda: 2 ** 40))
  if case == 'over the cap':
    monkeypatch.setattr(_fit_check, 'HOST_CHECK_BYTES', 64)  # (its arguments and outputs alone: 68 bytes)
  device = None if case == 'no device' else jax.devices('cpu')[0]
  compiled, used = _fit_check.CheckProgram(device, _Jitted(host_fails=case == 'host fails'), values, x, y).compile()
  assert (used is not values and isinstance(used[0], jax.Array)) == (case == 'host'), (case, used)
  assert float(compiled(used, x, y)[1]) == 11.


def test_the_check_keeps_no_array_after_it_is_done():
  """The first-batch check let go of what it ran on once it is done: it kept the batch's model state as the
  check started (for a check of fewer samples, should the device refuse the whole) for the trainer's lifetime:
  on a chip, a second copy of the whole batch's state beside training (found by a second reviewer)."""
  model = make_model('rnn', n_hidden=37)
  trainer = AccumBPTT(model, batch_normalised, num_micro_batch=2, progress_bar=False)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    trainer.fit(make_batches((10, 10)), num_epoch=1)
  gc.collect()
  states = [v for v in model.vars().unique().values() if np.shape(v) == (10, 37)]
  held = [a for a in jax.live_arrays() if a.shape == (10, 37)]
  assert len(states) == 1 and len(held) == 1, (len(states), len(held))


def host_normalised(predicts, targets):
  """Squared error divided by the batch's largest output, taken on the host by a callback (no ``vmap_method``):
  the check still sees the coupling."""
  peak = jax.pure_callback(lambda p: np.asarray(np.abs(p).max() + 1., np.float32),
                           jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(bm.as_jax(predicts)))
  return bm.mean((predicts - targets) ** 2) / peak


@pytest.mark.host_callback('the loss takes its peak on the host')
def test_loss_with_a_host_callback_is_checked():
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    _fit(host_normalised, model='rnn')
  assert len(_coupled(record)) == 1 and not [w for w in record if 'Could not check' in str(w.message)]


def _masked_mean(predicts, targets):
  mask = (bm.arange(predicts.shape[1]) < 3)[None, :, None]
  return bm.sum(((predicts - targets) ** 2) * mask) / (bm.sum(mask * bm.ones_like(predicts)))


@pytest.mark.parametrize('loss, options', [
  ('mean_squared_error', {}),
  pytest.param(_masked_mean, dict(loss_weight_fn=lambda x, y: np.float32(x.shape[0] * 3)),
               marks=(pytest.mark.long, pytest.mark.extended)),
  pytest.param(lambda p, t: bm.sum(bm.mean((p - t) ** 2, axis=(1, 2))), dict(grad_reduction='sum'),
               marks=pytest.mark.long),  # README suite time
], ids=['per_sample_mean', 'masked_mean_with_loss_weight_fn', 'sum'])
def test_losses_that_accumulate_exactly_stay_silent(loss, options):
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    _fit(loss, model='rnn', **options)
    per_sample = bp.losses.mean_squared_error if isinstance(loss, str) else loss
    _fit(lambda p, t: per_sample(p[0], t), model='snn', drive=0., **options)  # spikes monitored, not in the loss
  assert not _coupled(record) and not [w for w in record if 'Could not check' in str(w.message)]


@pytest.mark.parametrize('options', [{}, dict(grad_reduction='sum'), dict(loss_weight_fn=lambda x, y: 1.)],
                         ids=['defaults', 'sum', 'loss_weight_fn'])
def test_coupled_warning_offers_a_fix_that_is_accepted(options):
  """The coupled-loss warning's fix, followed as it says, is accepted whatever the trainer's options:
  whole_batch_loss=True trains loss_fun of the whole batch as it is, with the weighing options at their defaults."""
  from brainpy_accum.trainer._random_outputs import POINTS, warn_coupled_loss
  with pytest.warns(UserWarning, match='couples the samples') as caught:
    assert warn_coupled_loss(1., 2., plan_micro_batches(6, num_micro_batch=2), options.get('grad_reduction', 'mean'),
                             POINTS[0])
  text = str(caught[0].message)
  assert 'whole_batch_loss=True (with grad_reduction and loss_weight_fn left at their defaults)' in text
  assert 'shrinks' not in text
  AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, bp.optim.Adam(lr=0.01), whole_batch_loss=True,
            num_micro_batch=2, progress_bar=False)  # the fix: accepted
  with pytest.raises(ValueError, match='whole_batch_loss') if options else contextlib.nullcontext():
    AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, bp.optim.Adam(lr=0.01), whole_batch_loss=True,
              num_micro_batch=2, progress_bar=False, **options)  # the options kept: refused, as the warning says


@pytest.mark.parametrize('loss', MEANS_OVER_ELEMENTS, ids=lambda f: f.__name__)
def test_brainpys_means_over_elements_are_size_weighted_means_of_any_split(loss):
  """Why the check may skip them: on any values, any tree of outputs and any cut of the batch, the whole batch's
  loss is the size-weighted mean of the micro-batch losses."""
  rng = np.random.RandomState(0)
  for cut in ([3, 3, 1], [1, 6], [2, 2, 2, 1]):
    predicts = {'a': rng.randn(7, 4, 2).astype(np.float32), 'b': rng.randn(7, 3).astype(np.float32)}
    targets = {'a': rng.randn(7, 4, 2).astype(np.float32), 'b': rng.randn(7, 3).astype(np.float32)}
    starts = np.cumsum([0] + cut)
    part = lambda tree, i: {k: v[starts[i]:starts[i + 1]] for k, v in tree.items()}
    combined = sum(n * float(loss(part(predicts, i), part(targets, i))) for i, n in enumerate(cut)) / 7
    np.testing.assert_allclose(float(loss(predicts, targets)), combined, rtol=1e-5)


def test_brainpys_mean_losses_skip_the_check_and_train_as_a_checked_copy(monkeypatch):
  """``loss_fun=bp.losses.mean_squared_error`` compiles nothing for the check; the same loss wrapped in a lambda is
  checked (silently) and trains to the same parameters."""
  from brainpy_accum.trainer import _coupled_loss
  calls = []
  checked = _coupled_loss.check_first_batch
  monkeypatch.setattr(_coupled_loss, 'check_first_batch', lambda *a, **k: calls.append(1) or checked(*a, **k))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    skipped = _fit(bp.losses.mean_squared_error, model='rnn')
    assert calls == []
    wrapped = _fit(lambda p, t: bp.losses.mean_squared_error(p, t), model='rnn')
    assert calls == [1]
  assert not _coupled(record) and not [w for w in record if 'Could not check' in str(w.message)]
  assert_trees_close(params_of(skipped.target), params_of(wrapped.target), rtol=0, atol=0)


@pytest.mark.parametrize('jit', [True, pytest.param(False, marks=pytest.mark.long)])  # README suite time
def test_loss_that_writes_a_variable_is_checked_and_the_variable_stays_concrete(jit):
  """A per-sample mean that also keeps a running statistic in a Variable of its own: checked, silent, and the
  Variable holds an array afterwards (no tracer of the check left in it)."""
  stat = bm.Variable(jnp.zeros(()))

  def loss(p, t):
    stat.value = 0.9 * stat.value + 0.1 * jax.lax.stop_gradient(bm.as_jax(bm.mean(p)))
    return bm.mean((p - t) ** 2)

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    _fit(loss, model='rnn', jit=jit)
  assert not _coupled(record) and not [w for w in record if 'Could not check' in str(w.message)]
  assert np.isfinite(np.asarray(stat.value + 1.))


def test_check_traced_beside_the_first_step_warns_even_when_a_later_batch_fails():
  """The check is traced once the first step is dispatched and finished later: a second batch that fails
  (targets for fewer samples than its inputs: a ValueError before anything changes) still gets the first
  step's warning, and no thread of the check outlives fit."""
  (x, y), = make_batches((10,))
  bad = (x, y[:6])
  trainer = AccumBPTT(make_model('rnn'), batch_normalised, num_micro_batch=3, progress_bar=False)
  with pytest.warns(UserWarning, match='couples the samples') as record, pytest.raises(ValueError):
    trainer.fit([(x, y), bad], num_epoch=1)
  assert len(_coupled(record)) == 1
  assert not [t for t in threading.enumerate() if 'first-batch check' in t.name]


# ---------------------------------------------------------------- couplings through batch statistics (issue 39)

def voltage_regularised(coefficient):
  """Cross entropy of the last step plus ``coefficient * (mean of the monitored voltage over time, batch and
  neurons) ** 2``: the membrane regulariser of a course's spiking working-memory network, which couples the
  samples through the batch-wide mean however small its coefficient."""
  def loss(predicts, labels):
    out, mons = predicts
    return bp.losses.cross_entropy_loss(out[:, -1], labels) + coefficient * bm.mean(mons['V']) ** 2
  return loss


def per_sample_voltage_regularised(predicts, labels):
  """The same regulariser per sample (each sample's mean voltage squared, then the mean over samples)."""
  out, mons = predicts
  return bp.losses.cross_entropy_loss(out[:, -1], labels) + 1e-3 * bm.mean(bm.mean(mons['V'], axis=(1, 2)) ** 2)


def _labelled(sizes, num_time=20):
  """Batches whose targets are class labels (the last step's larger target)."""
  return [(x, np.argmax(y[:, -1], -1).astype('int32')) for x, y in make_batches(sizes, num_time=num_time)]


@pytest.mark.parametrize('loss, coupled', [(voltage_regularised(1e-3), True), (per_sample_voltage_regularised, False)],
                         ids=['batch_mean', 'per_sample'])
def test_regulariser_of_a_monitored_voltage_warns_only_when_batch_wide(loss, coupled):
  """The issue's case on the spiking model, voltage monitored as bp.BPTT monitors it: at i.i.d. random outputs
  every micro-batch's mean voltage is the batch's to a fraction of a percent, so the coupling (1e-3 x their
  spread) hid under the tolerance; with each micro-batch at a level of its own it shows, in value and in the
  gradient with respect to the voltage. The same regulariser taken per sample stays silent."""
  net = make_model('snn')
  trainer = AccumBPTT(net, loss, num_micro_batch=2, monitors={'V': net.lif.V}, progress_bar=False)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    trainer.fit(_labelled((10,)), num_epoch=1)
  messages = _coupled(record)
  assert len(messages) == int(coupled), messages
  if coupled:
    assert 'random outputs (each micro-batch at a level of its own)' in messages[0]
  assert not [w for w in record if 'Could not check' in str(w.message)]


def _like(batch, time, n_out=2, n_hidden=8):
  """Outputs as a spiking model with monitors gives them: a read-out, a voltage and spikes, batch first."""
  return (jax.ShapeDtypeStruct((batch, time, n_out), jnp.float32),
          {'V': jax.ShapeDtypeStruct((batch, time, n_hidden), jnp.float32),
           'spike': jax.ShapeDtypeStruct((batch, time, n_hidden), jnp.bool_)})


def _conclude(loss, reduction='mean', weigh=None, num_micro_batch=3, shape=(10, 20, 2, 8)):
  """The check's evidence on a loss of such outputs (``shape``: batch, time, read-out, neurons; no model), and its
  warnings."""
  batch, time = shape[:2]
  rng = np.random.RandomState(0)
  x, labels = rng.rand(batch, time, 3).astype('float32'), rng.randint(0, shape[2], batch).astype('int32')
  plan = plan_micro_batches(batch, num_micro_batch=num_micro_batch)
  weigh = weigh or (lambda args, n: jnp.asarray(1. if reduction == 'sum' else n, jnp.float32))
  names = CheckNames()
  evidence = jax.jit(lambda x, y: loss_at_random_outputs(lambda o, t: (loss(o, t), {}), weigh, (x, y), [0, 0],
                                                         _like(*shape), [0, 0, 0], plan, reduction, names,
                                                         has_metrics=False))(x, labels)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    conclude(evidence, names, plan, reduction)
  return evidence, [str(w.message) for w in record]


@pytest.mark.parametrize('coefficient', [pytest.param(1e-1, marks=pytest.mark.long), 1e-4, 1e-9])
def test_batch_wide_mean_of_a_monitor_warns_whatever_its_coefficient(coefficient):
  """The gradient with respect to the voltage is all regulariser: on the whole batch it follows the batch's mean,
  on a micro-batch that micro-batch's, which differ by a share of the gap between levels, whatever the
  coefficient (down to 1e-9 of a loss near 0.7, far below float32 round-off of the loss's value). Below 1e-1
  the two i.i.d. points alone do not show the coupling: their values agree within the tolerance."""
  evidence, messages = _conclude(voltage_regularised(coefficient))
  assert len(messages) == 1 and 'couples the samples' in messages[0], messages
  whole, combined = np.asarray(evidence.whole, np.float64), np.asarray(evidence.combined, np.float64)
  if coefficient < 1e-1:
    assert np.all(np.abs(whole - combined)[:2] < 1e-5 * np.abs(whole[:2])), (whole, combined)
    assert 'random outputs (each micro-batch at a level of its own)' in messages[0]
  if coefficient < 1e-4:
    assert "its gradient with respect to predicts[1]['V']" in messages[0]
  gaps = np.asarray(evidence.gaps)
  assert gaps.shape == (2, 2) and gaps[1, 0] > 0.1 * gaps[1, 1]  # the read-out's, then the voltage's


def _per_sample_losses():
  ce = lambda logits, labels: bp.losses.cross_entropy_loss(logits, labels)
  spikes = lambda mons: mons['spike'].astype(jnp.float32)
  return {
    'ce_last_step': lambda p, y: ce(p[0][:, -1], y),
    'ce_mean_over_time': lambda p, y: ce(bm.mean(p[0], axis=1), y),
    'ce_max_over_time': lambda p, y: ce(bm.max(p[0] + spikes(p[1])[..., :p[0].shape[-1]], axis=1), y),  # ties
    'logsumexp_over_time': lambda p, y: bm.mean(jax.nn.logsumexp(10. * p[0], axis=(1, 2))),
    'per_sample_voltage': lambda p, y: per_sample_voltage_regularised(p, y),
    'per_sample_spike_count': lambda p, y: ce(p[0][:, -1], y) + 1e-3 * bm.mean(bm.sum(spikes(p[1]), axis=(1, 2)) ** 2),
    'log_of_voltage': lambda p, y: -bm.mean(bm.log(p[1]['V'])),  # not finite at 0-or-1: that point is left out
  }


@pytest.mark.parametrize('name', list(_per_sample_losses()))
def test_per_sample_losses_are_silent_at_every_point(name):
  """Per-sample losses of many kinds, at outputs whose micro-batches lie at levels of their own too: values and
  gradients agree to float32 round-off (the gradients within 1e-6 of their largest entry), nothing warns."""
  evidence, messages = _conclude(_per_sample_losses()[name])
  assert not messages, messages
  gaps = np.asarray(evidence.gaps)
  assert np.all(gaps[:, 0] <= 1e-6 * gaps[:, 1] + 1e-30), gaps


@pytest.mark.long
@pytest.mark.parametrize('num_micro_batch', [2, pytest.param(7, marks=pytest.mark.extended)])
def test_per_sample_losses_are_silent_on_large_batches(num_micro_batch):
  """The same on batches of 256 samples, 100 steps, 64 classes and neurons, cut in 2 or 7 (uneven): round-off
  stays far below the tolerances (gradients within 1e-6 of their largest entry, against GRAD_RTOL = 1e-4)."""
  for name, loss in _per_sample_losses().items():
    evidence, messages = _conclude(loss, num_micro_batch=num_micro_batch, shape=(256, 100, 64, 64))
    assert not messages, (name, messages)
    gaps = np.asarray(evidence.gaps)
    assert np.all(gaps[:, 0] <= 1e-6 * gaps[:, 1] + 1e-30), (name, gaps)


def test_masked_and_summed_losses_are_silent_at_every_point():
  """A masked mean whose loss_weight_fn counts its valid entries, and a sum with grad_reduction='sum'."""
  mask = lambda n: (np.arange(20) < 7)[None, :, None] * np.ones((n, 1, 2))
  masked = lambda p, y: bm.sum((p[0] - 0.5) ** 2 * mask(p[0].shape[0])) / np.sum(mask(p[0].shape[0]))
  _, messages = _conclude(masked, weigh=lambda args, n: jnp.asarray(n * 7 * 2, jnp.float32))
  assert not messages, messages
  _, messages = _conclude(lambda p, y: bm.sum(bm.mean(p[1]['V'] ** 2, axis=(1, 2))), reduction='sum')
  assert not messages, messages


def _rmse(predicts, targets):
  """Not a mean of per-sample values: cut in two it differs from the whole batch's."""
  return bm.sqrt(bm.mean((predicts - targets) ** 2))


def test_a_batch_in_one_piece_from_the_plan_cache_is_not_checked(tmp_path):
  """A batch whose plan (from the plan cache) runs in one micro-batch trains the whole batch's loss: the check,
  made before planning and not started (the cached plan has no search to run beside), is dropped, as when the plan
  is searched, and nothing is warned (found in review: the second fit warned)."""
  batches = make_batches((16,), seed=3)
  for _ in range(2):
    trainer = AccumBPTT(make_model('rnn'), _rmse, progress_bar=False, num_micro_batch='auto', memory_budget='1GiB',
                        cache=tmp_path)
    with warnings.catch_warnings():
      warnings.simplefilter('error')
      trainer.fit(batches, num_epoch=1)
    assert trainer.plan_for(16).num_micro_batches == 1


def wide_batch_normalised(predicts, targets):
  """:func:`batch_normalised` of a wide read-out: its random outputs, three points of them and their gradients,
  make the check's program several times the whole batch's outputs."""
  return batch_normalised(predicts, targets)


@SIMULATED_DEVICE
@pytest.mark.parametrize('streamed', [False, pytest.param(True, marks=pytest.mark.long)])
def test_a_check_the_device_cannot_hold_runs_on_the_first_samples_it_can(monkeypatch, streamed):
  """On the chip the check of a large batch's outputs (e-prop's spikes at 4,096 neurons: 69 GiB) was refused and
  fit warned with XLA's RESOURCE_EXHAUSTED. Now the check of the batch's first samples, as many as the device
  holds, runs instead, and still sees the coupling; the train step, which fits, is unchanged. ``streamed``: the
  chip's way with a host batch planned by 'auto' (pieces sent ahead): the check finishes while the model holds a
  piece's state, and reads the batch's state it started from."""
  batch, steps, features, width = 64, 3, 4, 700
  rng = np.random.default_rng(0)
  data = [(rng.standard_normal((batch, steps, features)).astype(np.float32),
           rng.standard_normal((batch, steps, width)).astype(np.float32))]
  with bm.training_environment():
    model = bp.Sequential(bp.dyn.RNNCell(features, 8), bp.dnn.Dense(8, width))
  outputs = batch * steps * width * 4
  with simulated_device(monkeypatch, 3 * outputs) as refused, overlapping(streamed), \
       warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    trainer = AccumBPTT(model, wide_batch_normalised, num_micro_batch='auto' if streamed else 8, cache=False,
                        progress_bar=False)
    trainer.fit(data, num_epoch=1)
  assert bool(trainer.stream_chunks) == streamed
  assert refused and max(refused) > 3 * outputs  # the whole batch's check was refused
  (message,) = _coupled(record)
  assert "on the batch's first " in message and f' of its {batch} samples' in message, message  # (not 'whole')
  assert not [w for w in record if 'Could not check' in str(w.message) or 'RESOURCE' in str(w.message)], \
    [str(w.message) for w in record]


def test_a_check_that_no_sample_count_fits_says_so_without_xla_words():
  error = ValueError('RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. the total memory required for HLO '
                     'temporaries (68.85G) exceeds available HBM (15.75G).')
  with pytest.warns(UserWarning, match='Could not check') as record:
    _could_not_check(error, 512)
  (message,) = [str(w.message) for w in record]
  assert '512 samples' in message and '68.8 GiB' in message and 'RESOURCE' not in message
  assert 'whole_batch_loss=True' in message


@pytest.mark.parametrize('before', [False, True])
def test_a_fixed_plans_check_starts_before_its_first_step_off_the_cpu(monkeypatch, before):
  """Off the CPU (forced here) a fixed plan's check starts before its first step, so that it compiles on its own
  thread while the step compiles on fit's (no planner compiled it), and still warns once, after that step; on a
  CPU it starts after the step is dispatched."""
  from brainpy_accum.trainer import _coupled_loss, _fit_check, _fit_loop
  events, run, call = [], _coupled_loss.RunningCheck.__init__, _fit_loop._call_step
  monkeypatch.setattr(_coupled_loss.RunningCheck, '__init__',
                      lambda self, *args, **kwargs: events.append('check') or run(self, *args, **kwargs))
  monkeypatch.setattr(_fit_loop, '_call_step', lambda *args: events.append('step') or call(*args))
  with _fit_check.before_first_step(before), pytest.warns(UserWarning, match='couples the samples') as record:
    _fit(batch_normalised, model='rnn')
  assert len(_coupled(record)) == 1
  assert events[:2] == (['check', 'step'] if before else ['step', 'check']), events


def test_a_fixed_plans_first_step_compiles_while_its_check_is_traced(monkeypatch):
  """Where the check starts before the first step (off the CPU; forced here), that step is traced first and
  compiled on a thread of its own while the check is traced; the step's call then compiles nothing, the
  compilations counted and the training are those of the step compiled at its call, and the coupling still warns
  once (a loss without metrics: the check cannot change the step)."""
  from brainpy_accum.trainer import _fit_check, _fit_loop
  calls, call, results = [], _fit_loop._call_step, {}

  def counted(*args):
    result = call(*args)
    calls.append(result[1])  # the XLA compilations of the step's call
    return result

  monkeypatch.setattr(_fit_loop, '_call_step', counted)
  for before in (False, True):
    calls.clear()
    with _fit_check.before_first_step(before), pytest.warns(UserWarning, match='couples the samples') as record:
      trainer = _fit(batch_normalised, model='rnn')
    assert len(_coupled(record)) == 1
    results[before] = (params_of(trainer.target), trainer.train_losses, dict(trainer.compilations), calls[0])
  assert results[True][3] == 0 and results[False][3] == 1  # the step compiled ahead, not at its call
  assert results[True][2] == results[False][2]
  assert_trees_close(results[True][:2], results[False][:2], rtol=0, atol=0)


@pytest.mark.parametrize('before', [False, True])
def test_a_loss_that_fails_raises_its_own_error_alone(before):
  """An error in ``loss_fun`` is the step's to raise, as bp.BPTT's step would: the check, which traced the same
  loss first (before the step, off the CPU), says nothing of it."""
  from brainpy_accum.trainer import _fit_check

  def broken(predicts, targets):
    raise ValueError('a mistake in loss_fun')

  with _fit_check.before_first_step(before), warnings.catch_warnings(record=True) as record, \
       pytest.raises(ValueError, match='a mistake in loss_fun'):
    warnings.simplefilter('always')
    _fit(broken, model='rnn')
  assert not [w for w in record if 'Could not check' in str(w.message)]
