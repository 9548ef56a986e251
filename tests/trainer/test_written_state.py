"""Models that write their own weights or records inside ``update``: AccumBPTT against bp.BPTT on the whole batch.

A write that does not depend on the data (sign clipping, a Dale's-law sign, a mask, a rescaling, a counter of
time steps) is exact: every micro-batch's forward pass starts from the step's own values, and after the step
each Variable holds what bp.BPTT leaves (the write, then the optimizer's update). A write that depends on the
data (a Hebbian term) and a record without a batch axis get a warning naming the Variable. Tolerance: the
suite's float32 one (rtol 1e-5, atol 1e-6, ``helpers.RTOL``), parameters after the updates.
"""

import functools
import warnings

import brainpy as bp
import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from brainpy_accum import AccumBPTT, micro_batched_grad
from brainpy_accum.trainer._feed import overlapping
from helpers import TINY_SIZES, assert_trees_close, step_bytes, streaming_budget
from written_models import EINetwork, WrittenLayer, dale

WRITES = ('is written in the forward pass', 'the forward pass writes it')  # the two warnings' words


def data(batch=8, num_time=5, n_in=2, n_out=3, seed=1):
  """The issue's data (seed 1): x of shape (8, 5, 2), y of shape (8, 5, 3)."""
  rng = np.random.RandomState(seed)
  return rng.randn(batch, num_time, n_in).astype('float32'), rng.randn(batch, num_time, n_out).astype('float32')


OPTIMIZERS = {'sgd': lambda: bp.optim.SGD(lr=1.), 'adam': lambda: bp.optim.Adam(lr=0.1)}


def build(kind):
  bm.random.seed(0)
  with bm.training_environment():
    return EINetwork() if kind == 'ei' else WrittenLayer(kind)


def fit(trainer_cls, kind, optimizer='sgd', batches=None, num_epoch=1, test=False, trainers=None, **options):
  """Train a fresh model; its Variables (parameters, records, counters) after ``fit`` and the warnings given
  (the trainer is appended to the list ``trainers``, if given)."""
  model = build(kind)
  trainer = trainer_cls(model, bp.losses.mean_squared_error, optimizer=OPTIMIZERS[optimizer](), progress_bar=False,
                        **options)
  batches = batches or [data()]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    trainer.fit(batches, test_data=[data(seed=2)] if test else None, num_epoch=num_epoch)
    jax.effects_barrier()
  if trainers is not None:
    trainers.append(trainer)
  return [np.asarray(v.value) for v in model.vars().unique().values()], [str(c.message) for c in caught]


@functools.lru_cache(maxsize=None)
def reference(kind, optimizer='sgd', num_epoch=1, test=False):
  return fit(bp.BPTT, kind, optimizer, num_epoch=num_epoch, test=test)[0]


def written_warnings(caught):
  return [c for c in caught if any(w in c for w in WRITES)]


def halves():
  x, y = data()
  return [(x[:4], y[:4]), (x[4:], y[4:])]


def auto_budget(kind, optimizer='sgd'):
  """A budget between the steps of micro-batches of 1 and of 2 samples (XLA's bytes on this device) for the batch
  of 8, with the ``optimizer`` that :func:`fit` trains with: the whole batch's step does not fit."""
  probe = AccumBPTT(build(kind), bp.losses.mean_squared_error, num_micro_batch='auto', memory_budget='1GiB',
                    optimizer=OPTIMIZERS[optimizer]())
  x, y = data()
  return (step_bytes(probe, x, y, 8, 1, False) + step_bytes(probe, x, y, 8, 2, False)) // 2


@pytest.mark.parametrize('num_micro_batch', [2, 3, pytest.param('auto', marks=TINY_SIZES)])
def test_minimal_reproduction_matches_bptt(num_micro_batch):
  """The issue's layer: ``W`` clipped to its non-negative entries in ``update``, one SGD step (lr 1). bp.BPTT
  keeps the clipped entries at exactly 0 (every sample is differentiated through ``where(W0 < 0, 0, W0)``)."""
  budget = dict(memory_budget=auto_budget('clip')) if num_micro_batch == 'auto' else {}
  trainers = []
  params, caught = fit(AccumBPTT, 'clip', num_micro_batch=num_micro_batch, trainers=trainers, **budget)
  assert trainers[0].num_micro_batch_for(8) > 1
  expected = reference('clip')
  assert_trees_close(params, expected)
  np.testing.assert_allclose(expected[0], [[0.2997, 0, 0.0792], [0, 0.0501, 0]], atol=1e-4)  # the figures
  assert np.count_nonzero(params[0] == 0.) == 3
  assert not written_warnings(caught), caught


@pytest.mark.parametrize('kind, optimizer', [
  ('clip', 'adam'), ('dale', 'sgd'), ('mask', 'adam'), ('rescale', 'sgd'),
  *[pytest.param(k, o, marks=pytest.mark.long) for k, o in [('clip', 'sgd'), ('dale', 'adam'), ('mask', 'sgd'),
                                                            ('rescale', 'adam')]]])
