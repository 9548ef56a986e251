"""The memory planner: how a batch of each size is cut into micro-batches, within a memory budget.

:class:`Planner` owns the plan of each batch size, the candidates weighed with ``remat='auto'`` and the plans cut
finer after running out of memory, and composes three objects that own the rest: the budget and its re-check at
every fit (:class:`~brainpy_accum.memory._device.PlanBudget`), the plan cache's dialogue
(:class:`~brainpy_accum.memory._cache.CachedPlans`), and which batches stream from the host, in pieces or chunks
(:class:`~brainpy_accum.memory._chunks.Streaming`). What it compiles and times it receives as :class:`Compilers`,
what it reads and resets of the model as :class:`PlannedModel`: it knows nothing of a trainer, so it can be used
and tested without one.

How a batch's plan is found (``num_micro_batch='auto'``): a plan cached by an earlier run is compiled again and
used if it still fits; else the fewest micro-batches whose compiled step fits the budget are searched with a
few quick compilations (:func:`~brainpy_accum.memory._budget.choose_micro_batch_size`), or with ``remat='auto'``
the fastest fitting (micro-batches, remat) plan by trial steps (:mod:`~brainpy_accum.memory._fastest`), and the
pick is compiled as training runs it and must fit by that compilation's measure. A batch whose data does not
fit beside its step is streamed in chunks (:mod:`~brainpy_accum.memory._chunks`). A compilation that XLA
refuses for memory (a GPU or TPU refuses a program larger than the device) is a measurement that the
candidate does not fit, never an error.
"""

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from tqdm import tqdm

from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._mesh import check_divisible
from ..core._states import values_restored
from ._budget import (PlannedStep, StepMemory, TooSmall, choose_micro_batch_size, first_probe_trains,
                      fewest_fitting, format_memory, memory_parts, plural)
from ._cache import CachedPlans, PlanCache
from ._chunks import Streaming
from . import _device
from ._device import Budget, PlanBudget, refusal_measured, refused_bytes
from ._fastest import Candidate, fastest_fitting
from ._oom import finer_plan

__all__ = ['Compilers', 'PlannedModel', 'Planner']


class Compilers(NamedTuple):
  """What planning compiles and times, given by whoever trains.

  ``step_bytes(plan, shared_args, inputs, targets, via_window) -> StepMemory`` of the train step compiled for
  ``plan`` quickly (XLA's buffer assignment is that of the optimised step; only the code is left unoptimised):
  the probes of the search; ``trial(plan, shared_args, inputs, targets, via_window) -> PlannedStep``: that step
  compiled for training, to verify, time and keep; ``keepable(via_window)``: whether fit can run a kept step
  (not where it runs another: a window's, a mesh's, or no jit); ``bytes_at_least(plan, shared_args, inputs,
  targets, via_window) -> int``: a lower bound of that step's memory from its trace alone (no compilation);
  ``guess(plan) -> float or None``: that step's bytes predicted from other measurements (a streamed batch's
  chunks), where the search for a plan starts; never trusted (``None``: no guess); ``unkeep(batch_size)``:
  forget the step kept for ``batch_size`` (its plan is made again); ``before_timing()``: called before trial
  steps are timed (work running beside planning finishes first).
  """
  step_bytes: Callable[..., Any]
  trial: Callable[..., PlannedStep]
  keepable: Callable[[bool], bool]
  bytes_at_least: Callable[..., int]
  guess: Callable[[MicroBatchPlan], Optional[float]] = lambda plan: None
  unkeep: Callable[[int], None] = lambda batch_size: None
  before_timing: Callable[[], None] = lambda: None


