"""Fitting a step into device memory: the budget, the fastest plan, remat, streaming, running out of memory.

``_budget``: the fewest micro-batches whose compiled step fits ``memory_budget``; ``_fastest``: with
``remat='auto'``, the fastest (micro-batches, remat) plan that fits; ``_remat``: the checkpointed time loop;
``_stream``: batches larger than the device, streamed from the host in chunks; ``_live``: a lower bound of a
step's memory from its trace, without compiling; ``_oom``: cut finer and retry after the device ran out of memory.
"""

from ._budget import compiled_step_bytes as compiled_step_bytes
from ._budget import format_memory as format_memory
from ._budget import parse_memory as parse_memory
from ._fastest import time_steps as time_steps

__all__ = ['compiled_step_bytes', 'format_memory', 'parse_memory', 'time_steps']
