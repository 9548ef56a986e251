"""Fitting a step into device memory: the planner, the budget, the fastest plan, remat, streaming, out of memory.

``_planner``: :class:`Planner`, the plan of each batch size (it owns the plans and composes the budget, the plan
cache's dialogue and the streaming policy; what it compiles and times comes in as :class:`Compilers`);
``_device``: the device's own memory (:class:`Budget`), the budget as planning checks it (``PlanBudget``) and
its out-of-memory errors; ``_budget``: the fewest micro-batches whose compiled step fits; ``_fastest``: with
``remat='auto'``, the fastest (micro-batches, remat) plan that fits; ``_chunks`` and ``_stream``: batches
streamed from the host in pieces or chunks (``Streaming``, ``ChunkSearch``); ``_cache`` and ``_plan_key``: the
plan cache (``CachedPlans``: the planner's dialogue with it); ``_remat``: the checkpointed time loop; ``_live``:
a lower bound of a step's memory from its trace, without compiling; ``_oom``: cut finer and retry after the
device ran out of memory.
"""

from ._budget import compiled_step_bytes as compiled_step_bytes
from ._budget import format_memory as format_memory
from ._budget import parse_memory as parse_memory
from ._budget import PlannedStep as PlannedStep
from ._device import Budget as Budget
from ._fastest import time_steps as time_steps
from ._planner import Compilers as Compilers
from ._planner import PlannedModel as PlannedModel
from ._planner import Planner as Planner

__all__ = ['Budget', 'Compilers', 'PlannedModel', 'PlannedStep', 'Planner', 'compiled_step_bytes', 'format_memory',
           'parse_memory', 'time_steps']
