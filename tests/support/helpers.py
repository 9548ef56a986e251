"""Tiny models, data, one tolerance helper and memory budgets measured on the running device, shared by the tests.

The tolerances, on every platform:

- ``RTOL, ATOL`` (1e-5, 1e-6): float32 round-off of summing micro-batch gradients in another order, after a few
  Adam steps, measured on the CPU. They hold on a GPU or TPU too, because there every test runs with float32
  matmuls (``jax_default_matmul_precision='highest'``, set in ``tests/conftest.py``), where an accelerator
  agrees with a CPU to about seven digits. They are never loosened for a platform.
- Why not at the accelerator's default precision: there a float32 matmul rounds its operands to bfloat16 (a
  TPU; TensorFloat-32 on a GPU), and a micro-batch's gradient is that of its own mean loss, scaled by ``b / B``
  only after its backward matmuls: their operands differ from the whole batch's (a factor ``1 / b`` for
  ``1 / B``) by more than the order of a sum, and the rounding turns that into 2e-3 to 7e-2 in single
  elements. (Measured on the CPU with every float32 ``dot_general`` rounding its operands to bfloat16, a rate
  RNN's gradient for 10 samples: cuts 3+3+3+1 and 4+4+2 give 0.04 and 0.07 in the worst element, 1e-3 in
  relative L2; 5+5, where ``b / B`` is a power of two, and the whole batch with its samples permuted give 4e-7.
  Differentiating each micro-batch's loss already scaled by ``b / B`` gives under 1e-6 for every cut.) So at that
  precision the whole-batch references of the core and equivalence tests are not the micro-batched
  computation, whatever the tolerance; with float32 matmuls they are, to round-off.
"""

import brainpy as bp
import brainpy.math as bm
import jax
import numpy as np
import pytest

from brainpy_accum import plan_micro_batches
from brainpy_accum.memory import _budget
from brainpy_accum.memory._budget import step_memory

# float32 round-off of summing micro-batch gradients in another order, after a few Adam steps (see above).
RTOL, ATOL = 1e-5, 1e-6

# Tests of what only a CPU does or measures (skipped off it, with the reason: tests/conftest.py).
NO_DEVICE_LIMIT = pytest.mark.cpu_only(
  "a CPU reports no memory limit, so 'auto' needs a memory_budget there; on a GPU or TPU it plans against the "
  "device's own memory (tests/memory/test_accelerator.py)")
TINY_SIZES = pytest.mark.cpu_only(
  "XLA's sizes of a tiny network's step: on a TPU v5e its tile padding sets them, not the micro-batch (measured "
  "there: the same 1,504,256 bytes at micro-batches of 16 and 24, a remat step larger than the stored one); "
  "tests/memory/test_accelerator.py tests planning at the device's scale")
SIMULATED_DEVICE = pytest.mark.cpu_only(
  "a device simulated on the CPU's compiler (tests/support/simulated_device.py); on a GPU or TPU "
  "tests/memory/test_accelerator.py tests the real device")
