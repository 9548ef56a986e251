"""One compilation per batch shape, fresh random numbers per micro-batch, bounded memory."""

import brainpy as bp
import brainpy.math as bm
import jax
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from helpers import TINY_SIZES, make_batches, make_model


def test_train_step_is_traced_and_compiled_once_per_batch_shape():
  trainer = AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, num_micro_batch=4, progress_bar=False)
  trainer.fit(make_batches((10, 10, 7)), test_data=make_batches((9,), seed=1), num_epoch=4)
  # batch sizes 10 and 7 (the short last batch): two shapes, each traced once over four epochs.
  assert trainer.trace_counts == {'fit': 2, 'loss': 1}
  # ...and compiled once: the parameters' abstract types (weak types included) survive the update.
  assert trainer.compilations == {'fit': 2, 'loss': 1}


class NoisyReadout(bp.DynamicalSystem):
  """Adds fresh Gaussian noise to the read-out at every step."""

  def __init__(self):
    super().__init__()
    self.out = bp.dnn.Dense(3, 2)

  def update(self, x):
    return self.out(x) + bm.random.normal(0., 1., (x.shape[0], 2))


@pytest.mark.host_callback('the loss records what each micro-batch saw on the host')
def test_each_micro_batch_draws_fresh_random_numbers():
  seen = []

  def recording_loss(predicts, targets):
    jax.debug.callback(lambda p: seen.append(np.asarray(p)), predicts)
    return bp.losses.mean_squared_error(predicts, targets)

  bm.random.seed(0)
  with bm.training_environment():
    model = NoisyReadout()
  trainer = AccumBPTT(model, recording_loss, num_micro_batch=3, progress_bar=False)
  x = np.ones((6, 4, 3), 'float32')  # every sample identical: only the noise tells them apart
  trainer.fit([(x, np.zeros((6, 4, 2), 'float32'))], num_epoch=1)
  # The first batch's loss check records first: at each of its three random points, the 3 micro-batch losses
  # and the whole batch's: 12 calls, 3 of them on the whole batch. Then the train step's 3.
  assert len(seen) == 15
  assert sorted(s.shape for s in seen[:12]) == [(2, 4, 2)] * 9 + [(6, 4, 2)] * 3
  step = seen[-3:]
  assert all(s.shape == (2, 4, 2) for s in step)
  for i in range(3):
    for j in range(i + 1, 3):
      assert not np.allclose(step[i], step[j]), f'micro-batches {i} and {j} reused the same noise'


def _temp_bytes(num_micro_batch):
  model = make_model('rnn', n_in=8, n_hidden=64, n_out=4)
  trainer = AccumBPTT(model, bp.losses.mean_squared_error, num_micro_batch=num_micro_batch, progress_bar=False)
  x, y = make_batches((64,), num_time=40, n_in=8, n_out=4)[0]
  model.reset(64)
  compiled = trainer.f_train.compile(bp.tools.DotDict(fit=True), x, y)
  return compiled.memory_analysis().temp_size_in_bytes


@TINY_SIZES
def test_micro_batches_shrink_the_compiled_steps_working_memory():
  """XLA's compile-time analysis (deterministic): only one micro-batch's activations are alive."""
  whole, quarter = _temp_bytes(1), _temp_bytes(4)
  assert quarter < 0.4 * whole, (quarter, whole)
