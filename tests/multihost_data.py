"""The data and settings shared by the two-process run and its single-process reference."""

import brainpy as bp

from helpers import make_batches

BATCHES = make_batches((16, 16, 8))  # multiples of the 4 devices of the two processes
NUM_EPOCH = 2


def make_trainer_kwargs():
  """Keyword arguments of both trainers (a fresh optimizer each call)."""
  return dict(optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, num_micro_batch=2)
