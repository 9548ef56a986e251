"""A spiking classifier whose read-out is averaged over time trains as bp.BPTT at changing batch sizes.

The guide's section on what is exact says that a loss with a maximum over time (or an argmax, a sort) is exact
only up to ties: a read-out that settles on a float32 plateau ties over many steps, the maximum's gradient is
split among the tied steps, and a micro-batch's last-ulp differences (other shapes, other kernels) change which
steps tie. This test holds the other side of that explanation: the same kind of network (a recurrent LIF layer
with random initial potentials, merged projections through exponential synapses, a leaky read-out) with the
read-out's mean over time, at uneven micro-batches of batches of 10, 11 and 10, equals bp.BPTT after three
updates to float32 round-off. A model state handled wrongly (a micro-batch starting from another sample's
potentials, a state not written back) could not hide behind ties here.
"""

import brainpy as bp
import brainpy.math as bm
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, params_of

NUM_IN, NUM_REC, NUM_OUT, NUM_STEPS = 20, 16, 4, 60


class RecurrentSNN(bp.DynamicalSystem):
  """Input -> recurrent LIF (random initial potentials) -> leaky read-out, through merged exponential synapses."""

  def __init__(self):
    super().__init__()
    self.r = bp.dyn.LifRef(NUM_REC, tau=10., V_reset=0., V_rest=0., V_th=1., V_initializer=bp.init.Uniform(0., 0.8))
    self.o = bp.dyn.Leaky(NUM_OUT, tau=5.)
    self.i2r = self._projection(NUM_IN, NUM_REC, 2., self.r)
    self.r2r = self._projection(NUM_REC, NUM_REC, 1., self.r)  # merged with i2r's synapse (same time constant)
    self.r2o = self._projection(NUM_REC, NUM_OUT, 1e-5, self.o)  # read-out logits of order 1

  @staticmethod
  def _projection(num_pre, num_post, scale, post):
    return bp.dyn.HalfProjAlignPostMg(comm=bp.dnn.Linear(num_pre, num_post, bp.init.KaimingNormal(scale=scale)),
                                      syn=bp.dyn.Expon.desc(num_post, tau=10.), out=bp.dyn.CUBA.desc(), post=post)

  def update(self, spikes):
    recurrent = self.r.spike.value
    self.i2r(spikes)
    self.r2r(recurrent)
    self.r2o(recurrent)
    self.r()
    self.o()
    return self.o.x.value


def mean_over_time_cross_entropy(predicts, labels):
  """Cross-entropy of the read-out's mean over time: a mean of smooth per-step terms, no ties."""
  return bp.losses.cross_entropy_loss(bm.mean(predicts, axis=1), labels)


def _spike_batches(sizes, seed=0):
  """Poisson spike trains of random 'images' (rates up to 0.3 per step), with random labels."""
  rng = np.random.RandomState(seed)
  batches = []
  for size in sizes:
    rates = 0.3 * rng.rand(size, 1, NUM_IN)
    batches.append(((rng.rand(size, NUM_STEPS, NUM_IN) < rates).astype('float32'), rng.randint(0, NUM_OUT, size)))
  return batches


@pytest.mark.long  # the long suite (--long): a spiking network over batches of three sizes
def test_mean_over_time_read_out_trains_as_bptt_at_changing_batch_sizes():
  batches = _spike_batches((10, 11, 10))
  results = []
  for cls, options in ((bp.BPTT, {}), (AccumBPTT, {'num_micro_batch': 2})):
    bm.random.seed(0)
    with bm.training_environment():
      model = RecurrentSNN()
    trainer = cls(model, mean_over_time_cross_entropy, optimizer=bp.optim.Adam(lr=1e-3), progress_bar=False,
                  **options)
    trainer.fit(batches, num_epoch=1, num_report=1)
    assert trainer.get_hist_metric('fit', 'loss', 'detailed').shape == (3,)
    results.append((params_of(model), np.asarray(model.r.V), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert np.asarray(results[0][1]).shape == (10, NUM_REC)
  assert_trees_close(results[1], results[0])  # rtol 1e-5, atol 1e-6