def test_weights_written_in_update_match_bptt(kind, optimizer):
  """Sign clipping, a Dale's-law sign, a mask and a rescaled projection, batch 8 in 3 + 3 + 2, two updates:
  parameters and the time-step counter as bp.BPTT leaves them, and no warning."""
  params, caught = fit(AccumBPTT, kind, optimizer, num_epoch=2, num_micro_batch=3)
  assert_trees_close(params, reference(kind, optimizer, num_epoch=2))
  assert not written_warnings(caught), caught


MODES = {
  'accumulate_steps': dict(num_micro_batch=2, accumulate_steps=2, batches=halves),
  'accumulate_steps, one micro-batch': dict(num_micro_batch=1, accumulate_steps=2, batches=halves),
  'whole_batch_loss': dict(num_micro_batch=3, whole_batch_loss=True),
  'jit=False': dict(num_micro_batch=3, jit=False),
  'evaluation': dict(num_micro_batch=3, test=True),
}


@pytest.mark.parametrize('mode', list(MODES))
def test_written_weights_match_bptt_in_every_mode(mode):
  """Every batch of an ``accumulate_steps`` window starts from the window's values (two batches of 4 against
  bp.BPTT's one of 8), the two passes of ``whole_batch_loss`` start from the step's values, without jit, and an
  evaluation pass writes as bp.BPTT's does."""
  options = dict(MODES[mode])
  batches = options.pop('batches', None)
  test = options.pop('test', False)
  params, caught = fit(AccumBPTT, 'dale', 'adam', batches=batches and batches(), test=test, **options)
  assert_trees_close(params, reference('dale', 'adam', test=test))
  assert not written_warnings(caught), caught


@TINY_SIZES
@pytest.mark.parametrize('kind', ['clip', pytest.param('hebb', marks=pytest.mark.long)])
def test_streamed_batch_starts_every_chunk_from_the_batch_values(kind):
  """A batch streamed in chunks of 2 samples, one update per batch: exact for a clip, warned for a Hebbian term."""
  probe = AccumBPTT(build(kind), bp.losses.mean_squared_error, num_micro_batch='auto', memory_budget='1GiB')
  budget = streaming_budget([probe], [data()], chunk=2)
  params, caught = fit(AccumBPTT, kind, num_micro_batch='auto', memory_budget=budget)
  if kind == 'clip':
    assert_trees_close(params, reference(kind))
    assert not written_warnings(caught), caught
  else:
    assert [c for c in written_warnings(caught) if 'trainable WrittenLayer' in c], caught


@pytest.mark.parametrize('options', [
  pytest.param(dict(num_micro_batch=2), id='micro-batches'),
  pytest.param(dict(num_micro_batch=1, accumulate_steps=2), id='accumulate_steps'),
  pytest.param(dict(num_micro_batch=2, jit=False), id='jit=False', marks=pytest.mark.long),
  pytest.param(dict(num_micro_batch=4, whole_batch_loss=True), id='whole_batch_loss', marks=pytest.mark.long)])
def test_data_dependent_write_to_a_parameter_warns_naming_it(options):
  """A Hebbian term written into ``W``: the micro-batches (or the batches of a window) write different values,
  and a warning names ``W`` and the fix, once."""
  batches = halves() if 'accumulate_steps' in options else None
  params, caught = fit(AccumBPTT, 'hebb', batches=batches, **options)
  found = written_warnings(caught)
  assert len(found) == 1, caught
  assert 'trainable WrittenLayer' in found[0] and '.W is written' in found[0], found
  assert 'num_micro_batch=1' in found[0] and 'move the write out of the forward pass' in found[0]
  assert not np.allclose(params[0], reference('hebb')[0], rtol=1e-5)  # what the warning says: not bp.BPTT's


@pytest.mark.parametrize('options', [dict(num_micro_batch=2), dict(num_micro_batch=1, accumulate_steps=2)],
                         ids=['micro-batches', 'accumulate_steps'])
def test_record_without_batch_axis_warns_naming_it(options):
  """A record of sample 0's output in a Variable without a batch axis, as for a plot: bp.BPTT's holds sample 0's,
  AccumBPTT's the last micro-batch's first sample's. Warned, naming it and what it holds; the parameters and the
  time-step counter are bp.BPTT's."""
  batches = halves() if 'accumulate_steps' in options else None
  params, caught = fit(AccumBPTT, 'record', batches=batches, **options)
  found = written_warnings(caught)
  assert len(found) == 1 and '.record has no batch axis' in found[0], caught
  assert 'batch_axis=0' in found[0] and 'holds what the last micro-batch' in found[0]
  expected = reference('record')
  record = next(i for i, v in enumerate(build('record').vars().unique().values()) if v.ndim == 1)
  assert not np.allclose(params[record], expected[record])  # what the warning says: not bp.BPTT's
  assert_trees_close(params[:record] + params[record + 1:], expected[:record] + expected[record + 1:])


