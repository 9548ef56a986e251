"""The memory planner: how a batch of each size is cut into micro-batches, within a memory budget.

:class:`Planner` owns what planning keeps: the budget (:class:`~brainpy_accum.memory._device.Budget`: given, or
the device's own), the plan of each batch size, the chunks of the batches streamed from the host, the
candidates weighed with ``remat='auto'``, the plans cut finer after running out of memory, and the plan cache.
What it compiles and times it receives as :class:`Compilers`, what it reads and resets of the model as
:class:`PlannedModel`: it knows nothing of a trainer, so it can be used and tested without one.

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
import os
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import jax
from tqdm import tqdm

from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._mesh import check_divisible
from ..core._states import values_restored
from ._budget import (StepMemory, TooSmall, candidate_micro_batch_sizes, choose_micro_batch_size, format_memory,
                      largest_fitting, memory_parts, state_bytes)
from ._cache import PlanCache
from ._chunks import ChunkSearch
from . import _device
from ._device import Budget, is_out_of_memory, refused_bytes
from ._fastest import Candidate, choose_fastest_plan, describe_choice, time_steps
from ._oom import finer_plan
from ._stream import best_chunk, chunk_candidates

__all__ = ['Compilers', 'PlannedModel', 'PlannedStep', 'Planner', 'plural']


class PlannedStep(NamedTuple):
  """A train step compiled for one plan, fully optimised, as :meth:`fit` would compile it."""
  memory: StepMemory        # its memory by XLA's analysis: what verifies that the plan fits
  run: Callable[[], Any]    # a trial of it that changes nothing (``remat='auto'``'s timing)
  keep: Callable[[], None]  # make fit run this very executable for the batch size (no second compilation)


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


def plural(count: int, noun: str) -> str:
  """``'1 micro-batch'``, ``'3 micro-batches'``."""
  return f'{count} {noun}' + ('' if count == 1 else 'es' if noun.endswith('ch') else 's')


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
    self.compilers = self._unmeasured._replace(step_bytes=self._measured(self._unmeasured.step_bytes, trial=False),
                                               trial=self._measured(self._unmeasured.trial, trial=True))
    self.budget_of, self.remat, self.devices, self.mesh_axis = budget, remat, devices, mesh_axis
    self.streams, self.whole_batch_loss, self.cache, self.key_of = streams, whole_batch_loss, cache, key_of
    self.memory_plans: Dict[int, Tuple[MicroBatchPlan, int]] = {}  # batch (or chunk) size -> (plan, bytes)
    self.stream_chunks: Dict[int, int] = {}  # batch sizes streamed from the host, and their chunk size
    self.piece_sizes: set = set()  # of those, the ones streamed in pieces by choice (their data fits the device)
    self.weighed_plans: Dict[int, List[Candidate]] = {}  # remat='auto': every candidate weighed, per share
    self.finer_plans: Dict[int, MicroBatchPlan] = {}  # batch sizes cut finer after running out of memory
    self._largest_micro: Dict[int, int] = {}  # batch (or chunk) size -> the largest micro-batch that fits
    self._through_window: set = set()  # sizes planned for their step through the window (a streamed chunk's)
    self._in_hand = 0  # bytes of the batch being planned that are on the device already (arguments of its step)
    self._beside: Dict[int, int] = {}  # piece size -> bytes held beside its step (the batch's model state, twice)

  # ------------------------------------------------------------------ the plan of a batch size

  @property
  def budget(self) -> Optional[int]:
    """The memory budget in bytes (``None`` without one); the device's is worked out at its first use."""
    return None if self.budget_of is None else self.budget_of.bytes(held=self._held)

  def _held(self) -> int:
    """Bytes the trainer's own Variables and the batch in hand hold on the device: the step's arguments,
    counted in its memory."""
    return self._in_hand + sum(int(v.value.nbytes) for v in self.model.variables() if isinstance(v.value, jax.Array))

  def recheck_budget(self, inputs: Any, targets: Any) -> bool:
    """At the start of each fit, with the device's own budget: other arrays put on the device since the plans
    were made (the user's own) leave less room, and a plan made under the old budget would overfill the device
    (its temporaries are reserved beside every array: the TPU runtime then evicts and reloads programs, slowly,
    or fails to load one). Plans whose step no longer fits are dropped, to be made again; returns whether any
    was (the steps traced with them must be traced again). ``inputs, targets``: the batch in hand, whose bytes on
    the device are the step's own."""
    self._in_hand = _device_bytes(inputs, targets)
    now = None if self.budget_of is None or not self.memory_plans else self.budget_of.recheck(held=self._held)
    stale = sorted(size for size, (_, used) in self.memory_plans.items()
                   if now is not None and used + self._beside.get(size, 0) > now)
    for size in stale:
      del self.memory_plans[size]
      self.finer_plans.pop(size, None)
      self._largest_micro.pop(size, None)
      self._through_window.discard(size)
      self.compilers.unkeep(size)
    for batch_size in [b for b, chunk in self.stream_chunks.items() if chunk in stale]:
      del self.stream_chunks[batch_size]
      self.piece_sizes.discard(batch_size)
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
    """Whether a batch of ``batch_size`` is streamed in chunks: one streamed because its data does not fit beside
    its step, always; one streamed in pieces by choice (a host batch sent ahead), not where its data is on the
    device already: its step then runs whole, in micro-batches of the pieces' size (:meth:`plan_for`)."""
    return batch_size in self.stream_chunks and not (on_device and batch_size in self.piece_sizes)

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
    limit = (self.budget_of or Budget(None)).bytes(held=self._held)
    share, need = self.share_size(layout.batch_size), refused_bytes(error, 0)
    measure = self._measured(self._unmeasured.step_bytes, trial=False, budget=lambda: limit)
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
    key = self._key(shared_args, inputs, targets, False)
    return key is not None and os.path.exists(self.cache.path(key))

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
    self._in_hand = _device_bytes(inputs, targets)
    if streams and batch_size > 1 and self.model.ahead_bytes(inputs, targets):
      pieces = self._pieces(request)  # a host batch sent ahead, not in one micro-batch: in pieces of one
      if pieces is not None:
        return pieces
    fixed = self.model.fixed_bytes(inputs, targets)
    if streams and batch_size > 1 and fixed > self.budget:
      # arithmetic, no compilation: the step's arguments and updated parameters alone exceed the budget,
      # so no cut of it fits
      return self._stream(request, None)
    self._check_whole_batch_fits(batch_size, fixed)
    try:
      with values_restored(self.model.variables(), any_shape=True):  # the reset draws random numbers: put back
        if self.mesh_axis is None:  # (on a mesh fit has placed the state, at the batch size, before planning)
          self.model.reset(batch_size)  # the search compiles the whole batch's step: the state at that size
        self._plan_batch(request, via_window=via_window)
    except ValueError as error:
      if not streams or batch_size == 1:
        raise
      return self._stream(request, error)
    return self.memory_plans[batch_size][0]

  def _check_whole_batch_fits(self, batch_size: int, fixed: int) -> None:
    """``whole_batch_loss=True`` keeps the whole batch on the device: refuse, by arithmetic, data that cannot fit."""
    budget = self.budget
    if self.whole_batch_loss and self.mesh_axis is None and fixed > budget and self.budget_of.from_device:
      raise self._device_too_small(f'batch {batch_size}, whose data, Variables and updated parameters '
                                   f'whole_batch_loss=True keeps on the device,', fixed)
    if self.whole_batch_loss and self.mesh_axis is None and fixed > budget:
      raise ValueError(f'{self.budget_of.named()} ({budget} bytes) is too small for batch {batch_size}: its '
                       f'data, the Variables and the updated parameters alone take at least {format_memory(fixed)} '
                       f'({fixed} bytes), and whole_batch_loss=True keeps the whole batch on the device (it is not '
                       f'streamed from the host in chunks). Raise memory_budget above {fixed}, or pass smaller '
                       f'batches.')

  def _device_too_small(self, what: str, need: int) -> ValueError:
    """The error of a batch that the device's own memory does not hold: there is no ``memory_budget`` to raise,
    so it names the other fixes."""
    share = '' if self.budget_of.value is None or self.budget_of.value.strip() == '100%' else (
      ", a larger share of the device (memory_budget='100%')")
    return ValueError(f'The train step of {what} needs {format_memory(need)} ({need} bytes), more than '
                      f'{self.budget_of.describe()}. Use remat=True, fewer time steps, smaller batches{share} or a '
                      f'device with more memory.')

  def _measured(self, compile_: Callable, trial: bool, budget: Optional[Callable[[], int]] = None) -> Callable:
    """``compile_`` (a quick probe, or with ``trial`` a compilation for training), with XLA's refusal of a
    program too large for the device taken as a measurement: the candidate does not fit, with the size the
    refusal names (at least ``budget()`` plus one; the planner's budget by default)."""

    def measured(plan, *batch):
      try:
        return compile_(plan, *batch)
      except Exception as error:  # noqa: BLE001 -- only the device's out-of-memory refusal is a measurement
        if not is_out_of_memory(error):
          raise
        memory = StepMemory(refused_bytes(error, (budget or (lambda: self.budget))() + 1), 0)
        return _refused(memory) if trial else memory

    return measured

  def _plan_batch(self, request: _Request, via_window: bool = False,
                  unkept: Optional[Dict[int, PlannedStep]] = None) -> None:
    """Plan one batch (or streamed chunk) whose step holds all of it; raises ``ValueError`` if none fits.

    The search probes a few sizes with quick compilations; the pick is then compiled as training runs it, and
    that compilation's memory analysis must fit the budget (else the pick is corrected downwards). Training
    runs that very executable: no second compilation (``unkept``, given, receives it instead, for the caller to
    keep: a streamed batch keeps only its chunk's).
    """
    batch_size, share = request.layout.batch_size, self.share_size(request.layout.batch_size)
    key = None if request.step_time is not None else self._key(*request.batch, via_window)
    if self._plan_from_cache(key, request, via_window, unkept):
      self._note_window(batch_size, via_window)
      return
    try:
      if self.remat == 'auto':
        size, used, remat, planned = self._plan_fastest(share, request, via_window)
      else:
        (size, used, planned), remat = self._plan_fewest(share, request, via_window), None
    except ValueError as error:
      if isinstance(error, TooSmall) and self.budget_of.from_device:  # no memory_budget to raise: other fixes
        error = self._device_too_small(f'batch {batch_size}, even at one sample per micro-batch,', error.need)
      if self.mesh_axis is None:
        self._store(key, {'fits': False, 'error': str(error)})
        raise error from None
      raise ValueError(f'{error} With the mesh, each of the {self.devices} devices holds {share} samples of the '
                       f'batch of {batch_size}, and memory_budget is per device.') from None
    # the largest micro-batch that fits (with remat='auto' the fastest plan may cut finer): how streaming ranks chunks
    largest = size if remat is None else max(c.micro_batch_size for c in self.weighed_plans[share] if c.fits)
    self._store(key, {'fits': True, 'micro_batch_size': size, 'remat': remat, 'bytes': used, 'largest': largest})
    self._largest_micro[batch_size] = largest
    self._set_plan(batch_size, plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat), used, planned,
                   unkept=unkept)
    self._note_window(batch_size, via_window)

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

  def _plan_fewest(self, share: int, request: _Request, via_window: bool) -> Tuple[int, int, Optional[PlannedStep]]:
    """``(micro_batch_size, bytes, compiled step or None)``: the fewest micro-batches whose step fits.

    Sizes the search predicts to be the answer are compiled as training runs them (when fit can run that
    executable), the others quickly; an answer measured quickly is compiled for training afterwards, and
    its memory must fit too, else the search goes on below it.
    """
    plan_of = lambda size: plan_micro_batches(share, micro_batch_size=size)
    keepable, kept, budget = request.compilers.keepable(via_window), {}, self.budget

    def probe(size):
      return request.compilers.step_bytes(plan_of(size), *request.batch, via_window)

    def compile_for_training(size):
      kept[size] = request.compilers.trial(plan_of(size), *request.batch, via_window)
      return kept[size].memory

    guess = None if request.compilers.guess(plan_of(share)) is None else (
      lambda size: request.compilers.guess(plan_of(size)))
    below = None
    while True:
      size, used = choose_micro_batch_size(share, budget, probe, below=below, guess=guess,
                                           measure_pick=compile_for_training if keepable else None)
      if not keepable:
        return size, used, None  # fit runs a step of its own (a window, a mesh): the probe's figure is XLA's measure
      planned = kept.get(size) or request.compilers.trial(plan_of(size), *request.batch, via_window)
      if planned.memory.total <= budget:
        return size, planned.memory.total, planned
      tqdm.write(f'memory plan: micro-batches of {size} need {format_memory(planned.memory.total)} compiled for '
                 f'training, not the {format_memory(used)} of the quick compilation; searching below')
      below = size

  def _plan_fastest(self, share: int, request: _Request, via_window: bool = False
                    ) -> Tuple[int, int, Union[bool, int], Optional[PlannedStep]]:
    """``remat='auto'``: ``(micro_batch_size, bytes, remat, compiled step)`` of the fastest plan that fits, its
    table printed.

    Only the largest fitting micro-batch of each remat option is weighed: those are the candidates that can
    win, since a finer cut of the same remat does the same work in more, smaller sequential steps. The
    search compiles the sizes it predicts to be the answer as training runs them, so the candidates timed are
    already compiled, their compilation's memory is the figure that must fit, and training runs the winner's
    executable.
    """
    compiled, budget = {}, self.budget
    plan_of = lambda size, remat: plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)

    def compile_(size, remat):
      if (size, remat) not in compiled:
        compiled[size, remat] = request.compilers.trial(plan_of(size, remat), *request.batch, via_window)
      return compiled[size, remat]

    probe = lambda size, remat: request.compilers.step_bytes(plan_of(size, remat), *request.batch, via_window)
    timed = functools.partial(self._timed, request, plan_of, compile_)
    guess = None if request.compilers.guess(plan_of(share, False)) is None else (
      lambda size, remat: request.compilers.guess(plan_of(size, remat)))
    chosen, weighed = choose_fastest_plan(share, budget, probe, timed, finer=0, guess=guess,
                                          measure_pick=lambda size, remat: compile_(size, remat).memory)
    if chosen.seconds == float('inf'):
      raise ValueError(f'{self.budget_of.named()}: no plan fits when compiled for training, although quick '
                       f'compilations said so. Raise memory_budget.')
    self.weighed_plans[share] = weighed
    tqdm.write(describe_choice(share, budget, chosen, weighed))
    planned = compiled.get((chosen.micro_batch_size, chosen.remat))
    if planned is None and request.compilers.keepable(via_window):  # measured by a quick probe: compile it for training
      planned = compile_(chosen.micro_batch_size, chosen.remat)
      if planned.memory.total > budget:
        raise ValueError(f'{self.budget_of.named()}: the chosen plan needs {format_memory(planned.memory.total)} '
                         f'compiled for training, although a quick compilation measured '
                         f'{format_memory(chosen.bytes)}. Raise memory_budget.')
    used = chosen.bytes if planned is None else planned.memory.total
    return chosen.micro_batch_size, used, chosen.remat, planned

  def _timed(self, request: _Request, plan_of: Callable, compile_: Callable, pairs) -> List[float]:
    """Seconds of a trial step of each ``(size, remat)`` of ``pairs`` (``step_time``'s, if given); a candidate
    that does not fit once compiled for training (the quick probe measured otherwise) is never chosen."""
    if request.step_time is not None:
      return request.step_time([plan_of(s, r) for s, r in pairs])
    steps = [compile_(*pair) for pair in pairs]
    fitting = [step for step in steps if step.memory.total <= self.budget]  # (a refused one is never run)
    request.compilers.before_timing()
    # two interleaved runs each, the faster kept: the first run of a new executable is the slow one (about
    # 20% on CPU), so this is the second's time, for one run less per candidate than a warm-up and two rounds
    seconds = iter(time_steps([step.run for step in fitting], rounds=2, warm_up=False, estimate=min))
    return [next(seconds) if step.memory.total <= self.budget else float('inf') for step in steps]

  # ------------------------------------------------------------------ streaming

  def plan_chunk(self, inputs: Any, targets: Any, shared_args: Optional[dict] = None) -> MicroBatchPlan:
    """The plan of a streamed batch's chunk: the shorter last one has a plan of its own, for its step through
    the window (the step fit runs for it, and keeps from planning)."""
    return self.plan(inputs, targets, shared_args, streams=False, via_window=True)

  def _fits_whole(self, request: _Request) -> bool:
    """Whether the batch's step fits in one micro-batch, with the whole next batch sent ahead (a quick probe)."""
    if self.model.fixed_bytes(request.inputs, request.targets) > self.budget:
      return False
    with values_restored(self.model.variables(), any_shape=True):
      self.model.reset(request.layout.batch_size)
      one = plan_micro_batches(request.layout.batch_size, num_micro_batch=1)._replace(
        remat=False if self.remat == 'auto' else None)
      return memory_parts(self.compilers.step_bytes(one, *request.batch, False))[0] <= self.budget

  def _pieces(self, request: _Request) -> Optional[MicroBatchPlan]:
    """A host batch on a device that data is sent to ahead, whose step does not fit in one micro-batch: streamed
    in pieces of one micro-batch each, each sent while the one before computes, so that the device holds the
    running step and one piece more, never the whole batch. The piece is the largest micro-batch (of the
    device's tile sizes, :func:`~brainpy_accum.memory._budget.candidate_micro_batch_sizes`) whose step through
    the window fits beside the next piece and the whole batch's model state, which streaming keeps twice
    (:class:`~brainpy_accum.memory._stream.StreamedStates`), within :data:`PIECE_FILL` of the budget where one
    does (room for the device's own allocations), and of those near it one that divides the batch
    (:func:`_even_piece`). The piece size goes in the plan cache, beside the pieces' own plans, so that a rerun
    skips the probe of the whole step and the search. ``None`` where the step fits in one micro-batch."""
    batch_size, budget = request.layout.batch_size, self.budget
    search = ChunkSearch(request.layout, request.batch, budget, self.compilers, self.model, remat_options=(None,),
                         plan_chunk=functools.partial(self._chunk_micro_batch, request))
    states = 2 * state_bytes(self.model.batched(batch_size), batch_size)  # (at the batch size: before a reset too)
    key = None if request.step_time is not None else self._key(*request.batch, False)
    key = None if key is None else dict(key, pieces=True)  # the choice of piece, beside the batch's own plans
    with values_restored(self.model.variables(), any_shape=True):  # resets draw random numbers: all put back
      piece = self._cached_piece(key, batch_size, search, states)
      if piece is None:
        if self._fits_whole(request):
          return None
        piece = self._largest_piece(request, search, states)
        if piece is not None:
          self._store(key, {'piece': piece})
    if piece is None:
      return self._stream(request, None)  # no piece of one micro-batch fits: chunks, or the error that says why
    self.piece_sizes.add(batch_size)
    self._beside[piece] = max(self._beside.get(piece, 0), states)  # what recheck_budget counts beside its step
    return self._streamed_in(batch_size, piece, search.unkept,
                             f'streamed from the host in pieces of {piece}, each sent to the device while the one '
                             f'before computes')

  def _largest_piece(self, request: _Request, search: ChunkSearch, states: int) -> Optional[int]:
    """The piece to stream a batch in (see :meth:`_pieces`), planned; ``None`` if no piece of one micro-batch fits
    beside the next piece and the batch's model state (``states`` bytes)."""
    batch_size, budget = request.layout.batch_size, self.budget
    measured: Dict[int, int] = {}

    def measure(size):  # the piece's step through the window, the next piece sent ahead, the batch's states
      if size not in measured:
        chunk_data = search.chunk_data(size)
        plan = plan_micro_batches(size, num_micro_batch=1)._replace(remat=False if self.remat == 'auto' else None)
        measured[size] = budget + 1 if chunk_data is None else states + memory_parts(
          self.compilers.step_bytes(plan, request.shared_args, *chunk_data, True))[0]
      return measured[size]

    sizes = [size for size in candidate_micro_batch_sizes(batch_size) if size < batch_size]
    roomy = min(budget, int(PIECE_FILL * budget) + states)  # room for the device's allocations, where it can
    found = largest_fitting(sizes, roomy, measure) or largest_fitting(sizes, budget, measure)
    piece = None if found is None else _even_piece(batch_size, found[0], sizes)
    return None if piece is None or search.micro_batch_of(piece) is None else piece

  def _stream(self, request: _Request, error: Optional[ValueError]) -> MicroBatchPlan:
    """The batch's data does not fit beside its step: stream it from the host in chunks (the chunk size:
    :class:`~brainpy_accum.memory._chunks.ChunkSearch`'s)."""
    batch_size, budget = request.layout.batch_size, self.budget
    search = ChunkSearch(request.layout, request.batch, budget, self.compilers, self.model,
                         remat_options=(False, True) if self.remat == 'auto' else (None,),
                         plan_chunk=functools.partial(self._chunk_micro_batch, request))
    key = None if request.step_time is not None else self._key(*request.batch, False)
    key = None if key is None else dict(key, streamed=True)  # the choice of chunk, beside the batch's own plans
    need = None
    with values_restored(self.model.variables(), any_shape=True):  # resets draw random numbers: all put back
      chunk = self._cached_chunk(key, batch_size, search.micro_batch_of)
      if chunk is None:
        chunk = best_chunk(batch_size, search.micro_batch_of, can_hold=search.can_hold, first=search.guessed())
        if chunk is not None:
          self._store(key, {'stream_chunk': chunk})
        else:
          need = search.one_sample_need()
    if chunk is None:
      return self._not_streamed(request, error, need)
    return self._streamed_in(batch_size, chunk, search.unkept,
                             f'does not fit {self.budget_of.describe()} with its data on the device; streamed from '
                             f'the host in chunks of {chunk}')

  def _streamed_in(self, batch_size: int, chunk: int, unkept: Dict[int, PlannedStep], how: str) -> MicroBatchPlan:
    """Record that ``batch_size`` streams in chunks (pieces) of ``chunk`` (planned: its step kept from ``unkept``,
    which fit runs for them), and say ``how``; the chunk's plan."""
    self.stream_chunks[batch_size] = chunk
    if chunk in unkept:
      unkept[chunk].keep()
    plan, used = self.memory_plans[chunk]
    tqdm.write(f'memory plan: batch {batch_size} {how} ({plan.describe()}, train step {format_memory(used)} of '
               f'{self.budget_of.describe()}), one update per batch')
    return plan

  def _not_streamed(self, request: _Request, error: Optional[ValueError], need: Optional[int]) -> MicroBatchPlan:
    """No chunk fits: the error that names what streaming one sample at a time needs (``need``), or the whole
    batch's own (planning it, where arithmetic skipped it)."""
    budget, batch_size = self.budget, request.layout.batch_size
    if need is not None and need > budget and self.budget_of.from_device:
      raise self._device_too_small(f'batch {batch_size}, even streamed from the host one sample at a time,', need)
    if need is not None and need > budget:  # the whole batch's error would name the need of the unstreamed step
      raise ValueError(f'{self.budget_of.named()} ({budget} bytes) is too small for batch {batch_size}: its step '
                       f'does not fit with its data on the device, and streamed from the host one sample at a '
                       f'time it needs about {format_memory(need)} ({need} bytes). Raise memory_budget to at '
                       f'least {need}' + (', or use remat=True.' if not self.remat else '.'))
    if error is None:  # skipped by arithmetic: the search itself gives the error that names the budget needed
      self._plan_batch(request)
      return self.memory_plans[batch_size][0]
    raise error

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

  # ------------------------------------------------------------------ the plan cache

  def _key(self, shared_args, inputs, targets, via_window: bool) -> Optional[dict]:
    """Everything a plan depends on, as JSON, or ``None`` where plans are not cached (no cache, a mesh)."""
    if self.cache is None or self.key_of is None or self.mesh_axis is not None:
      return None
    return self.key_of(shared_args, inputs, targets, via_window, self.budget)

  def _store(self, key: Optional[dict], plan: dict) -> None:
    if key is not None:
      self.cache.put(key, plan)

  def _plan_from_cache(self, key: Optional[dict], request: _Request, via_window: bool,
                       unkept: Optional[Dict[int, PlannedStep]] = None) -> bool:
    """Use the cached plan for ``key`` if there is one and its step, compiled again, still fits; True if used.

    A cached plan is never trusted: the step is compiled (for training where fit can run it, quickly
    otherwise) and must fit the budget by XLA's measure, else a one-line warning and planning anew. A cached
    'does not fit' (the same step measured by an earlier run) raises its error again, for streaming to go on.
    """
    entry = None if key is None else self.cache.get(key)
    if entry is None:
      return False
    if entry.get('fits') is False and isinstance(entry.get('error'), str):
      raise ValueError(entry['error'])
    batch_size = request.layout.batch_size
    plan = _cached_plan(entry, self.share_size(batch_size))
    if plan is None:
      warnings.warn(f'plan cache: ignored an entry for batch {batch_size} that does not describe a plan of it; '
                    f'planning anew.', UserWarning, stacklevel=2)
      return False
    if request.compilers.keepable(via_window):
      planned = request.compilers.trial(plan, *request.batch, via_window)
      used = planned.memory.total
    else:
      planned, used = None, memory_parts(request.compilers.step_bytes(plan, *request.batch, via_window))[0]
    if used > self.budget:
      warnings.warn(f'plan cache: the cached plan for batch {batch_size} ({plan.describe_cuts()}) needs '
                    f'{format_memory(used)} now, over {self.budget_of.describe()}; planning anew.', UserWarning,
                    stacklevel=2)
      return False
    self._largest_micro[batch_size] = max(plan.micro_batch_size, entry.get('largest', plan.micro_batch_size))
    self._set_plan(batch_size, plan, used, planned, cached=True, unkept=unkept)
    return True

  def _cached_piece(self, key: Optional[dict], batch_size: int, search: ChunkSearch, states: int) -> Optional[int]:
    """The piece size an earlier run chose to stream a batch in (:meth:`_pieces`), if the plan cache has it and
    the piece's step, planned again (from the cache too: compiled and measured), still runs in one micro-batch
    beside the next piece and the batch's model state (``states`` bytes); else ``None``."""
    entry = None if key is None else self.cache.get(key)
    if entry is None:
      return None
    piece = entry.get('piece')
    if (not isinstance(piece, int) or isinstance(piece, bool) or piece >= batch_size
            or piece not in candidate_micro_batch_sizes(batch_size)):
      warnings.warn(f'plan cache: ignored an entry for batch {batch_size} streamed in pieces that does not name a '
                    f'piece size of it; planning anew.', UserWarning, stacklevel=2)
      return None
    if search.micro_batch_of(piece) is None or self.memory_plans[piece][0].num_micro_batches != 1 or (
            self.memory_plans[piece][1] + states > self.budget):
      warnings.warn(f'plan cache: the cached piece size {piece} for batch {batch_size} does not fit '
                    f'{self.budget_of.describe()} now; planning anew.', UserWarning, stacklevel=2)
      return None
    return piece

  def _cached_chunk(self, key: Optional[dict], batch_size: int, micro_batch_of: Callable[[int], Optional[int]]
                    ) -> Optional[int]:
    """The chunk size an earlier run chose to stream a batch in, if the plan cache has it and its step still
    fits (``micro_batch_of`` plans it: from the cache too, its step compiled again and measured); else ``None``."""
    entry = None if key is None else self.cache.get(key)
    if entry is None:
      return None
    chunk = entry.get('stream_chunk')
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk not in chunk_candidates(batch_size):
      warnings.warn(f'plan cache: ignored an entry for streaming batch {batch_size} that does not name a chunk '
                    f'size of it; planning anew.', UserWarning, stacklevel=2)
      return None
    if micro_batch_of(chunk) is None:
      warnings.warn(f'plan cache: the cached chunk size {chunk} for streaming batch {batch_size} does not fit '
                    f'{self.budget_of.describe()} now; planning anew.', UserWarning, stacklevel=2)
      return None
    return chunk


