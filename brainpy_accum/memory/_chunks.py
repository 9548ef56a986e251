"""Which chunk size to stream a batch in, when its data does not fit beside its step.

:class:`ChunkSearch` serves :func:`~brainpy_accum.memory._stream.best_chunk` for one batch: of the chunk sizes
whose step fits, the one that holds the largest micro-batches, then the largest chunk (the chunk's plan is
then the fastest that fits, with ``remat='auto'``, which may cut finer: by memory alone, the choice of chunk
does not hang on the noise of trial steps). Few chunks are planned: first the one a line through the largest
chunk's quick probes predicts to win (:func:`~brainpy_accum.memory._stream.likely_chunk`: the step's fixed
bytes change with the chunk, its temporaries with the micro-batch), then only those that can still hold
micro-batches large enough to win, by a lower bound (a cut of no larger micro-batches measured in a chunk no
larger, plus the extra data and states; or one from the step's trace, :mod:`~brainpy_accum.memory._live`) or
else a quick probe. The chunks' searches share their probes, and each starts at the micro-batch the guess's
line predicts.
"""

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..core._cut import MicroBatchPlan, plan_micro_batches
from ._budget import memory_parts, state_bytes
from ._stream import chunk_candidates, host_chunk, likely_chunk

__all__ = ['ChunkSearch']


