"""The data and settings shared by the two-process run and its single-process reference."""

import brainpy as bp

from helpers import make_batches

BATCHES = make_batches((16, 16, 8))  # multiples of the 4 devices of the two processes
NUM_EPOCH = 2


def make_trainer_kwargs():
  """Keyword arguments of both trainers (a fresh optimizer each call)."""
  return dict(optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, num_micro_batch=2)


RESUME_BATCHES = make_batches((8, 8, 8, 8, 4), seed=5)  # stopped while fetching batch 4: batch 2 in the window


def make_resume_trainer(mesh=None):
  """The trainer of the two-process checkpoint check (``mesh=None``: its one-process reference)."""
  from brainpy_accum import AccumBPTT
  from helpers import make_model
  return AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05), mesh=mesh,
                   accumulate_steps=2, num_micro_batch=1, progress_bar=False)