def _cached_plan(entry: dict, share: int) -> Optional[MicroBatchPlan]:
  """The plan a plan-cache entry describes for a share of ``share`` samples, or ``None`` if it describes none."""
  size, remat = entry.get('micro_batch_size'), entry.get('remat')
  largest = entry.get('largest', size)
  if not (isinstance(size, int) and 1 <= size <= share and (remat is None or isinstance(remat, (bool, int)))
          and isinstance(largest, int) and 1 <= largest <= share):
    return None
  return plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)


# A batch streamed in pieces is cut so that a piece's step (with the next piece sent ahead) takes at most this share
# of the budget where a smaller piece allows it: the rest is room for the device's own allocations beside it. On a
# TPU v5e (the benchmark's spiking network, 14.9 GiB budget) pieces whose step took 65% of the budget trained at
# 0.93 of bp.BPTT's speed on device data, pieces at 89% and 93% at 0.81 and 0.57 (allocations beside a nearly full
# device stall there).
PIECE_FILL = 0.75


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


def _device_bytes(inputs, targets) -> int:
  """Bytes of a batch's leaves that are on a device already (JAX arrays)."""
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves((inputs, targets)) if isinstance(x, jax.Array))


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


def _refused(memory: StepMemory) -> PlannedStep:
  """A step XLA refused to compile for the device: its memory (over the budget), never run, never kept."""

  def run():
    raise RuntimeError('A step that does not fit the device is never run.')

  return PlannedStep(memory, run, lambda: None)