class ChunkSearch:
  """The chunk search of one streamed batch.

  Parameters
  ----------
  layout : BatchLayout
    The batch's layout (its size and batch axes).
  batch : tuple
    ``(shared_args, inputs, targets)`` of the whole batch (on the host).
  budget : int
    The memory budget in bytes.
  compilers : Compilers
    The planner's (:class:`~brainpy_accum.memory._planner.Compilers`).
  model : PlannedModel
    The planner's view of the model (:class:`~brainpy_accum.memory._planner.PlannedModel`).
  remat_options : sequence
    The remat of each plan a chunk may have (``(None,)``: the trainer's own).
  plan_chunk : callable
    ``plan_chunk(chunk, chunk_data, compilers, unkept) -> Optional[int]``: the largest micro-batch whose step
    fits a chunk of ``chunk`` samples (planned with ``compilers``, its compiled step put in ``unkept``), or
    ``None``; ``chunk_data()`` gives the chunk's ``(inputs, targets)`` (``None``: its fixed bytes alone exceed
    the budget).
  """

  def __init__(self, layout, batch: tuple, budget: int, compilers, model, *, remat_options: Sequence,
               plan_chunk: Callable):
    self.layout, (self.shared_args, self.inputs, self.targets) = layout, batch
    self.budget, self.model, self.options, self.plan_chunk = budget, model, tuple(remat_options), plan_chunk
    self.outer = compilers
    self.compilers = compilers._replace(step_bytes=self._probe, trial=self._trial, guess=self._guess)
    self.unkept: Dict[int, Any] = {}  # each chunk's step compiled for training; only the chosen chunk's is kept
    self._probes: Dict[tuple, Any] = {}
    self._cut_bytes: Dict[Tuple[int, int, Any], int] = {}  # (chunk, micro, remat) -> bytes of a step of 2+ cuts
    self._line: Dict[str, Any] = {}  # likely()'s line: the fixed bytes' offset, the temporaries per sample
    self._states_now = model.batched(layout.batch_size)  # fit reset them at the batch size

  # ------------------------------------------------------------------ measurements, shared by every chunk

  def _noted(self, plan: MicroBatchPlan, memory):
    if plan.num_micro_batches > 1:
      self._cut_bytes[plan.batch_size, plan.micro_batch_size, plan.remat] = memory_parts(memory)[0]
    return memory

  def _probe(self, plan: MicroBatchPlan, shared_args, inputs, targets, via_window):
    """Each quick probe once, for every chunk's search."""
    key = (plan.batch_size, plan.micro_batch_size, plan.remat, via_window)
    if key not in self._probes:
      self._probes[key] = self._noted(plan, self.outer.step_bytes(plan, shared_args, inputs, targets, via_window))
    return self._probes[key]

  def _trial(self, plan: MicroBatchPlan, *args):
    planned = self.outer.trial(plan, *args)
    self._noted(plan, planned.memory)
    return planned

  def _guess(self, plan: MicroBatchPlan) -> Optional[float]:
    """A chunk's step, predicted by :meth:`likely`'s line (``None`` before it is drawn)."""
    slope = self._line.get('per_sample', {}).get(plan.remat)
    if slope is None:
      return None
    return self._fixed_bytes_of_chunk(plan.batch_size) + self._line['offset'] + slope * plan.micro_batch_size

  # ------------------------------------------------------------------ chunks

  def _data_of(self, chunk: int):
    """The first chunk's inputs and targets."""
    return [host_chunk(tree, axes, 0, chunk) for tree, axes in ((self.inputs, self.layout.input_axes),
                                                                (self.targets, self.layout.target_axes))]

  def _chunk_of(self, chunk: int):
    """The first chunk's data, with the model state at the chunk's size."""
    self.model.reset(chunk)
    return self._data_of(chunk)

  def _fixed_bytes_of_chunk(self, chunk: int) -> int:
    """The model's fixed bytes at the chunk's size, by arithmetic: no reset (its zeros would compile once per
    size); the model's batched states scale with the chunk."""
    return (self.model.fixed_bytes(*self._data_of(chunk)) - state_bytes(self._states_now)
            + state_bytes(self._states_now, chunk))

  def chunk_data(self, chunk: int):
    """The first chunk's ``(inputs, targets)``, with the model state at its size; ``None`` where its fixed bytes
    alone exceed the budget (arithmetic)."""
    return self._fitting_chunk_of(chunk)

  def _fitting_chunk_of(self, chunk: int):
    """:meth:`_chunk_of`; ``None`` where its fixed bytes alone exceed the budget (arithmetic)."""
    chunk_data = self._chunk_of(chunk)
    return None if self.model.fixed_bytes(*chunk_data) > self.budget else chunk_data

  def _plan_of(self, chunk: int, micro: int, remat) -> MicroBatchPlan:
    return plan_micro_batches(chunk, micro_batch_size=micro)._replace(remat=remat)

  def micro_batch_of(self, chunk: int) -> Optional[int]:
    """The largest micro-batch that fits a chunk of ``chunk`` samples; ``None``: none."""
    return self.plan_chunk(chunk, lambda: self._fitting_chunk_of(chunk), self.compilers, self.unkept)

  def _bytes_from_smaller(self, plan: MicroBatchPlan) -> int:
    """A lower bound of a cut, from cuts of no more samples, by arithmetic: larger micro-batches, or more of
    them in a larger chunk, do not shrink the temporaries (memory grows with the micro-batch, as the search
    assumes), and the data and states grow with the chunk."""
    if plan.num_micro_batches < 2:  # in one piece a chunk is another step, without the micro-batch loop
      return 0
    known = [used - self._fixed_bytes_of_chunk(chunk) for (chunk, micro, remat), used in self._cut_bytes.items()
             if remat == plan.remat and micro <= plan.micro_batch_size and chunk <= plan.batch_size]
    return max(known) + self._fixed_bytes_of_chunk(plan.batch_size) if known else 0

  def can_hold(self, chunk: int, micro: int) -> bool:
    """Does some step of micro-batches of ``micro`` fit a chunk of ``chunk`` samples?"""
    chunk_data = self._fitting_chunk_of(chunk)
    if chunk_data is None:
      return False
    batch = (self.shared_args, *chunk_data)
    try:
      return any(self._bytes_from_smaller(plan) <= self.budget
                 and self.outer.bytes_at_least(plan, *batch, True) <= self.budget
                 and memory_parts(self._probe(plan, *batch, True))[0] <= self.budget
                 for plan in (self._plan_of(chunk, micro, remat) for remat in self.options))
    except ValueError:  # not answered here: planning the chunk will say
      return True

  def _likely(self) -> Optional[int]:
    """A line through the largest chunk's quick probes, one per remat option: the chunk it predicts to win."""
    fixed_least = {chunk: self._fixed_bytes_of_chunk(chunk) for chunk in chunk_candidates(self.layout.batch_size)}
    top = max((chunk for chunk, least in fixed_least.items() if least <= self.budget), default=None)
    if top is None:
      return None
    batch = (self.shared_args, *self._chunk_of(top))  # (the first probes of its own search, if it is planned)
    measured = {remat: memory_parts(self._probe(self._plan_of(top, top, remat), *batch, True))
                for remat in self.options}
    self._line['offset'] = max(fixed for _, fixed in measured.values()) - fixed_least[top]
    self._line['per_sample'] = {remat: (total - fixed) / top for remat, (total, fixed) in measured.items()}
    return likely_chunk(self.layout.batch_size, self.budget, lambda chunk: fixed_least[chunk] + self._line['offset'],
                        list(self._line['per_sample'].values()))

  def guessed(self) -> Optional[int]:
    """The chunk to plan first; a guess that cannot be made only orders the planning differently."""
    try:
      return self._likely()
    except ValueError:
      return None

  def one_sample_need(self) -> Optional[int]:
    """What streaming one sample at a time needs (a quick probe's figure), or ``None`` if unknown."""
    chunk_data = self._chunk_of(1)
    fixed = self.model.fixed_bytes(*chunk_data)
    if fixed > self.budget:
      return fixed
    try:
      return min(memory_parts(self._probe(self._plan_of(1, 1, remat), self.shared_args, *chunk_data, True))[0]
                 for remat in self.options)
    except ValueError:
      return None