@pytest.mark.long  # the long suite (--long): README suite time (the weights written in update stay)
@pytest.mark.parametrize('num_micro_batch', [2, pytest.param(3, marks=pytest.mark.long),
                                             pytest.param('auto', marks=[pytest.mark.long, TINY_SIZES])])
def test_ei_lif_network_with_masked_weights_matches_bptt(num_micro_batch):
  """Five layers of an E/I LIF network whose ``update`` masks the weights by Dale's law at every step, one Adam
  step: every parameter as bp.BPTT leaves it (the masked ones stay exactly 0)."""
  budget = dict(memory_budget=auto_budget('ei', 'adam')) if num_micro_batch == 'auto' else {}
  trainers = []
  params, caught = fit(AccumBPTT, 'ei', 'adam', num_micro_batch=num_micro_batch, trainers=trainers, **budget)
  assert trainers[0].num_micro_batch_for(8) > 1
  assert_trees_close(params, reference('ei', 'adam'))
  model = build('ei')
  start = [np.asarray(v.value) for v in model.vars().unique().values()]
  for before, after, var in zip(start, params, model.vars().unique().values()):
    if isinstance(var, bm.TrainVar):  # what Dale's law masked at the start stays exactly 0, as with bp.BPTT
      assert np.all(after[np.asarray(dale(before, len(before))) == 0.] == 0.)
  assert not written_warnings(caught), caught


def test_one_device_mesh_restarts_written_weights():
  """The sharded path: each device's micro-batches start from the step's weights."""
  mesh = Mesh(np.array(jax.devices()[:1]), ('batch',))
  params, caught = fit(AccumBPTT, 'dale', 'adam', num_micro_batch=3, mesh=mesh)
  assert_trees_close(params, reference('dale', 'adam'))
  assert not written_warnings(caught), caught


@pytest.mark.host_callback('the functional core inside a jit sends its flags to the host by a callback')
def test_micro_batched_grad_restarts_written_states():
  """The functional front door: a ParamState clipped in the loss gives brainstate's whole-batch gradient and
  value; a record of the last sample is brainstate's value too (the last micro-batch's), and warned of; a
  data-dependent write to a parameter is warned of by its name in ``grad_states``."""
  w, record = brainstate.ParamState(jnp.asarray([0.5, -0.3, 0.2])), brainstate.ShortTermState(jnp.zeros(()))

  def loss_fn(x, y, hebbian=0.):
    w.value = jnp.where(w.value < 0, 0., w.value) + hebbian * jnp.mean(x, axis=0)
    record.value = x[-1, 0]
    return jnp.mean((x @ w.value - y) ** 2)

  x, y = np.random.RandomState(0).randn(10, 3).astype('float32'), np.ones(10, 'float32')
  start = w.value
  expected = brainstate.transform.grad(loss_fn, {'w': w})(x, y)
  expected_w, expected_record = w.value, record.value
  for hebbian in (0., 0.1):
    w.value = start
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      grad_fn = micro_batched_grad(loss_fn, {'w': w}, num_micro_batch=3, batch_axis=(0, 0, None))
      grads = brainstate.transform.jit(grad_fn)(x, y, hebbian)
      jax.effects_barrier()
    found = written_warnings([str(c.message) for c in caught])
    assert [f for f in found if 'ShortTermState(shape=())' in f], found
    if hebbian:
      assert len(found) == 2 and [f for f in found if "grad_states['w']" in f], found
    else:
      assert len(found) == 1, found
      assert_trees_close((grads, w.value, record.value), (expected, expected_w, expected_record))


@pytest.mark.parametrize('sent_ahead', [False, True], ids=['chunks', 'pieces'])
def test_a_streamed_evaluation_puts_written_states_back_between_its_chunks(sent_ahead):
  """An evaluation batch streamed in chunks has no window to put back what the forward pass wrote: the chunks
  start from the batch's values as the micro-batches of an evaluation step do, so a time-step counter counts one
  batch, not one batch per chunk (found in review: 15 steps against bp.BPTT's 10). ``sent_ahead``: data sent to
  the device ahead, an accelerator's path (forced here on any device), where the batch streams in pieces of one
  micro-batch."""
  probe = AccumBPTT(build('clip'), bp.losses.mean_squared_error, num_micro_batch='auto', memory_budget='1GiB')
  budget = streaming_budget([probe], [data()], chunk=2)
  trainers = []
  with overlapping(sent_ahead):
    params, _ = fit(AccumBPTT, 'clip', test=True, trainers=trainers, num_micro_batch='auto', memory_budget=budget)
  assert trainers[0].stream_chunks[8] < 8 and (8 in trainers[0].planner.piece_sizes) == sent_ahead
  assert_trees_close(params, reference('clip', test=True))
