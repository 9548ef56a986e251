"""No compiled step calls back to the host: the written-state evidence leaves every step as an ordinary output.

On an accelerator with ``JAX_PLATFORMS=tpu`` (or ``cuda``) JAX has no CPU backend, and a host callback inside a
step fails there (``jax.debug.callback failed to find a local CPU device``); elsewhere it is a device-to-host
trip in every step. Here, on any platform, every primitive bound while ``fit`` traces its steps (the train step,
the evaluation step, the first-batch check) is watched, for models whose forward pass writes Variables without a
batch axis, in each way a step is built; the data-dependent writes are still warned of, by name, from the flags
the host reads with the losses.
"""

import warnings

import brainpy as bp
import jax
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.sharding import Mesh

from brainpy_accum import AccumBPTT
from helpers import TINY_SIZES, streaming_budget
from test_written_state import OPTIMIZERS, build, data, halves, written_warnings

CALLBACKS = ('debug_callback', 'pure_callback', 'io_callback')


@pytest.fixture
def bound_callbacks(monkeypatch):
  """The names of the callback primitives bound from now on, by any trace on any thread."""
  bound, real = [], Primitive.bind

  def bind(self, *args, **params):
    if self.name in CALLBACKS:
      bound.append(self.name)
    return real(self, *args, **params)

  monkeypatch.setattr(Primitive, 'bind', bind)
  return bound


def _checked_loss(predicts, targets):
  """bp.BPTT's loss behind a lambda: the first-batch check traces and runs it (bp.losses' own are skipped)."""
  return bp.losses.mean_squared_error(predicts, targets)


def _one_device_mesh():
  return Mesh(np.array(jax.devices()[:1]), ('batch',))


WAYS = {
  'micro-batches and an evaluation pass': dict(num_micro_batch=2, test=True),
  'accumulate_steps': dict(num_micro_batch=2, accumulate_steps=2, batches=halves),
  'whole_batch_loss': dict(num_micro_batch=2, whole_batch_loss=True),
  'one-device mesh': dict(num_micro_batch=2, mesh=_one_device_mesh),
}


def _fit(kind, way: dict, **more):
  """``kind``'s model trained one epoch in ``way``; the warnings' texts."""
  options = {**way, **more}
  batches = options.pop('batches', lambda: [data()])()
  test = options.pop('test', False)
  if 'mesh' in options:
    options['mesh'] = options['mesh']()
  trainer = AccumBPTT(build(kind), _checked_loss, optimizer=OPTIMIZERS['sgd'](), progress_bar=False, **options)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    trainer.fit(batches, test_data=[data(seed=2)] if test else None, num_epoch=1)
  return written_warnings([str(c.message) for c in caught])


@pytest.mark.parametrize('way', [  # two ways in the long suite: README suite time
  pytest.param(way, marks=pytest.mark.long) if way in ('accumulate_steps', 'one-device mesh') else way for way in WAYS])
def test_no_step_of_a_model_that_writes_states_binds_a_host_callback(way, bound_callbacks):
  """A Hebbian term written into ``W`` (data-dependent: warned of, naming it) and a record of sample 0: no
  callback primitive bound while the steps and the check were traced."""
  found = _fit('hebb', WAYS[way])
  assert not bound_callbacks, bound_callbacks
  assert len(found) == 1 and '.W is written' in found[0], found
  found = _fit('record', WAYS[way])
  assert not bound_callbacks, bound_callbacks
  assert len(found) == 1 and '.record has no batch axis' in found[0], found


@TINY_SIZES
def test_no_streamed_step_binds_a_host_callback(bound_callbacks):
  """A batch streamed in chunks of 2 samples through the window: its pieces' steps bind no callback either, and
  the Hebbian write is warned of."""
  probe = AccumBPTT(build('hebb'), bp.losses.mean_squared_error, num_micro_batch='auto', memory_budget='1GiB',
                    optimizer=OPTIMIZERS['sgd']())
  found = _fit('hebb', {}, num_micro_batch='auto', memory_budget=streaming_budget([probe], [data()], chunk=2))
  assert not bound_callbacks, bound_callbacks
  assert [f for f in found if '.W is written' in f], found


def test_the_flags_are_read_with_the_losses_not_after_every_step(monkeypatch):
  """The host reads the flags where the fit loop reports (every 2 batches here, and at the end of fit), never
  after each step: 4 batches, 2 reports, 1 end."""
  from brainpy_accum.trainer import _compiled_steps
  reads = []
  real = _compiled_steps.CompiledSteps.report_writes
  monkeypatch.setattr(_compiled_steps.CompiledSteps, 'report_writes', lambda self: (reads.append(1), real(self)))
  trainer = AccumBPTT(build('record'), bp.losses.mean_squared_error, num_micro_batch=2, progress_bar=False)
  trainer.fit([data(seed=s) for s in range(4)], num_epoch=1, num_report=2)
  assert len(reads) == 3, reads


@pytest.mark.parametrize('callbacks_run', [
    pytest.param(True, marks=pytest.mark.host_callback('runs bp.BPTT\'s progress-bar callback: a failed callback '
                                                       'poisons the runtime for every later test')),
    False], ids=['cpu backend', 'JAX_PLATFORMS=tpu'])
def test_predict_drops_its_progress_bar_where_no_host_callback_can_run(monkeypatch, bound_callbacks, callbacks_run):
  """bp.BPTT's ``predict`` updates its per-time-step progress bar by a host callback inside the compiled run,
  which fails where JAX has no CPU backend (the demo under JAX_PLATFORMS=tpu did, on the TPU v5e): there
  ``predict`` runs without the bar, and gives what it gives with it."""
  from brainpy_accum.core import _written
  monkeypatch.setattr(_written, 'host_callbacks_run', lambda: callbacks_run)
  trainer = AccumBPTT(build('clip'), bp.losses.mean_squared_error, num_micro_batch=2)  # progress_bar on
  x, _ = data()
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # (tqdm's own)
    predicted = trainer.predict(x, reset_state=True)
  assert bool(bound_callbacks) is callbacks_run, bound_callbacks
  assert trainer.progress_bar
  quiet = AccumBPTT(build('clip'), bp.losses.mean_squared_error, num_micro_batch=2, progress_bar=False)
  np.testing.assert_array_equal(np.asarray(predicted), np.asarray(quiet.predict(x, reset_state=True)))
