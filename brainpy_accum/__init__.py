"""Gradient accumulation for BrainPy: ``AccumBPTT`` instead of ``bp.BPTT``, same ``trainer.fit(...)``."""

from ._plan import MicroBatchPlan
from ._plan import plan_micro_batches
from ._planner import compiled_step_bytes
from ._planner import parse_memory
from .trainer import AccumBPTT

__all__ = ['AccumBPTT', 'MicroBatchPlan', 'compiled_step_bytes', 'parse_memory', 'plan_micro_batches']
__version__ = '0.1.0'