class PlannedModel(NamedTuple):
  """What planning reads and changes of the trained model: ``check_batch(inputs, targets) -> BatchLayout``
  (raises before anything changes); ``variables()``: every Variable a step reads or writes, random states
  included (planning puts them back as they were); ``reset(batch_size)``: the model's state at that size;
  ``batched(batch_size)``: its states that hold the batch, ``{name: (Variable, axis)}``;
  ``fixed_bytes(inputs, targets)``: a lower bound of the step's memory that does not shrink with the
  micro-batch (its arguments and the outputs every update writes), known without compiling;
  ``ahead_bytes(inputs, targets)``: what the device holds beside the step of this batch (or chunk): the next
  one, sent while it runs (0 where nothing is sent ahead)."""
  check_batch: Callable[[Any, Any], Any]
  variables: Callable[[], list]
  reset: Callable[[int], None]
  batched: Callable[[int], dict]
  fixed_bytes: Callable[[Any, Any], int]
  ahead_bytes: Callable[[Any, Any], int] = lambda inputs, targets: 0


class _Request(NamedTuple):
  """One batch to plan: its layout and data, the shared arguments, ``step_time`` (timing by a model) and the
  ``compilers`` to plan it with (a streamed batch's chunks share their probes and guesses)."""
  layout: Any
  shared_args: Any
  inputs: Any
  targets: Any
  step_time: Optional[Callable]
  compilers: Compilers

  @property
  def batch(self) -> tuple:
    return self.shared_args, self.inputs, self.targets


