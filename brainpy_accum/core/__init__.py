"""The engine, usable without a trainer: cutting a batch into micro-batches and combining their gradients.

``accumulate`` runs one ``scan`` over the micro-batches and returns weighted sums; ``micro_batched_grad`` is
the functional front door built on it. The rest are its parts: the cut (``_cut``), batch axes and slicing
(``_batch``), the weighted sums and their division (``_combine``), model states (``_states``), states written
without a batch axis (``_written``), the device mesh (``_mesh``), the two passes of a loss of the whole batch
(``_two_pass``) and the batch statistics a loss marks (``_batch_stats``: ``batch_mean``, ``batch_sum``).
"""

from ._accumulate import MicroResult as MicroResult
from ._accumulate import Sums as Sums
from ._accumulate import accumulate as accumulate
from ._accumulate import micro_batched_grad as micro_batched_grad
from ._batch_stats import batch_mean as batch_mean
from ._batch_stats import batch_sum as batch_sum
from ._cut import MicroBatchPlan as MicroBatchPlan
from ._cut import describe_remat as describe_remat
from ._cut import plan_micro_batches as plan_micro_batches

__all__ = ['MicroBatchPlan', 'MicroResult', 'Sums', 'accumulate', 'batch_mean', 'batch_sum', 'describe_remat',
           'micro_batched_grad', 'plan_micro_batches']
