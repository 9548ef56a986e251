"""A training run for the resume tests: ``python resume_worker.py CHECKPOINT OUT_NPZ``.

Trains the spiking test network (random initial potentials at every reset, so the random state matters)
with a decaying learning rate, ``accumulate_steps=2`` windows and a test set, checkpointing after every
update (``CHECKPOINT`` is ``-`` for none). It prints ``batch`` before handing each training batch to
``fit``, so that the test can interrupt it at a chosen point, and saves what an uninterrupted run must
reproduce to ``OUT_NPZ``.
"""

import sys

import brainpy as bp
import numpy as np

from brainpy_accum import AccumBPTT
from helpers import make_batches, make_model, optimizer_state, params_of

BATCHES = make_batches((6, 6, 5, 6, 3), seed=3)
TEST = make_batches((4, 3), seed=4)
NUM_EPOCH = 3


def make_trainer():
  model = make_model('snn')
  optimizer = bp.optim.Adam(lr=bp.optim.ExponentialDecayLR(0.05, decay_steps=1, decay_rate=0.9))
  return AccumBPTT(model, bp.losses.mean_squared_error, optimizer=optimizer, num_micro_batch=2,
                   accumulate_steps=2, progress_bar=False)


def announced_batches():
  for batch in BATCHES:
    print('batch', flush=True)
    yield batch


def main(checkpoint: str, out: str) -> None:
  trainer = make_trainer()
  trainer.fit(announced_batches, test_data=TEST, num_epoch=NUM_EPOCH, num_report=2,
              checkpoint=None if checkpoint == '-' else checkpoint, checkpoint_every=None if checkpoint == '-' else 1)
  np.savez(out, *params_of(trainer.target), *optimizer_state(trainer), train=trainer.train_losses,
           test=trainer.test_losses, detailed=trainer.get_hist_metric('fit', which='detailed'),
           lr=np.asarray(trainer.optimizer.lr()))


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2])
