"""Gradient accumulation for BrainPy: ``AccumBPTT`` instead of ``bp.BPTT``, same ``trainer.fit(...)``."""

from ._core import micro_batched_grad
from ._plan import MicroBatchPlan
from ._plan import plan_micro_batches
from ._hlo import AllReduceCount
from ._hlo import count_all_reduces
from ._planner import compiled_step_bytes
from ._planner import parse_memory
from .trainer import AccumBPTT

__all__ = ['AccumBPTT', 'AllReduceCount', 'MicroBatchPlan', 'compiled_step_bytes', 'count_all_reduces',
           'micro_batched_grad', 'parse_memory', 'plan_micro_batches']
__version__ = '0.1.0'
