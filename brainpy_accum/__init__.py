"""Gradient accumulation for BrainPy: ``AccumBPTT`` instead of ``bp.BPTT``, same ``trainer.fit(...)``."""

from .core import MicroBatchPlan as MicroBatchPlan
from .core import batch_mean as batch_mean
from .core import batch_sum as batch_sum
from .core import micro_batched_grad as micro_batched_grad
from .core import plan_micro_batches as plan_micro_batches
from .diagnostics import AllReduceCount as AllReduceCount
from .diagnostics import count_all_reduces as count_all_reduces
from .memory import compiled_step_bytes as compiled_step_bytes
from .memory import parse_memory as parse_memory
from .trainer import AccumBPTT as AccumBPTT

__all__ = ['AccumBPTT', 'AllReduceCount', 'MicroBatchPlan', 'batch_mean', 'batch_sum', 'compiled_step_bytes',
           'count_all_reduces', 'micro_batched_grad', 'parse_memory', 'plan_micro_batches']
__version__ = '0.1.0'