class Planner:
  """How a batch of each size is cut into micro-batches, and, with ``num_micro_batch='auto'``, planned within a
  memory budget.

  Parameters
  ----------
  model : PlannedModel
    What planning reads and resets of the model.
  compilers : Compilers
    What planning compiles and times.
  num_micro_batch, micro_batch_size : int or 'auto', optional
    The cut: a fixed one, or ``num_micro_batch='auto'`` to plan each batch size within ``budget``.
  budget : Budget, optional
    The memory budget (with ``'auto'``).
  remat : bool, int or 'auto'
    ``'auto'``: choose remat with the micro-batches, the fastest plan that fits.
  devices : int
    Devices a batch is split over (a mesh's batch axis); plans cut one device's share.
  mesh_axis : str, optional
    The mesh's batch axis (``None``: no mesh).
  streams : bool
    Whether a batch whose data does not fit may be streamed from the host in chunks.
  whole_batch_loss : bool
    Whether the step keeps the whole batch's outputs (never streamed).
  cache : PlanCache, optional
    The plans of earlier runs, by ``key_of(shared_args, inputs, targets, via_window, budget)``.
  key_of : callable, optional
    The plan cache's key of a batch.

  It composes three objects, each of which owns its part: ``budget_of``, the budget as planning checks it
  (:class:`~brainpy_accum.memory._device.PlanBudget`); ``cached``, the plan cache's dialogue
  (:class:`~brainpy_accum.memory._cache.CachedPlans`); ``streaming``, which batches stream from the host and in
  what size (:class:`~brainpy_accum.memory._chunks.Streaming`, whose chunks this planner plans).

  Examples
  --------
  The plan of a batch of 64 samples whose step needs ``1000 + 50 * micro_batch_size`` bytes, within 2,000
  bytes (a stand-in for XLA's measure of the compiled step):

  >>> import numpy as np
  >>> from brainpy_accum.core import plan_micro_batches
  >>> from brainpy_accum.memory._budget import StepMemory
  >>> from brainpy_accum.memory._device import Budget
  >>> from brainpy_accum.memory._planner import Compilers, PlannedModel, Planner
  >>> class Layout:
  ...   batch_size = 64
  >>> model = PlannedModel(check_batch=lambda x, y: Layout(), variables=lambda: [], reset=lambda n: None,
  ...                      batched=lambda n: {}, fixed_bytes=lambda x, y: 1000)
  >>> measure = lambda plan, *batch: StepMemory(1000 + 50 * plan.micro_batch_size, 1000)
  >>> planner = Planner(model, Compilers(measure, None, keepable=lambda via_window: False,
  ...                                    bytes_at_least=lambda *args: 0),
  ...                   num_micro_batch='auto', budget=Budget(2000))
  >>> planner.plan(np.zeros((64, 3)), np.zeros(64))  # doctest: +ELLIPSIS
  memory plan: batch 64 = 4 x 16 (4 micro-batches), train step 1.8 KiB of memory_budget 2.0 KiB
  MicroBatchPlan(batch_size=64, micro_batch_size=16, ...)
  """

  def __init__(self, model: PlannedModel, compilers: Compilers, *, num_micro_batch: Union[int, str, None] = 1,
               micro_batch_size: Optional[int] = None, budget: Optional[Budget] = None,
               remat: Union[bool, int, str] = False, devices: int = 1, mesh_axis: Optional[str] = None,
               streams: bool = False, whole_batch_loss: bool = False, cache: Optional[PlanCache] = None,
               key_of: Optional[Callable[..., dict]] = None):
    self.num_micro_batch, self.micro_batch_size = num_micro_batch, micro_batch_size
    # what the device holds beside a step (the next batch, sent ahead) counts in its memory: in every figure
    self.model = model._replace(fixed_bytes=_with_ahead(model.fixed_bytes, model.ahead_bytes, at=0))
    ahead = functools.partial(_with_ahead, ahead_bytes=model.ahead_bytes, at=2)
    self._unmeasured = compilers._replace(step_bytes=ahead(compilers.step_bytes), trial=ahead(compilers.trial),
                                          bytes_at_least=ahead(compilers.bytes_at_least))
    self.budget_of = PlanBudget(budget, self.model.variables)
    self.compilers = self._unmeasured._replace(
      step_bytes=refusal_measured(self._unmeasured.step_bytes, self.budget_of.bytes, trial=False),
      trial=refusal_measured(self._unmeasured.trial, self.budget_of.bytes, trial=True))
    self.remat, self.devices, self.mesh_axis = remat, devices, mesh_axis
    self.streams, self.whole_batch_loss = streams, whole_batch_loss
    self.memory_plans: Dict[int, Tuple[MicroBatchPlan, int]] = {}  # batch (or chunk) size -> (plan, bytes)
    self.weighed_plans: Dict[int, List[Candidate]] = {}  # remat='auto': every candidate weighed, per share
    self.finer_plans: Dict[int, MicroBatchPlan] = {}  # batch sizes cut finer after running out of memory
    self._largest_micro: Dict[int, int] = {}  # batch (or chunk) size -> the largest micro-batch that fits
    self._through_window: set = set()  # sizes planned for their step through the window (a streamed chunk's)
    # the cache's key names no mesh: the plans of one device's share on a mesh are not cached
    self.cached = CachedPlans(cache if mesh_axis is None else None, key_of, self.budget_of)
    # a streamed batch's chunks are planned here, as batches whose step passes through the window
    self.streaming = Streaming(self.model, self.budget_of, self.cached, remat=remat, plans=self.memory_plans,
                               plan_chunk=self._chunk_micro_batch, plan_whole=self._plan_whole)

  # ------------------------------------------------------------------ the plan of a batch size

  @property
  def budget(self) -> Optional[int]:
    """The memory budget in bytes (``None`` without one); the device's is worked out at its first use."""
    return self.budget_of.bytes()

  @property
  def stream_chunks(self) -> Dict[int, int]:
    """Batch sizes streamed from the host, and their chunk (or piece) size."""
    return self.streaming.stream_chunks

  @property
  def piece_sizes(self) -> set:
    """Of the batch sizes streamed, those streamed in pieces by choice (their data fits the device)."""
    return self.streaming.piece_sizes

  def recheck_budget(self, inputs: Any, targets: Any) -> bool:
    """At the start of each fit, with the device's own budget: plans whose step no longer fits the budget (other
    arrays took room on the device since they were made: :meth:`PlanBudget.stale`) are dropped, to be made
    again; returns whether any was (the steps traced with them must be traced again). ``inputs, targets``: the
    batch in hand, whose bytes on the device are the step's own."""
    stale = self.budget_of.stale(inputs, targets, {size: used for size, (_, used) in self.memory_plans.items()})
    for size in stale:
      del self.memory_plans[size]
      self.finer_plans.pop(size, None)
      self._largest_micro.pop(size, None)
      self._through_window.discard(size)
      self.compilers.unkeep(size)
    self.streaming.drop(stale)
    if stale:
      tqdm.write(f'memory plan: {self.budget_of.describe()} now, less than when batch sizes {stale} were planned '
                 f'(other arrays took room on the device since): planning them again')
    return bool(stale)

  def share_size(self, batch_size: int) -> int:
    """Samples each device holds of a batch of ``batch_size``."""
    return batch_size if self.mesh_axis is None else check_divisible(batch_size, self.devices, self.mesh_axis)

  def plan_for(self, batch_size: int) -> MicroBatchPlan:
    """The micro-batches a batch of ``batch_size`` samples is cut into (of each device's share, on a mesh);
    with ``'auto'`` the batch size must have been planned (:meth:`plan`)."""
    if batch_size in self.finer_plans:
      return self.finer_plans[batch_size]
    if batch_size in self.stream_chunks:  # streamed: the whole batch in micro-batches of its chunks' size
      chunk = self.plan_for(self.stream_chunks[batch_size])
      return plan_micro_batches(self.share_size(batch_size), micro_batch_size=chunk.micro_batch_size)._replace(
        remat=chunk.remat)
    if self.num_micro_batch != 'auto':
      return plan_micro_batches(self.share_size(batch_size), num_micro_batch=self.num_micro_batch,
                                micro_batch_size=self.micro_batch_size)
    if batch_size not in self.memory_plans:
      raise ValueError(f'No micro-batch plan for {batch_size=} yet under {self.budget_of.named()}: call '
                       f'trainer.plan_memory(inputs, targets) with a batch of that size first (fit does this itself).')
    return self.memory_plans[batch_size][0]

  def is_streamed(self, batch_size: int, on_device: bool = False) -> bool:
    """Whether a batch of ``batch_size`` is streamed in chunks (:meth:`Streaming.is_streamed`); where it is not,
    its step runs whole, in micro-batches of the pieces' size (:meth:`plan_for`)."""
    return self.streaming.is_streamed(batch_size, on_device)

  def known_plan(self, batch_size: int) -> Optional[MicroBatchPlan]:
    """The plan of ``batch_size`` if it has one already (cut finer, or planned), else ``None``."""
    return self.finer_plans.get(batch_size) or self.memory_plans.get(batch_size, (None,))[0]

  def describe(self, batch_size: int) -> str:
    """How a batch of ``batch_size`` samples is cut, as the report line shows it."""
    plan = self.plan_for(batch_size)
    if self.mesh_axis is None:
      return plan.describe()
    return f'batch {batch_size} = {self.devices} devices x ({plan.describe_cuts()})'

  def finer(self, batch_size: int) -> str:
    """After the device ran out of memory: twice the micro-batches for ``batch_size``; says what changed."""
    before, plan = self.describe(batch_size), self.plan_for(batch_size)
    self.finer_plans[batch_size] = finer_plan(plan)._replace(remat=plan.remat)
    return f'{before} now runs as {self.describe(batch_size)}'

  def refusal(self, error: BaseException, inputs, targets, shared_args=None) -> MemoryError:
    """The error for a fixed cut whose train step the device refused to compile (nothing ran, nothing changed):
    the step's size by the refusal, the device's limit, and the fewest micro-batches whose step fits the device
    (quick compilations), else ``'auto'``."""
    layout = self.model.check_batch(inputs, targets)
    plan, memory = self.plan_for(layout.batch_size), _device.device_memory()
    limit = self.budget_of.bytes_or_device()
    share, need = self.share_size(layout.batch_size), refused_bytes(error, 0)
    measure = refusal_measured(self._unmeasured.step_bytes, lambda: limit, trial=False)
    probe = lambda size: measure(plan_micro_batches(share, micro_batch_size=size)._replace(remat=plan.remat),
                                 shared_args, inputs, targets, False)
    option = 'num_micro_batch' if self.micro_batch_size is None else 'micro_batch_size'
    try:
      size, used = choose_micro_batch_size(share, limit, probe, below=plan.micro_batch_size)
      count = -(-share // size)
      fix = (f'{option}={count if option == "num_micro_batch" else size} fits ({plural(count, "micro-batch")} of '
             f'{size}, its step {format_memory(used)}), or pass')
    except ValueError:
      fix = 'not even one sample per micro-batch fits: use remat=True, a smaller model or fewer time steps, or pass'
    needs = f'at least {format_memory(need)}, more than' if need else 'more than'
    held = 'the device holds' if memory is None else f'the {format_memory(memory.limit)} of the {memory.kind} device'
    return MemoryError(f'The train step of {self.describe(layout.batch_size)} ({option}='
                       f'{getattr(self, option)!r}) does not fit the device: XLA refused to compile it, as it needs '
                       f'{needs} {held}; nothing was run or changed. {fix} num_micro_batch=\'auto\' to plan each '
                       f'batch size within the device\'s memory.')

  def is_cached(self, shared_args, inputs, targets) -> bool:
    """Whether the plan cache has a file for this batch's plan (not read: planning reads and checks it)."""
    return self.cached.is_cached((shared_args, inputs, targets))

  def probes_first(self, shared_args, inputs, targets) -> bool:
    """Whether planning this batch starts with quick probes, beside which other work can compile: not where its
    plan is cached, nor where the first candidate, the batch in one micro-batch, is compiled for training
    (:func:`~brainpy_accum.memory._budget.first_probe_trains`), which most often is the plan (on a TPU v5e,
    tracing the first-batch check before that search cost a small rate RNN 0.6 s of a 2.3 s first epoch, for a
    batch that ran whole: nothing to check)."""
    return not first_probe_trains(self.compilers) and not self.is_cached(shared_args, inputs, targets)

  # ------------------------------------------------------------------ planning

  def plan(self, inputs: Any, targets: Any, shared_args: Optional[dict] = None, *,
           step_time: Optional[Callable] = None, streams: Optional[bool] = None,
           via_window: bool = False) -> MicroBatchPlan:
    """Plan this batch's size (``num_micro_batch='auto'``), once: see the module's docstring.

    ``step_time(plans) -> seconds`` replaces ``remat='auto'``'s trial steps; ``streams``: whether the batch may
    be streamed (default: the planner's ``streams``); ``via_window``: the batch is a streamed batch's chunk,
    whose step passes through the window. Raises ``ValueError`` if not even one sample per micro-batch fits.
    """
    if self.num_micro_batch != 'auto':
      raise ValueError(f"plan_memory needs num_micro_batch='auto'; this trainer has "
                       f"num_micro_batch={self.num_micro_batch!r}, micro_batch_size={self.micro_batch_size!r}.")
    streams = self.streams if streams is None else streams
    layout = self.model.check_batch(inputs, targets)
    batch_size = layout.batch_size
    if batch_size in self.stream_chunks:
      return self.memory_plans[self.stream_chunks[batch_size]][0]
    if batch_size in self.memory_plans and not (via_window and self._plan_again_through_window(batch_size)):
      return self.memory_plans[batch_size][0]
    request = _Request(layout, shared_args, inputs, targets, step_time, self.compilers)
    self.budget_of.hold(inputs, targets)
    if streams and batch_size > 1 and self.model.ahead_bytes(inputs, targets):
      pieces = self.streaming.pieces(request)  # a host batch sent ahead, not in one micro-batch: in pieces of one
      if pieces is not None:
        return pieces
    fixed = self.model.fixed_bytes(inputs, targets)
    if streams and batch_size > 1 and fixed > self.budget:
      # arithmetic, no compilation: the step's arguments and updated parameters alone exceed the budget,
      # so no cut of it fits
      return self.streaming.chunks(request, None)
    self.budget_of.check_whole_batch(batch_size, fixed, kept_whole=self.whole_batch_loss and self.mesh_axis is None)
    try:
      with values_restored(self.model.variables(), any_shape=True):  # the reset draws random numbers: put back
        if self.mesh_axis is None:  # (on a mesh fit has placed the state, at the batch size, before planning)
          self.model.reset(batch_size)  # the search compiles the whole batch's step: the state at that size
        self._plan_batch(request, via_window=via_window)
    except ValueError as error:
      if not streams or batch_size == 1:
        raise
      return self.streaming.chunks(request, error)
    return self.memory_plans[batch_size][0]

  def _plan_batch(self, request: _Request, via_window: bool = False,
                  unkept: Optional[Dict[int, PlannedStep]] = None) -> None:
    """Plan one batch (or streamed chunk) whose step holds all of it; raises ``ValueError`` if none fits.

    The search probes a few sizes with quick compilations; the pick is then compiled as training runs it, and
    that compilation's memory analysis must fit the budget (else the pick is corrected downwards). Training
    runs that very executable: no second compilation (``unkept``, given, receives it instead, for the caller to
    keep: a streamed batch keeps only its chunk's).
    """
    batch_size, share = request.layout.batch_size, self.share_size(request.layout.batch_size)
    key = self.cached.key(request.batch, via_window, modelled=request.step_time is not None)
    whole = self.streaming.take_whole(batch_size, via_window)  # (compiled by the pieces' decision or search)
    whole_step = None if whole is None else whole[1]
    if self._plan_from_cache(key, request, via_window, unkept, whole):
      self._note_window(batch_size, via_window)
      return
    try:
      if self.remat == 'auto':
        size, used, remat, planned = fastest_fitting(share, self.budget, request.compilers, request.batch, via_window,
                                                     step_time=request.step_time, named=self.budget_of.named(),
                                                     weighed_plans=self.weighed_plans, whole=whole_step)
      else:
        (size, used, planned), remat = fewest_fitting(share, self.budget, request.compilers, request.batch,
                                                      via_window, whole_step), None
    except ValueError as error:
      if isinstance(error, TooSmall) and self.budget_of.from_device:  # no memory_budget to raise: other fixes
        error = self.budget_of.too_small(f'batch {batch_size}, even at one sample per micro-batch,', error.need)
      if self.mesh_axis is None:
        self.cached.store(key, {'fits': False, 'error': str(error)})
        raise error from None
      raise ValueError(f'{error} With the mesh, each of the {self.devices} devices holds {share} samples of the '
                       f'batch of {batch_size}, and memory_budget is per device.') from None
    # the largest micro-batch that fits (with remat='auto' the fastest plan may cut finer): how streaming ranks chunks
    largest = size if remat is None else max(c.micro_batch_size for c in self.weighed_plans[share] if c.fits)
    self.cached.store(key, {'fits': True, 'micro_batch_size': size, 'remat': remat, 'bytes': used, 'largest': largest})
    self._largest_micro[batch_size] = largest
    self._set_plan(batch_size, plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat), used, planned,
                   unkept=unkept)
    self._note_window(batch_size, via_window)

  def _plan_from_cache(self, key: Optional[dict], request: _Request, via_window: bool,
                       unkept: Optional[Dict[int, PlannedStep]] = None,
                       whole: Optional[Tuple[MicroBatchPlan, PlannedStep]] = None) -> bool:
    """Use the cached plan for ``key`` if there is one and its step, compiled again, still fits; True if used.

    A cached plan is never trusted: the step is compiled (for training where fit can run it, quickly
    otherwise) and must fit the budget by XLA's measure, else a one-line warning and planning anew. A cached
    'does not fit' (the same step measured by an earlier run) raises its error again, for streaming to go on.
    ``whole``: ``(plan, step)`` compiled for training already
    (:meth:`~brainpy_accum.memory._chunks.Streaming.take_whole`), used if it is the cached plan's.
    """
    batch_size = request.layout.batch_size
    cached = self.cached.plan(key, batch_size, self.share_size(batch_size))
    if cached is None:
      return False
    plan, largest = cached
    if request.compilers.keepable(via_window):
      planned = whole[1] if whole is not None and whole[0] == plan else request.compilers.trial(
        plan, *request.batch, via_window)
      used = planned.memory.total
    else:
      planned, used = None, memory_parts(request.compilers.step_bytes(plan, *request.batch, via_window))[0]
    if not self.cached.still_fits(plan, batch_size, used):
      return False
    self._largest_micro[batch_size] = largest
    self._set_plan(batch_size, plan, used, planned, cached=True, unkept=unkept)
    return True

  def _note_window(self, batch_size: int, via_window: bool) -> None:
    """Record that ``batch_size`` was planned for its step through the window, which needs more than the plain
    step (its sums): such a plan serves both."""
    if via_window:
      self._through_window.add(batch_size)

  def _plan_again_through_window(self, batch_size: int) -> bool:
    """Whether ``batch_size``, now a streamed chunk, must be planned (again) for its step through the window:
    a plan of the plain step, made for a batch of that size, does not say that the window's step fits. The
    plain step kept from that planning is dropped, so that fit runs the new plan's."""
    if batch_size in self.memory_plans and batch_size in self._through_window:
      return False
    self.compilers.unkeep(batch_size)
    return True

  def _set_plan(self, batch_size: int, plan: MicroBatchPlan, used: int, planned: Optional[PlannedStep],
                cached: bool = False, unkept: Optional[Dict[int, PlannedStep]] = None) -> None:
    """Record (and print) the plan of ``batch_size``; fit runs ``planned``, the step compiled for it, if given
    (unless ``unkept`` is given: then it is put there, for the caller to keep or not)."""
    self.memory_plans[batch_size] = (plan, used)
    if planned is not None and unkept is not None:
      unkept[batch_size] = planned
    elif planned is not None:
      planned.keep()
    source = ' (from the plan cache, its compiled step measured again)' if cached else ''
    per_device = '' if self.mesh_axis is None else ' per device'
    tqdm.write(f'memory plan: {self.describe(batch_size)} ({plural(plan.num_micro_batches, "micro-batch")}), '
               f'train step {format_memory(used)}{per_device} of {self.budget_of.describe()}{source}')

  # ------------------------------------------------------------------ the chunks that Streaming streams

  def plan_chunk(self, inputs: Any, targets: Any, shared_args: Optional[dict] = None) -> MicroBatchPlan:
    """The plan of a streamed batch's chunk: the shorter last one has a plan of its own, for its step through
    the window (the step fit runs for it, and keeps from planning)."""
    return self.plan(inputs, targets, shared_args, streams=False, via_window=True)

  def _plan_whole(self, request: _Request) -> MicroBatchPlan:
    """The plan of a batch no chunk of which fits, unstreamed: its search gives the error that names the budget
    needed (:meth:`Streaming.chunks`, where arithmetic skipped planning the whole batch)."""
    self._plan_batch(request)
    return self.memory_plans[request.layout.batch_size][0]

  def _chunk_micro_batch(self, request: _Request, chunk: int, chunk_data: Callable, compilers: Compilers,
                         unkept: Dict[int, PlannedStep]) -> Optional[int]:
    """The largest micro-batch whose step through the window fits a chunk of ``chunk`` samples of
    ``request``'s batch (planned now, with ``compilers``, if it was not for that step), ``None`` if none;
    ``chunk_data()``: ``(inputs, targets)`` of such a chunk, with the model's state at its size, or ``None``
    where its fixed bytes alone exceed the budget."""
    if self._plan_again_through_window(chunk):
      chunk_data = chunk_data()
      if chunk_data is None:
        return None
      try:
        layout = self.model.check_batch(*chunk_data)
        self._plan_batch(_Request(layout, request.shared_args, *chunk_data, request.step_time, compilers),
                         via_window=True, unkept=unkept)
      except ValueError:
        return None
    return self._largest_micro[chunk]


def _with_ahead(measure: Callable, ahead_bytes: Callable[[Any, Any], int], at: int) -> Callable:
  """``measure`` (giving bytes, a :class:`StepMemory` or a :class:`PlannedStep`) with the ``ahead_bytes`` of its
  batch added to fixed bytes and total alike; the batch's ``inputs, targets`` are its arguments ``at`` and
  ``at + 1``."""

  def measured(*args):
    extra, value = ahead_bytes(args[at], args[at + 1]), measure(*args)
    if not extra:
      return value
    if isinstance(value, PlannedStep):
      return value._replace(memory=StepMemory(value.memory.total + extra, value.memory.fixed + extra))
    if isinstance(value, StepMemory):
      return StepMemory(value.total + extra, value.fixed + extra)
    return value + extra

  return measured
