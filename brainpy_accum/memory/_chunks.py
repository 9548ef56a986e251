"""Batches streamed from the host: which ones, in pieces or in chunks, and of which size.

:class:`Streaming` decides, for a planner, which batches stream and keeps the size each streams in. A host batch
on a device that data is sent to ahead, whose step does not fit in one micro-batch, streams by choice in pieces of
one micro-batch each; a batch whose data does not fit beside its step streams in chunks.

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

import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from tqdm import tqdm

from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._states import values_restored
from ._budget import (PlannedStep, StepMemory, argument_bytes, candidate_micro_batch_sizes, first_probe_trains,
                      format_memory, largest_fitting, memory_parts, state_bytes)
from ._cache import CachedPlans
from ._device import PlanBudget
from ._stream import best_chunk, chunk_candidates, host_chunk, likely_chunk

__all__ = ['PIECE_FILL', 'ChunkSearch', 'Streaming']

# A batch streamed in pieces is cut so that a piece's step (with the next piece sent ahead) takes at most this share
# of the budget where a smaller piece allows it: the rest is room for the device's own allocations beside it. On a
# TPU v5e (the benchmark's spiking network, 14.9 GiB budget) pieces whose step took 65% of the budget trained at
# 0.93 of bp.BPTT's speed on device data, pieces at 89% and 93% at 0.81 and 0.57 (allocations beside a nearly full
# device stall there).
PIECE_FILL = 0.75


class Streaming:
  """Which batches a planner streams from the host, in pieces or in chunks, and the size each streams in.

  A host batch on a device that data is sent to ahead, whose step does not fit in one micro-batch, streams in
  pieces of one micro-batch each (:meth:`pieces`), each sent while the one before computes, so that the device
  holds the running step and one piece more, never the whole batch. A batch whose data does not fit beside its
  step streams in chunks (:meth:`chunks`). Each chunk (piece) is planned by the planner as a batch whose step
  passes through the window; the size chosen goes in the plan cache, beside the chunks' own plans, so that a
  rerun skips the search.

  Parameters
  ----------
  model : PlannedModel
    The planner's view of the model (:class:`~brainpy_accum.memory._planner.PlannedModel`).
  budget : PlanBudget
    The budget plans are made against (:class:`~brainpy_accum.memory._device.PlanBudget`).
  cached : CachedPlans
    The plan cache's dialogue (:class:`~brainpy_accum.memory._cache.CachedPlans`).
  remat : bool, int or 'auto'
    The trainer's remat (``'auto'``: a chunk's plan may have either).
  plans : dict
    The planner's plans, ``{batch (or chunk) size: (plan, bytes)}``, read here.
  plan_chunk : callable
    ``plan_chunk(request, chunk, chunk_data, compilers, unkept) -> Optional[int]``: the planner's plan of a chunk
    of ``request``'s batch (:class:`ChunkSearch`'s ``plan_chunk``, for that batch).
  plan_whole : callable
    ``plan_whole(request) -> MicroBatchPlan``: the planner's plan of the whole batch, unstreamed: where no chunk
    fits and nothing else says why, its search gives the error that names the budget needed.

  A ``request`` is the planner's batch to plan: its ``layout``, ``batch`` (``shared_args, inputs, targets``),
  ``step_time`` and the ``compilers`` to plan it with.
  """

  def __init__(self, model, budget: PlanBudget, cached: CachedPlans, *, remat: Any,
               plans: Dict[int, Tuple[MicroBatchPlan, int]],
               plan_chunk: Callable[..., Optional[int]], plan_whole: Callable[[Any], MicroBatchPlan]):
    self.model, self.budget, self.cached, self.remat, self.plans = model, budget, cached, remat, plans
    self.plan_chunk, self.plan_whole = plan_chunk, plan_whole
    self.stream_chunks: Dict[int, int] = {}  # batch sizes streamed from the host, and their chunk size
    self.piece_sizes: set = set()  # of those, the ones streamed in pieces by choice (their data fits the device)
    # (batch or piece size, through the window) -> (plan, step) compiled for training by a decision: see take_whole
    self._whole_compiled: Dict[Tuple[int, bool], Tuple[MicroBatchPlan, PlannedStep]] = {}

  def is_streamed(self, batch_size: int, on_device: bool = False) -> bool:
    """Whether a batch of ``batch_size`` is streamed in chunks: one streamed because its data does not fit beside
    its step, always; one streamed in pieces by choice (a host batch sent ahead), not where its data is on the
    device already: its step then runs whole, in micro-batches of the pieces' size."""
    return batch_size in self.stream_chunks and not (on_device and batch_size in self.piece_sizes)

  def drop(self, sizes: Sequence[int]) -> None:
    """Forget the batches streamed in chunks (pieces) of one of ``sizes``, whose plans were dropped."""
    for batch_size in [b for b, chunk in self.stream_chunks.items() if chunk in sizes]:
      del self.stream_chunks[batch_size]
      self.piece_sizes.discard(batch_size)

  def _search(self, request, remat_options: Sequence) -> 'ChunkSearch':
    """The chunk search of ``request``'s batch, whose chunks the planner plans with one of ``remat_options``."""
    return ChunkSearch(request.layout, request.batch, self.budget.bytes(), request.compilers, self.model,
                       remat_options=remat_options, plan_chunk=functools.partial(self.plan_chunk, request))

  def pieces(self, request) -> Optional[MicroBatchPlan]:
    """A host batch on a device that data is sent to ahead, streamed in pieces of one micro-batch each; the
    pieces' plan, or ``None`` where its step fits in one micro-batch (with the whole next batch sent ahead).

    The piece is the largest micro-batch (of the device's tile sizes,
    :func:`~brainpy_accum.memory._budget.candidate_micro_batch_sizes`) whose step through the window fits beside
    the next piece and the whole batch's model state, which streaming keeps twice
    (:class:`~brainpy_accum.memory._stream.StreamedStates`), within :data:`PIECE_FILL` of the budget where one
    does (room for the device's own allocations), and of those near it one that divides the batch
    (:func:`_even_piece`). Where no piece fits, the batch streams in chunks (:meth:`chunks`)."""
    batch_size = request.layout.batch_size
    search = self._search(request, (None,))
    states = 2 * state_bytes(self.model.batched(batch_size), batch_size)  # (at the batch size: before a reset too)
    key = self.cached.key(request.batch, False, modelled=request.step_time is not None, pieces=True)
    with values_restored(self.model.variables(), any_shape=True):  # resets draw random numbers: all put back
      piece = self.cached.piece(key, batch_size, functools.partial(self._piece_fits, search, states))
      if piece is None:
        whole = self._whole_bytes(request)
        if whole is not None and whole.total <= self.budget.bytes():
          return None
        piece = self._largest_piece(request, search, states, whole)
        if piece is not None:
          self.cached.store(key, {'piece': piece})
    if piece is None:
      return self.chunks(request, None)  # no piece of one micro-batch fits: chunks, or the error that says why
    self.piece_sizes.add(batch_size)
    self.budget.note_beside(piece, states)  # what a re-check of the budget counts beside its step
    return self._streamed_in(batch_size, piece, search.unkept,
                             f'streamed from the host in pieces of {piece}, each sent to the device while the one '
                             f'before computes')

  def _piece_fits(self, search: 'ChunkSearch', states: int, piece: int) -> bool:
    """Whether the step of a piece of ``piece`` samples (planned) runs in one micro-batch beside ``states``."""
    return not (search.micro_batch_of(piece) is None or self.plans[piece][0].num_micro_batches != 1
                or self.plans[piece][1] + states > self.budget.bytes())

  def take_whole(self, batch_size: int, via_window: bool = False) -> Optional[Tuple[MicroBatchPlan, PlannedStep]]:
    """``(plan, step)``: the step of a batch of ``batch_size`` in one micro-batch that :meth:`pieces` compiled
    for training and found to fit (where :func:`~brainpy_accum.memory._budget.compiles_whole_first`), for the
    planner to keep rather than compile again; ``via_window``: the step of the piece :meth:`pieces` chose, through
    the window, compiled for training by the pieces' search. ``None`` if there is none. Forgotten once taken."""
    return self._whole_compiled.pop((batch_size, via_window), None)

  def _whole_bytes(self, request) -> Optional[StepMemory]:
    """The memory of the batch's step in one micro-batch, with the whole next batch sent ahead (``None`` where
    its fixed bytes alone exceed the budget: not measured): a quick probe, or where the planner compiles that step
    for training first, that compilation (kept for :meth:`take_whole` where it fits). Its fixed part is at least
    the one known by arithmetic (a refused compilation names its total alone)."""
    batch_size = request.layout.batch_size
    fixed = self.model.fixed_bytes(request.inputs, request.targets)
    if fixed > self.budget.bytes():
      return None
    with values_restored(self.model.variables(), any_shape=True):
      self.model.reset(batch_size)
      one = plan_micro_batches(batch_size, num_micro_batch=1)._replace(remat=False if self.remat == 'auto' else None)
      if not first_probe_trains(request.compilers):
        total, measured = memory_parts(request.compilers.step_bytes(one, *request.batch, False))
        return StepMemory(total, max(fixed, measured))
      planned = request.compilers.trial(one, *request.batch, False)
    if planned.memory.total <= self.budget.bytes():
      self._whole_compiled[batch_size, False] = (one, planned)
    return planned.memory._replace(fixed=max(fixed, planned.memory.fixed))

  def _largest_piece(self, request, search: 'ChunkSearch', states: int, whole: Optional[StepMemory] = None
                     ) -> Optional[int]:
    """The piece to stream a batch in (see :meth:`pieces`), planned; ``None`` if no piece of one micro-batch fits
    beside the next piece and the batch's model state (``states`` bytes). ``whole``: the memory of the batch's
    step in one micro-batch, measured just before: scaled to a piece's samples (:func:`_scaled`), the guess where
    the search starts, in place of half the batch (a guess only orders the probes: the piece chosen is measured
    as without it)."""
    batch_size, budget = request.layout.batch_size, self.budget.bytes()
    measured: Dict[int, Optional[int]] = {}
    # where the planner compiles a step for training first (a TPU), each probe is that compilation, and the
    # chosen piece's is the one its plan keeps (a quick probe would be a second compilation of the same step)
    trained = first_probe_trains(request.compilers, True)

    def measure(size):  # the piece's step through the window, the next piece sent ahead, the batch's states
      if size not in measured:
        chunk_data = search.chunk_data(size)
        plan = plan_micro_batches(size, num_micro_batch=1)._replace(remat=False if self.remat == 'auto' else None)
        if chunk_data is None:  # its data alone exceed the budget: no figure (see largest_fitting)
          measured[size] = None
        elif trained:
          planned = search.compilers.trial(plan, request.shared_args, *chunk_data, True)
          self._whole_compiled[size, True] = (plan, planned)
          measured[size] = states + planned.memory.total
        else:  # (the search's quick probes: the piece's own planning finds this one again)
          measured[size] = states + memory_parts(search.compilers.step_bytes(plan, request.shared_args, *chunk_data,
                                                                              True))[0]
      return measured[size]

    sizes = [size for size in candidate_micro_batch_sizes(batch_size) if size < batch_size]
    roomy = min(budget, int(PIECE_FILL * budget) + states)  # room for the device's allocations, where it can
    guess = None if whole is None else _scaled(whole, batch_size, states, argument_bytes(
      (), request.inputs, request.targets) + self.model.ahead_bytes(request.inputs, request.targets))
    within = lambda limit: largest_fitting(sizes, limit, measure, guess=guess)
    try:
      found = within(roomy) or within(budget)
      piece = None if found is None else _even_piece(batch_size, found[0], sizes)
      return None if piece is None or search.micro_batch_of(piece) is None else piece
    finally:  # the steps of the pieces not chosen are not kept
      for key in [key for key in self._whole_compiled if key[1]]:
        del self._whole_compiled[key]

  def chunks(self, request, error: Optional[ValueError]) -> MicroBatchPlan:
    """The batch's data does not fit beside its step (``error``: the unstreamed search's, if it ran): stream it
    from the host in chunks, the chunk size :class:`ChunkSearch`'s; the chunks' plan."""
    batch_size = request.layout.batch_size
    search = self._search(request, (False, True) if self.remat == 'auto' else (None,))
    key = self.cached.key(request.batch, False, modelled=request.step_time is not None, streamed=True)
    need = None
    with values_restored(self.model.variables(), any_shape=True):  # resets draw random numbers: all put back
      chunk = self.cached.chunk(key, batch_size, search.micro_batch_of)
      if chunk is None:
        chunk = best_chunk(batch_size, search.micro_batch_of, can_hold=search.can_hold, first=search.guessed())
        if chunk is not None:
          self.cached.store(key, {'stream_chunk': chunk})
        else:
          need = search.one_sample_need()
    if chunk is None:
      return self._not_streamed(request, error, need)
    return self._streamed_in(batch_size, chunk, search.unkept,
                             f'does not fit {self.budget.describe()} with its data on the device; streamed from '
                             f'the host in chunks of {chunk}')

  def _streamed_in(self, batch_size: int, chunk: int, unkept: Dict[int, Any], how: str) -> MicroBatchPlan:
    """Record that ``batch_size`` streams in chunks (pieces) of ``chunk`` (planned: its step kept from ``unkept``,
    which fit runs for them), and say ``how``; the chunk's plan."""
    self.stream_chunks[batch_size] = chunk
    if chunk in unkept:
      unkept[chunk].keep()
    plan, used = self.plans[chunk]
    tqdm.write(f'memory plan: batch {batch_size} {how} ({plan.describe()}, train step {format_memory(used)} of '
               f'{self.budget.describe()}), one update per batch')
    return plan

  def _not_streamed(self, request, error: Optional[ValueError], need: Optional[int]) -> MicroBatchPlan:
    """No chunk fits: the error that names what streaming one sample at a time needs (``need``), or the whole
    batch's own (planning it, where arithmetic skipped it)."""
    budget, batch_size = self.budget.bytes(), request.layout.batch_size
    if need is not None and need > budget and self.budget.from_device:
      raise self.budget.too_small(f'batch {batch_size}, even streamed from the host one sample at a time,', need)
    if need is not None and need > budget:  # the whole batch's error would name the need of the unstreamed step
      raise ValueError(f'{self.budget.named()} ({budget} bytes) is too small for batch {batch_size}: its step '
                       f'does not fit with its data on the device, and streamed from the host one sample at a '
                       f'time it needs about {format_memory(need)} ({need} bytes). Raise memory_budget to at '
                       f'least {need}' + (', or use remat=True.' if not self.remat else '.'))
    if error is None:  # skipped by arithmetic: the search itself gives the error that names the budget needed
      return self.plan_whole(request)
    raise error


