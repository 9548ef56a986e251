"""Checkpoints of a trainer and resuming a run: ``_save_load`` writes and reads the file, ``_resume`` says where
a ``fit`` call stands and holds Ctrl-C and SIGTERM until a batch is done."""

from ._resume import Progress as Progress
from ._save_load import FORMAT as FORMAT
from ._save_load import load as load
from ._save_load import save as save

__all__ = ['FORMAT', 'Progress', 'load', 'save']
