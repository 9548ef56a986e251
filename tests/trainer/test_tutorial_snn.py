"""BrainPy's own SNN training tutorial (docs/tutorial_training/bp_training.ipynb, "Train a SNN model"), its model
and loss as BrainPy wrote them, at sizes where the freshly built network fires no spike on the first batch.

There both spike penalties are 0 in value on every micro-batch and on the whole batch, so a check on values
alone stays silent while the default mode trains another objective (the squared spike count couples the
samples through its surrogate gradient). The check must warn from the gradient, and ``whole_batch_loss=True``
must train bp.BPTT's objective.
"""

import brainpy as bp
import brainpy.math as bm
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, params_of

NUM_IN, NUM_REC, NUM_OUT, NUM_STEPS, BATCH, NUM_BATCHES = 20, 16, 4, 12, 12, 4


class SNNModel(bp.DynamicalSystem):  # as in the tutorial
  def __init__(self, num_in, num_rec, num_out):
    super(SNNModel, self).__init__()

    # parameters
    self.num_in = num_in
    self.num_rec = num_rec
    self.num_out = num_out

    # neuron groups
    self.r = bp.dyn.LifRef(num_rec, tau=10, V_reset=0, V_rest=0, V_th=1.)
    self.o = bp.dyn.Leaky(num_out, tau=5)

    # synapse: i->r
    self.i2r = bp.dyn.HalfProjAlignPost(comm=bp.dnn.Linear(num_in, num_rec, bp.init.KaimingNormal(scale=2.)),
                                        syn=bp.dyn.Expon(num_rec, tau=10.),
                                        out=bp.dyn.CUBA(),
                                        post=self.r)
    # synapse: r->o
    self.r2o = bp.dyn.HalfProjAlignPost(comm=bp.dnn.Linear(num_rec, num_out, bp.init.KaimingNormal(scale=2.)),
                                        syn=bp.dyn.Expon(num_out, tau=10.),
                                        out=bp.dyn.CUBA(),
                                        post=self.o)

  def update(self, spike):
    self.i2r(spike)
    self.r2o(self.r.spike.value)
    self.r()
    self.o()
    return self.o.x.value


def loss_fun(predicts, targets):  # as in the tutorial
    predicts, mon = predicts
    # L1 loss on total number of spikes
    l1_loss = 1e-5 * bm.sum(mon['r.spike'])
    # L2 loss on spikes per neuron
    l2_loss = 1e-5 * bm.mean(bm.sum(bm.sum(mon['r.spike'], axis=0), axis=0) ** 2)
    # predictions
    predicts = bm.max(predicts, axis=1)
    loss = bp.losses.cross_entropy_loss(predicts, targets)
    acc = bm.mean(predicts.argmax(-1) == targets)
    return loss + l2_loss + l1_loss, {'acc': acc}


def _model():
  bm.random.seed(0)
  with bm.training_environment():
    return SNNModel(num_in=NUM_IN, num_rec=NUM_REC, num_out=NUM_OUT)


def _batches():
  """Binary input spikes, as the tutorial's sparse generator makes them (one spike per unit at most here)."""
  rng = np.random.RandomState(0)
  return [((rng.uniform(size=(BATCH, NUM_STEPS, NUM_IN)) < 0.1).astype(np.float32),
           rng.randint(0, NUM_OUT, size=BATCH)) for _ in range(NUM_BATCHES)]


def _trainer(cls, **kwargs):
  model = _model()
  return cls(model, loss_fun=loss_fun, loss_has_aux=True, optimizer=bp.optim.Adam(lr=1e-3),
             monitors={'r.spike': model.r.spike}, progress_bar=False, **kwargs)


def test_freshly_built_tutorial_network_is_quiet_on_the_first_batch():
  """The premise of the tests below: no spike on the first batch, so both penalties are 0 in value."""
  trainer = _trainer(bp.BPTT)
  x, _ = _batches()[0]
  trainer.predict(x, reset_state=True)
  assert trainer.mon['r.spike'].shape == (BATCH, NUM_STEPS, NUM_REC)
  assert float(np.sum(trainer.mon['r.spike'])) == 0.


def test_default_mode_warns_at_random_outputs_on_the_quiet_tutorial_network():
  """The tutorial's spike-count penalty, summed over the batch, is 0 on the quiet first batch; random outputs in
  place of the network's show the coupling."""
  trainer = _trainer(AccumBPTT, num_micro_batch=3)
  with pytest.warns(UserWarning, match='couples the samples') as record:
    trainer.fit(_batches(), num_epoch=1)
  messages = [str(w.message) for w in record if 'couples the samples' in str(w.message)]
  assert len(messages) == 1 and 'random outputs (uniform' in messages[0]


@pytest.mark.long  # the long suite (--long): README suite time
def test_whole_batch_loss_trains_the_tutorial_network_as_bptt_does():
  """Parameters after 4 updates and every recorded loss equal bp.BPTT's on the whole batch, to float32 round-off
  (the helpers' tolerance: rtol 1e-5, atol 1e-6)."""
  bptt, accum = _trainer(bp.BPTT), _trainer(AccumBPTT, num_micro_batch=3, whole_batch_loss=True)
  bptt.fit(_batches(), num_epoch=1)
  accum.fit(_batches(), num_epoch=1)
  assert_trees_close(params_of(accum.target), params_of(bptt.target))
  assert_trees_close(accum.get_hist_metric('fit', 'loss'), bptt.get_hist_metric('fit', 'loss'))
  # the run did update: the parameters moved away from the freshly built ones
  assert max(np.abs(a - b).max() for a, b in zip(params_of(accum.target), params_of(_model()))) > 1e-4