def _scaled(whole: StepMemory, batch_size: int, states: int, data: int) -> Callable[[int], float]:
  """A piece's bytes as the whole batch's step (``whole``, of ``batch_size`` samples, whose ``data`` bytes are
  the batch and the batch sent ahead) predicts them: its fixed bytes less the data and the model state (the
  parameters, the optimizer's state: they do not shrink with the piece) kept, the rest in proportion to the
  piece's samples, and ``states`` (the batch's model state, which streaming keeps twice) beside.

  Examples
  --------
  >>> guess = _scaled(StepMemory(total=1100, fixed=300), batch_size=100, states=20, data=150)
  >>> guess(10), guess(50)  # 140 fixed bytes kept (300 - 150 - 20 / 2), 960 in proportion
  (256.0, 640.0)
  """
  kept = max(0, whole.fixed - data - states // 2)
  return lambda size: states + kept + (whole.total - kept) * size / batch_size


def _even_piece(batch_size: int, largest: int, sizes) -> int:
  """The piece size to stream a batch in, given the ``largest`` that fits: the largest of ``sizes`` not below
  three quarters of it that divides the batch (every piece the same program, none of a second size), else
  ``largest``.

  Examples
  --------
  >>> _even_piece(16384, 2432, [4096, 2816, 2432, 2048, 1920])
  2048
  >>> _even_piece(10000, 2432, [2816, 2432, 2048])
  2432
  """
  even = [size for size in sizes if 0.75 * largest <= size <= largest and batch_size % size == 0]
  return max(even, default=largest)


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
    """What streaming one sample at a time needs (a quick probe's figure, measured also where the fixed bytes
    alone exceed the budget: those are only part of it, and an error that named them as the budget to give led
    to a second error), or ``None`` if unknown."""
    chunk_data = self._chunk_of(1)
    fixed = self.model.fixed_bytes(*chunk_data)
    try:
      return max(fixed, min(memory_parts(self._probe(self._plan_of(1, 1, remat), self.shared_args, *chunk_data,
                                                     True))[0] for remat in self.options))
    except ValueError:
      return fixed if fixed > self.budget else None