TRACED_BOUND = pytest.mark.cpu_only(
  "the traced lower bound of a step's memory is used on the CPU only: on a TPU v5e XLA measured a small rate "
  "RNN's working memory at 870,912 bytes, below the 3,612,672 its trace counts")


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
  """Compare two pytrees of arrays leaf by leaf."""
  actual_leaves, actual_def = jax.tree_util.tree_flatten(actual)
  expected_leaves, expected_def = jax.tree_util.tree_flatten(expected)
  assert actual_def == expected_def, f'{actual_def} != {expected_def}'
  for a, e in zip(actual_leaves, expected_leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


class RateRNN(bp.DynamicalSystem):
  """A vanilla RNN cell and a linear read-out."""

  def __init__(self, n_in=3, n_hidden=8, n_out=2):
    super().__init__()
    self.rnn = bp.dyn.RNNCell(n_in, n_hidden)
    self.out = bp.dnn.Dense(n_hidden, n_out)

  def update(self, x):
    return self.out(self.rnn(x))


class SpikingNet(bp.DynamicalSystem):
  """Dense -> LIF with refractoriness and a surrogate gradient -> Dense; random initial potentials."""

  def __init__(self, n_in=3, n_hidden=8, n_out=2):
    super().__init__()
    self.inp = bp.dnn.Dense(n_in, n_hidden, W_initializer=bp.init.KaimingNormal(scale=5.))
    self.lif = bp.dyn.LifRef(n_hidden, V_rest=0., V_reset=0., V_th=1., tau=2., tau_ref=1.,
                             spk_fun=bm.surrogate.Arctan(), V_initializer=bp.init.Uniform(0., 0.8))
    self.out = bp.dnn.Dense(n_hidden, n_out)

  def update(self, x):
    return self.out(self.lif(self.inp(x)))


class DictInputRNN(RateRNN):
  """Takes its input as a dict of two arrays."""

  def update(self, x):
    return super().update(x['a'] + 2. * x['b'])


MODELS = {'rnn': RateRNN, 'snn': SpikingNet, 'dict_rnn': DictInputRNN}


_BUILT = {}  # (name, seed, options) -> every Variable's value and the random key right after the first build


def make_model(name, seed=0, **kwargs):
  """The same initial parameters for every call with the same seed.

  The first call builds the model with BrainPy's jitted initialisers. Later calls build the same structure
  without jit (no initialiser compiles again: most of a tiny model's set-up time) and take the first build's
  values, bit for bit, and the random key that followed it, so every call returns the same model.
  """
  key = (name, seed, tuple(sorted(kwargs.items())))
  bm.random.seed(seed)
  with bm.training_environment():
    if key not in _BUILT:
      model = MODELS[name](**kwargs)
      _BUILT[key] = [v.value for v in model.vars().unique().values()], bm.random.DEFAULT.value
      return model
    with jax.disable_jit():
      model = MODELS[name](**kwargs)
  values, random_key = _BUILT[key]
  for variable, value in zip(model.vars().unique().values(), values):
    variable.value = value
  bm.random.DEFAULT.value = random_key
  return model


def make_batches(sizes, num_time=5, n_in=3, n_out=2, seed=0, time_first=False, dict_inputs=False):
  """Batches of (inputs, targets) with the given batch sizes; targets are per-time-step."""
  rng = np.random.RandomState(seed)
  batches = []
  for size in sizes:
    x = (rng.rand(size, num_time, n_in) * 2.).astype('float32')
    y = rng.rand(size, num_time, n_out).astype('float32')
    if time_first:
      x, y = x.transpose(1, 0, 2), y.transpose(1, 0, 2)
    if dict_inputs:
      x = {'a': x, 'b': (x * 0.5)[..., ::-1].copy()}
    batches.append((x, y))
  return batches


def params_of(model):
  """Trainable parameters as a list of NumPy arrays, in a stable order."""
  return [np.asarray(v) for v in model.train_vars().unique().values()]


def mse_with_aux(predicts, targets):
  """Mean-squared error with two auxiliary metrics, both means over samples."""
  loss = bp.losses.mean_squared_error(predicts, targets)
  return loss, {'mean_out': predicts.mean(), 'abs_err': bm.abs(predicts - targets).mean()}


def optimizer_state(trainer):
  """Every Variable of the optimizer (moments, step counters) as NumPy arrays, in a stable order."""
  return [np.asarray(v) for v in trainer.optimizer.vars().unique().values()]


# Memory budgets: from what XLA measures for the program at hand on the running device (a TPU pads arrays to
# (8, 128) tiles, so the same step has other sizes there than on a CPU), never from a byte figure of one machine.

def step_bytes(trainer, x, y, size, micro, via_window, remat=None) -> int:
  """XLA's bytes, on this device, of ``trainer``'s step of the first ``size`` samples of ``x, y`` cut into
  micro-batches of ``micro`` (through the ``accumulate_steps`` window, as a streamed chunk's, if ``via_window``)."""
  trainer.target.reset(size)
  plan = plan_micro_batches(size, micro_batch_size=micro)._replace(remat=remat)
  return step_memory(trainer.compile_step(x[:size], y[:size], plan=plan, via_window=via_window, quick=True)).total


def streaming_budget(probes, batches, chunk=6) -> int:
  """A budget between two steps of each trainer in ``probes`` as XLA measures them on this device: a chunk of
  ``chunk`` samples in one piece through the window (a streamed chunk's step), which fits, and the smallest step
  that holds the smallest batch on the device, which does not: every batch streams. That step is the one of a
  sample per micro-batch where memory grows with the micro-batch (a CPU), and may be the batch's in one piece where
  a TPU's tiles pad a micro-batch of one sample to 8 rows (on a TPU v5e the written-state tests' batch of 8 took
  213 KB in one piece, 478 KB in micro-batches of one): the smaller of the two."""
  x, y = min(batches, key=lambda batch: len(batch[0]))
  streamed = max(step_bytes(probe, x, y, chunk, chunk, via_window=True) for probe in probes)
  whole = min(step_bytes(probe, x, y, len(x), micro, via_window=False) for probe in probes for micro in (1, len(x)))
  assert streamed < whole, (streamed, whole)
  return (streamed + whole) // 2


def tpu_tiles(monkeypatch, tile: int = 128) -> None:
  """Micro-batch and piece sizes rounded to a TPU's tiles (multiples of ``tile``, of 8 below it) on whatever
  device runs the test: the sizes the planner tries on a TPU (:func:`~brainpy_accum.memory._budget.device_tile`);
  ``tile=1``: every size, as on a CPU or a GPU."""
  monkeypatch.setattr(_budget, 'device_tile', lambda: tile)
