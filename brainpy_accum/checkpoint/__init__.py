"""Checkpoints of a trainer and resuming a run: ``_file`` is the file (every byte under a checksum, written
atomically), ``_save_load`` puts a trainer into it and back, ``_resume`` says where a ``fit`` call stands and
holds Ctrl-C and SIGTERM until a batch is done."""

from ._resume import Progress as Progress
from ._file import FORMAT as FORMAT
from ._save_load import load as load
from ._save_load import save as save

__all__ = ['FORMAT', 'Progress', 'load', 'save']
