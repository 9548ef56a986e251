"""Out of device memory at run time: ``fit`` re-plans the batch size with twice the micro-batches and retries.

The compiled step is replaced by a test double that raises XLA's real resource-exhausted error class
(``jax.errors.JaxRuntimeError``) before running, as a jitted step that fails on the device does: nothing
is written back. The run must then equal an uninterrupted ``bp.BPTT`` run.
"""

import brainpy as bp
import jax
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, optimizer_state, params_of

OOM = 'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.'


def _flaky(trainer, fail_on_calls, error=None):
  """Make the train step raise ``error`` (XLA's OOM by default) on the given call numbers, before running."""
  calls = []
  real = trainer._steps.step

  def step(kind):
    def run(*args):
      if kind == 'fit':
        calls.append(1)
        if len(calls) in fail_on_calls:
          raise error or jax.errors.JaxRuntimeError(OOM)
      return real(kind)(*args)
    return run

  trainer._steps.step = step
  return calls


def _trainer(**kwargs):
  return AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False,
                   **kwargs)


@pytest.mark.long  # README suite time (test_out_of_memory.py retries the load form in the README suite)
def test_out_of_memory_retries_the_batch_finer_and_trains_as_bptt(capsys):
  batches = make_batches((10, 10, 7))
  expected = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False)
  expected.fit(batches, num_epoch=2)
  trainer = _trainer(num_micro_batch=2)
  _flaky(trainer, fail_on_calls={2})
  trainer.fit(batches, num_epoch=2)
  assert trainer.plan_for(10).num_micro_batches == 4  # 2 x 5 -> 4 micro-batches (3 + 3 + 3 + 1)
  assert trainer.plan_for(7).num_micro_batches == 2  # other batch sizes keep their plan
  assert_trees_close(params_of(trainer.target), params_of(expected.target))
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5, atol=1e-6)
  assert capsys.readouterr().out.count('out of device memory') == 1


def test_out_of_memory_with_one_sample_per_micro_batch_gives_up_clearly_and_changes_nothing():
  trainer = _trainer(micro_batch_size=1)
  before = params_of(trainer.target), optimizer_state(trainer)
  _flaky(trainer, fail_on_calls={1, 2, 3})
  with pytest.raises(MemoryError, match='one sample per micro-batch'):
    trainer.fit(make_batches((3,)), num_epoch=1)
  assert_trees_close(params_of(trainer.target), before[0], rtol=0, atol=0)
  assert_trees_close(optimizer_state(trainer), before[1], rtol=0, atol=0)


def test_other_runtime_errors_are_not_retried():
  trainer = _trainer(num_micro_batch=2)
  calls = _flaky(trainer, fail_on_calls={1}, error=jax.errors.JaxRuntimeError('INTERNAL: something else'))
  with pytest.raises(jax.errors.JaxRuntimeError, match='something else'):
    trainer.fit(make_batches((4,)), num_epoch=1)
  assert len(calls) == 1
