"""Running out of device memory, in every form JAX raises it, is the planner's measurement or fit's finer retry,
never an error for the user; and arrays put on the device after planning make fit plan again.

The forms were measured on a TPU v5e with JAX 0.10.2 (docs/accelerator.md): a program too large refused at compile
time (``JaxRuntimeError``), a program whose temporaries cannot be reserved when it is loaded (``ValueError``,
E0101 ``RuntimeProgramAllocationFailure``), a buffer that cannot be allocated (``JaxRuntimeError``, E0100
``RuntimeBufferAllocationFailure``); a GPU's allocator writes "Out of memory while trying to allocate".
"""

import jax
import numpy as np
import pytest

from brainpy_accum.memory._device import is_out_of_memory, is_refused_program
from brainpy_accum.trainer import _fit_loop
from helpers import SIMULATED_DEVICE, assert_trees_close, params_of
from simulated_device import simulated_device
from test_device import SIZE, _batches, _bptt, _trainer, sizes  # noqa: F401 -- sizes: a fixture

COMPILE = ('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (17.38G) '
           'exceeds available HBM (15.75G).')
LOAD = ("RESOURCE_EXHAUSTED: E0101: RuntimeProgramAllocationFailure: Error loading program 'jit_jaxpr_call': "
        'Attempting to reserve 8.54G at the bottom of memory. That was not possible. There are 5.42G free, 0B '
        "reserved, and 5.42G reservable. See https://openxla.org/xla/errors/error_0101 for more details. "
        "[type.googleapis.com/pjrt.OOM='']")
BUFFER = ('RESOURCE_EXHAUSTED: E0100: RuntimeBufferAllocationFailure: Error allocating device buffer: Attempting '
          'to allocate 6.00G. That was not possible. There are 5.43G free.; (0x0x0_HBM0)')
GPU = 'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 18663604224 bytes.'


@pytest.mark.parametrize('error', [jax.errors.JaxRuntimeError(COMPILE), ValueError(LOAD),
                                   jax.errors.JaxRuntimeError(BUFFER), RuntimeError(GPU),
                                   ValueError(LOAD.replace('RESOURCE_EXHAUSTED: ', ''))],
                         ids=['compile', 'load', 'buffer', 'gpu', 'load_without_status'])
def test_every_form_of_running_out_of_device_memory_is_recognised(error):
  assert is_out_of_memory(error)
  assert is_refused_program(error) == ('HLO temporaries' in str(error))  # only a compile-time refusal ran nothing


@pytest.mark.parametrize('error', [ValueError('shapes (3,) and (4,) do not match'), MemoryError('host'),
                                   TypeError('RESOURCE_EXHAUSTED is a word in this message'[:10])])
def test_other_errors_are_not_out_of_memory(error):
  assert not is_out_of_memory(error)


@pytest.mark.parametrize('form', [LOAD, pytest.param(BUFFER, marks=pytest.mark.long)], ids=['load', 'buffer'])
def test_a_step_that_runs_out_of_memory_in_any_form_is_retried_finer_and_trains_as_bptt(monkeypatch, capsys, form):
  """The first call of the step raises the form (as a TPU does when the program cannot be loaded beside the
  arrays of now): fit cuts the batch finer, runs it again (the failed attempt changed nothing) and ends where
  bp.BPTT does."""
  batches = _batches()
  raised, real = [], _fit_loop._call_step

  def failing_once(step, shared_args, inputs, targets):
    if not raised:
      raised.append(form)
      raise (ValueError if 'E0101' in form else jax.errors.JaxRuntimeError)(form)
    return real(step, shared_args, inputs, targets)

  monkeypatch.setattr(_fit_loop, '_call_step', failing_once)
  trainer = _trainer(num_micro_batch=2)
  trainer.fit(batches, num_epoch=2)
  assert raised and trainer.num_micro_batch_for(SIZE) == 4
  assert 'out of device memory' in capsys.readouterr().out
  reference = _bptt(batches)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  np.testing.assert_allclose(trainer.train_losses, reference.train_losses, rtol=1e-5)


@SIMULATED_DEVICE
def test_arrays_put_on_the_device_after_planning_make_fit_plan_again(monkeypatch, sizes, capsys):  # noqa: F811
  """Planned on a device free enough for the whole batch; then other arrays hold part of it (as a user's own
  would): the next fit works out the device's room again, the plan that no longer fits is made again, finer,
  and training ends where bp.BPTT's does. Without it the TPU would evict and reload the step's reserved
  temporaries beside the new arrays (88.9 s for one batch) or fail to load it."""
  batches = _batches()
  with simulated_device(monkeypatch, 2 * sizes['whole'], in_use=1000):
    trainer = _trainer(num_micro_batch='auto', cache=False)
    trainer.fit(batches, num_epoch=1)
  assert trainer.plan_for(SIZE).num_micro_batches == 1
  held = 2 * sizes['whole'] - (sizes['half'] + sizes['whole']) // 2  # room for the halves' step, not the whole's
  with simulated_device(monkeypatch, 2 * sizes['whole'], in_use=held + 1000):
    trainer.fit(batches, num_epoch=1)
  assert trainer.plan_for(SIZE).num_micro_batches > 1
  assert 'planning them again' in capsys.readouterr().out
  reference = _bptt(batches)  # two epochs in one call: the same updates as one epoch in each of two
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  np.testing.assert_allclose(trainer.train_losses[-1], reference.train_losses[-1], rtol=1e-5)
