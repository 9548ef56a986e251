"""The trainer's plans per batch size: how a batch is cut, split over a mesh, and planned under a memory budget.

:class:`Planning` is a mixin of :class:`~brainpy_accum.AccumBPTT`: the public methods that say how a batch
of a given size runs (:meth:`~Planning.plan_for`, :meth:`~Planning.describe_batch`), and the private ones that
check a batch, choose micro-batches under a memory budget and re-plan after running out of memory. What it
compiles, times or rebuilds it receives as arguments (:class:`Compilers`, ``rebuild``, ``window``): it never
calls back into the trainer's steps.
"""

import functools
import os
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import brainpy.math as bm
import jax
import numpy as np
from brainpy import tools
from tqdm import tqdm

from ..core._batch import BatchLayout, batch_layout, is_array
from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._mesh import batch_spec, check_divisible, mesh_size, random_states
from ..core._states import batched_variables, declared_batch_axes, values_restored
from ..memory._budget import StepMemory, choose_micro_batch_size, format_memory, memory_parts
from ..memory._fastest import REMAT_OPTIONS, Candidate, choose_fastest_plan, describe_choice, time_steps
from ..memory._oom import finer_plan
from ..memory._stream import best_chunk, chunk_candidates, host_chunk, likely_chunk
from ._plan_key import plan_key
from ._target_axes import decide_target_axes, predict_shapes_of

__all__ = ['Compilers', 'PlannedStep', 'Planning', 'plural']


class PlannedStep(NamedTuple):
  """A train step compiled for one plan, fully optimised, as :meth:`fit` would compile it."""
  memory: StepMemory        # its memory by XLA's analysis: what verifies that the plan fits
  run: Callable[[], Any]    # a trial of it that changes nothing (``remat='auto'``'s timing)
  keep: Callable[[], None]  # make fit run this very executable for the batch size (no second compilation)


class Compilers(NamedTuple):
  """What planning compiles and times, given by the trainer.

  ``step_bytes(plan, shared_args, inputs, targets, via_window) -> StepMemory`` of the train step compiled for
  ``plan`` quickly (XLA's buffer assignment is that of the optimised step; only the code is left unoptimised):
  the probes of the search; ``trial(plan, shared_args, inputs, targets, via_window) -> PlannedStep``: that step
  compiled for training, to verify, time and keep; ``keepable(via_window)``: whether fit can run a kept step
  (not where it runs another: a window's, a mesh's, or no jit); ``bytes_at_least(plan, shared_args, inputs,
  targets, via_window) -> int``: a lower bound of that step's memory from its trace alone (no compilation);
  ``guess(plan) -> float or None``: that step's bytes predicted from other measurements (a streamed batch's
  chunks), where the search for a plan starts; never trusted (``None``: no guess).
  """
  step_bytes: Callable[..., Any]
  trial: Callable[..., PlannedStep]
  keepable: Callable[[bool], bool]
  bytes_at_least: Callable[..., int]
  guess: Callable[[MicroBatchPlan], Optional[float]] = lambda plan: None


def plural(count: int, noun: str) -> str:
  """``'1 micro-batch'``, ``'3 micro-batches'``."""
  return f'{count} {noun}' + ('' if count == 1 else 'es' if noun.endswith('ch') else 's')


class Planning:
  """How :class:`~brainpy_accum.AccumBPTT` cuts a batch of each size and plans it under a memory budget (a mixin)."""

  def plan_for(self, batch_size: int) -> MicroBatchPlan:
    """The micro-batches that a batch of ``batch_size`` samples is cut into.

    With ``num_micro_batch='auto'`` the batch size must have been planned
    (:meth:`plan_memory`, which :meth:`fit` calls on each new batch size).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> AccumBPTT(model, 'mean_squared_error', num_micro_batch=4).plan_for(10).sizes
    (3, 3, 3, 1)
    """
    if batch_size in self._finer_plans:
      return self._finer_plans[batch_size]
    if self.num_micro_batch != 'auto':
      return plan_micro_batches(self._share_size(batch_size), num_micro_batch=self.num_micro_batch,
                                micro_batch_size=self.micro_batch_size)
    if batch_size not in self.memory_plans:
      raise ValueError(f'No micro-batch plan for {batch_size=} yet under memory_budget='
                       f'{format_memory(self.memory_budget)}: call trainer.plan_memory(inputs, targets) '
                       f'with a batch of that size first (fit does this itself).')
    return self.memory_plans[batch_size][0]


  @property
  def _finer_plans(self) -> Dict[int, MicroBatchPlan]:
    """The batch sizes re-planned after running out of device memory (:meth:`_replan_finer`), and their plans."""
    return self.__dict__.setdefault('_finer_plans_by_size', {})

  def _replan_finer(self, batch_size: int, rebuild: Callable[[], None]) -> str:
    """After the device ran out of memory: twice the micro-batches for ``batch_size``; ``rebuild()`` makes the
    steps trace anew."""
    before, plan = self.describe_batch(batch_size), self.plan_for(batch_size)
    self._finer_plans[batch_size] = finer_plan(plan)._replace(remat=plan.remat)
    rebuild()
    return f'{before} now runs as {self.describe_batch(batch_size)}'

  def num_micro_batch_for(self, batch_size: int) -> int:
    """How many micro-batches a batch of ``batch_size`` samples runs in.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> AccumBPTT(model, 'mean_squared_error', micro_batch_size=4).num_micro_batch_for(10)
    3
    """
    return self.plan_for(batch_size).num_micro_batches

  @property
  def num_devices(self) -> int:
    """Devices a batch is split over: the size of the mesh's batch axis (1 without a mesh)."""
    return 1 if self.mesh is None else mesh_size(self.mesh, self.mesh_axis)

  def _share_size(self, batch_size: int) -> int:
    """Samples each device holds of a batch of ``batch_size``."""
    return batch_size if self.mesh is None else check_divisible(batch_size, self.num_devices, self.mesh_axis)

  def _split_variables(self, window, batch_size: Optional[int] = None):
    """``(Variable, partition)`` of every Variable split over the mesh: model states along their batch axis
    and the rows of ``window`` (the ``accumulate_steps`` window, or ``None``) one per device. All others are replicated."""
    axis = self.mesh_axis
    split = [(var, batch_spec(state_axis, axis)) for var, state_axis in batched_variables(self.target, batch_size).values()]
    if window is not None:
      split += [(var, batch_spec(0, axis)) for var in window.variables().values()]
    return split

  def describe_batch(self, batch_size: int) -> str:
    """How a batch of ``batch_size`` samples is cut, as the report line shows it.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> AccumBPTT(model, 'mean_squared_error', num_micro_batch=4).describe_batch(10)
    'batch 10 = 3 x 3 + 1'
    """
    plan = self.plan_for(batch_size)
    if self.mesh is None:
      return plan.describe()
    return f'batch {batch_size} = {self.num_devices} devices x ({plan.describe_cuts()})'

  def _plan_memory(self, inputs: Any, targets: Any, shared_args: Optional[Dict], step_time: Optional[Callable],
                   compilers: Compilers, may_stream: bool, via_window: bool = False) -> MicroBatchPlan:
    """:meth:`~brainpy_accum.AccumBPTT.plan_memory`, compiling and timing with ``compilers``; ``may_stream``:
    a batch whose data does not fit may be streamed from the host; ``via_window``: the batch is a streamed
    batch's shorter last chunk, whose step passes through the window."""
    if self.num_micro_batch != 'auto':
      raise ValueError(f"plan_memory needs num_micro_batch='auto'; this trainer has "
                       f"num_micro_batch={self.num_micro_batch!r}, micro_batch_size={self.micro_batch_size!r}.")
    layout = self._check_batch(inputs, targets)
    batch_size = layout.batch_size
    if batch_size in self.stream_chunks:
      return self.memory_plans[self.stream_chunks[batch_size]][0]
    if batch_size not in self.memory_plans or (via_window and self._plan_again_through_window(batch_size)):
      fixed = self._fixed_bytes_at_least(inputs, targets)
      if may_stream and batch_size > 1 and fixed > self.memory_budget:
        # arithmetic, no compilation: the step's arguments and updated parameters alone exceed the budget,
        # so no cut of it fits
        return self._plan_stream(layout, shared_args, inputs, targets, step_time, compilers, None)
      if self.whole_batch_loss and self.mesh is None and fixed > self.memory_budget:
        raise ValueError(f'memory_budget={format_memory(self.memory_budget)} ({self.memory_budget} bytes) is too '
                         f'small for batch {batch_size}: its data, the Variables and the updated parameters alone '
                         f'take at least {format_memory(fixed)} ({fixed} bytes), and whole_batch_loss=True keeps the '
                         f'whole batch on the device (it is not streamed from the host in chunks). Raise '
                         f'memory_budget above {fixed}, or pass smaller batches.')
      variables = list(self.vars().unique().values()) + random_states(self.target)
      try:
        with values_restored(variables, any_shape=True):  # the reset draws random numbers: all is put back
          if self.mesh is None:  # (on a mesh fit has placed the state, at the batch size, before planning)
            self.target.reset(batch_size)  # the search compiles the whole batch's step: the state at that size
          self._plan_batch(layout, shared_args, inputs, targets, step_time, compilers, via_window=via_window)
      except ValueError as error:
        if not may_stream or batch_size == 1:
          raise
        return self._plan_stream(layout, shared_args, inputs, targets, step_time, compilers, error)
    return self.memory_plans[batch_size][0]

  def _argument_bytes(self, inputs, targets) -> int:
    """Bytes of what the train step takes: every Variable (parameters, optimizer and model state), random
    keys and the batch. A lower bound of the compiled step's memory, known without compiling."""
    variables = {id(v): v for v in list(self.vars().unique().values()) + random_states(self.target)}
    leaves = [v.value for v in variables.values()] + jax.tree_util.tree_leaves((inputs, targets))
    return sum(int(getattr(x, 'nbytes', 0)) for x in leaves)  # typed random keys: the bytes of their data

  def _fixed_bytes_at_least(self, inputs, targets) -> int:
    """A lower bound of the fixed part of the train step's memory (:class:`StepMemory`'s ``fixed``), known
    without compiling: its arguments (:meth:`_argument_bytes`) and the outputs that every update writes anew,
    the trained parameters and the optimizer's state shaped like them (its moments). No argument is donated,
    so no output shares an argument's buffer; whatever else the step writes only adds to the figure."""
    kind = lambda var: (np.shape(var.value), bm.as_jax(var.value).dtype)
    params = list(self.target.train_vars().unique().values())
    shapes = {kind(v) for v in params}
    moments = [v for v in self.optimizer.vars().unique().values() if kind(v) in shapes]
    written = {id(v): v for v in params + moments}
    return self._argument_bytes(inputs, targets) + sum(int(bm.as_jax(v.value).nbytes) for v in written.values())

  def _plan_batch(self, layout, shared_args, inputs, targets, step_time, compilers: Compilers,
                  via_window: bool = False, unkept: Optional[Dict[int, PlannedStep]] = None) -> None:
    """Plan one batch (or streamed chunk) whose step holds all of it; raises ``ValueError`` if none fits.

    The search probes a few sizes with quick compilations (:func:`~brainpy_accum.memory._budget.largest_fitting`);
    the pick is then compiled as training runs it, and that compilation's memory analysis must fit the
    budget (else the pick is corrected downwards). Training runs that very executable: no second compilation
    (``unkept``, given, receives it instead, for the caller to keep: a streamed batch keeps only its chunk's).
    """
    batch_size, share = layout.batch_size, self._share_size(layout.batch_size)
    key = None if step_time is not None else self._plan_key(shared_args, inputs, targets, via_window)
    if self._plan_from_cache(key, layout, shared_args, inputs, targets, compilers, via_window, unkept):
      self._note_window(batch_size, via_window)
      return
    planned = None
    try:
      if self.remat == 'auto':
        size, used, remat, planned = self._plan_fastest(share, shared_args, inputs, targets, step_time, compilers,
                                                        via_window)
      else:
        size, used, planned = self._plan_fewest(share, shared_args, inputs, targets, compilers, via_window)
        remat = None
    except ValueError as error:
      if self.mesh is None:
        self._store_plan(key, {'fits': False, 'error': str(error)})
        raise
      raise ValueError(f'{error} With the mesh, each of the {self.num_devices} devices holds {share} samples of '
                       f'the batch of {batch_size}, and memory_budget is per device.') from None
    # the largest micro-batch that fits (with remat='auto' the fastest plan may cut finer): how streaming ranks chunks
    largest = size if remat is None else max(c.micro_batch_size for c in self.weighed_plans[share] if c.fits)
    self._store_plan(key, {'fits': True, 'micro_batch_size': size, 'remat': remat, 'bytes': used, 'largest': largest})
    self._largest_micro[batch_size] = largest
    self._set_plan(batch_size, plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat), used, planned,
                   unkept=unkept)
    self._note_window(batch_size, via_window)

  def _note_window(self, batch_size: int, via_window: bool) -> None:
    """Record that ``batch_size`` was planned for its step through the window, which needs more than the plain
    step (its sums): such a plan serves both."""
    if via_window:
      self._through_window.add(batch_size)

  @property
  def _through_window(self) -> set:
    """Batch (or chunk) sizes planned for their step through the window (a streamed chunk's)."""
    return self.__dict__.setdefault('_planned_through_window', set())

  def _plan_again_through_window(self, batch_size: int) -> bool:
    """Whether ``batch_size``, now a streamed chunk, must be planned (again) for its step through the window:
    a plan of the plain step, made for a batch of that size, does not say that the window's step fits. The
    plain step kept from that planning is dropped, so that fit runs the new plan's."""
    if batch_size in self.memory_plans and batch_size in self._through_window:
      return False
    self._kept_steps.pop(('fit', batch_size), None)
    return True

  @property
  def _largest_micro(self) -> Dict[int, int]:
    """Batch (or chunk) size -> the largest micro-batch whose step fits the budget, as its planning found."""
    return self.__dict__.setdefault('_largest_micro_by_size', {})

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
    per_device = '' if self.mesh is None else ' per device'
    tqdm.write(f'memory plan: {self.describe_batch(batch_size)} ({plural(plan.num_micro_batches, "micro-batch")}), '
               f'train step {format_memory(used)}{per_device} of memory_budget {format_memory(self.memory_budget)}'
               f'{source}')

  def _plan_key(self, shared_args, inputs, targets, via_window: bool) -> Optional[dict]:
    """Everything a plan depends on, as JSON, or ``None`` where plans are not cached (no cache, a mesh)."""
    if self._plan_cache is None or self.mesh is not None:
      return None
    return plan_key(self, shared_args, inputs, targets, via_window)

  def _plan_cached(self, shared_args, inputs, targets) -> bool:
    """Whether the plan cache has a file for this batch's plan (not read: planning reads and checks it)."""
    key = self._plan_key(tools.DotDict({'fit': True, **(shared_args or {})}), inputs, targets, False)
    return key is not None and os.path.exists(self._plan_cache.path(key))

  def _store_plan(self, key: Optional[dict], plan: dict) -> None:
    if key is not None:
      self._plan_cache.put(key, plan)

  def _plan_from_cache(self, key: Optional[dict], layout, shared_args, inputs, targets, compilers: Compilers,
                       via_window: bool, unkept: Optional[Dict[int, PlannedStep]] = None) -> bool:
    """Use the cached plan for ``key`` if there is one and its step, compiled again, still fits; True if used.

    A cached plan is never trusted: the step is compiled (for training where fit can run it, quickly
    otherwise) and must fit the budget by XLA's measure, else a one-line warning and planning anew. A cached
    'does not fit' (the same step measured by an earlier run) raises its error again, for streaming to go on.
    """
    entry = None if key is None else self._plan_cache.get(key)
    if entry is None:
      return False
    if entry.get('fits') is False and isinstance(entry.get('error'), str):
      raise ValueError(entry['error'])
    size, remat, share = entry.get('micro_batch_size'), entry.get('remat'), self._share_size(layout.batch_size)
    largest = entry.get('largest', size)
    if not (isinstance(size, int) and 1 <= size <= share and (remat is None or isinstance(remat, (bool, int)))
            and isinstance(largest, int) and 1 <= largest <= share):
      warnings.warn(f'plan cache: ignored an entry for batch {layout.batch_size} that does not describe a plan of '
                    f'it; planning anew.', UserWarning, stacklevel=2)
      return False
    plan = plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)
    if compilers.keepable(via_window):
      planned = compilers.trial(plan, shared_args, inputs, targets, via_window)
      used = planned.memory.total
    else:
      planned, used = None, memory_parts(compilers.step_bytes(plan, shared_args, inputs, targets, via_window))[0]
    if used > self.memory_budget:
      warnings.warn(f'plan cache: the cached plan for batch {layout.batch_size} ({plan.describe_cuts()}) needs '
                    f'{format_memory(used)} now, over memory_budget {format_memory(self.memory_budget)}; planning '
                    f'anew.', UserWarning, stacklevel=2)
      return False
    self._largest_micro[layout.batch_size] = max(size, largest)
    self._set_plan(layout.batch_size, plan, used, planned, cached=True, unkept=unkept)
    return True

  def _plan_fewest(self, share: int, shared_args, inputs, targets, compilers: Compilers, via_window: bool
                   ) -> Tuple[int, int, Optional[PlannedStep]]:
    """``(micro_batch_size, bytes, compiled step or None)``: the fewest micro-batches whose step fits.

    Sizes the search predicts to be the answer are compiled as training runs them (when fit can run that
    executable), the others quickly; an answer measured quickly is compiled for training afterwards, and
    its memory must fit too, else the search goes on below it.
    """
    plan_of = lambda size: plan_micro_batches(share, micro_batch_size=size)
    keepable, kept = compilers.keepable(via_window), {}

    def probe(size):
      return compilers.step_bytes(plan_of(size), shared_args, inputs, targets, via_window)

    def compile_for_training(size):
      kept[size] = compilers.trial(plan_of(size), shared_args, inputs, targets, via_window)
      return kept[size].memory

    guess = None if compilers.guess(plan_of(share)) is None else (lambda size: compilers.guess(plan_of(size)))
    below = None
    while True:
      size, used = choose_micro_batch_size(share, self.memory_budget, probe, below=below, guess=guess,
                                           measure_pick=compile_for_training if keepable else None)
      if not keepable:
        return size, used, None  # fit runs a step of its own (a window, a mesh): the probe's figure is XLA's measure
      planned = kept.get(size) or compilers.trial(plan_of(size), shared_args, inputs, targets, via_window)
      if planned.memory.total <= self.memory_budget:
        return size, planned.memory.total, planned
      tqdm.write(f'memory plan: micro-batches of {size} need {format_memory(planned.memory.total)} compiled for '
                 f'training, not the {format_memory(used)} of the quick compilation; searching below')
      below = size

  def _plan_stream(self, layout, shared_args, inputs, targets, step_time, compilers: Compilers,
                   error: Optional[ValueError]) -> MicroBatchPlan:
    """The batch's data does not fit beside its step: stream it from the host in chunks (:mod:`~brainpy_accum.memory._stream`).

    The chunk size is :func:`~brainpy_accum.memory._stream.best_chunk`'s: of the chunk sizes whose step
    fits, the one that holds the largest micro-batches, then the largest chunk (the chunk's plan is then the
    fastest that fits, with ``remat='auto'``, which may cut finer: by memory alone, the choice of chunk does
    not hang on the noise of trial steps). Few are planned: first the one a
    line through the largest chunk's quick probes predicts to win (:func:`~brainpy_accum.memory._stream.likely_chunk`:
    the step's fixed bytes change with the chunk, its temporaries with the micro-batch),
    then only those that can still hold micro-batches large enough to win, by a lower bound (a cut of no larger
    micro-batches measured in a chunk no larger, plus the extra data and states; or one from the step's trace,
    :mod:`~brainpy_accum.memory._live`) or else a quick probe. The chunks' searches share their probes, and
    each starts at the micro-batch the guess's line predicts (``guess``).
    """
    batch_size, budget = layout.batch_size, self.memory_budget
    variables = list(self.vars().unique().values()) + random_states(self.target)
    options = REMAT_OPTIONS if self.remat == 'auto' else (None,)
    probes, unkept = {}, {}  # unkept: each chunk's step compiled for training; only the chosen chunk's is kept
    cut_bytes = {}  # (chunk, micro-batch, remat) -> measured bytes of a step of two or more micro-batches

    def noted(plan, memory):
      if plan.num_micro_batches > 1:
        cut_bytes[plan.batch_size, plan.micro_batch_size, plan.remat] = memory_parts(memory)[0]
      return memory

    def probe(plan, shared_args, inputs, targets, via_window):  # each quick probe once, for every chunk's search
      key = (plan.batch_size, plan.micro_batch_size, plan.remat, via_window)
      if key not in probes:
        probes[key] = noted(plan, compilers.step_bytes(plan, shared_args, inputs, targets, via_window))
      return probes[key]

    def trial(plan, *args):
      planned = compilers.trial(plan, *args)
      noted(plan, planned.memory)
      return planned

    line = {}  # likely()'s line: the fixed bytes' offset over the arithmetic, the temporaries per sample

    def guess(plan) -> Optional[float]:  # a chunk's step, predicted by likely()'s line (None before it is drawn)
      slope = line.get('per_sample', {}).get(plan.remat)
      if slope is None:
        return None
      return fixed_bytes_of_chunk(plan.batch_size) + line['offset'] + slope * plan.micro_batch_size

    chunk_compilers = compilers._replace(step_bytes=probe, trial=trial, guess=guess)

    def data_of(chunk: int):  # the first chunk's inputs and targets
      return [host_chunk(tree, axes, 0, chunk) for tree, axes in ((inputs, layout.input_axes),
                                                                  (targets, layout.target_axes))]

    def chunk_of(chunk: int):  # the first chunk's data, with the model state at the chunk's size
      self.target.reset(chunk)
      return data_of(chunk)

    states_now = batched_variables(self.target, batch_size)  # fit reset them at the batch size

    def fixed_bytes_of_chunk(chunk: int) -> int:  # _fixed_bytes_at_least at the chunk's size, by arithmetic:
      # no reset (its zeros would compile once per size); the model's batched states scale with the chunk
      states = [bm.as_jax(var.value) for var, _ in states_now.values()]
      scaled = sum(x.nbytes // x.shape[axis] * chunk for x, (_, axis) in zip(states, states_now.values()))
      return self._fixed_bytes_at_least(*data_of(chunk)) - sum(x.nbytes for x in states) + scaled

    def fitting_chunk_of(chunk: int):  # chunk_of; None where its fixed bytes alone exceed the budget (arithmetic)
      chunk_data = chunk_of(chunk)
      return None if self._fixed_bytes_at_least(*chunk_data) > budget else chunk_data

    def plan_of(chunk: int, micro: int, remat):
      return plan_micro_batches(chunk, micro_batch_size=micro)._replace(remat=remat)

    def micro_batch_of(chunk: int) -> Optional[int]:  # the largest micro-batch that fits the chunk; None: none
      if self._plan_again_through_window(chunk):
        chunk_data = fitting_chunk_of(chunk)
        if chunk_data is None:
          return None
        try:
          self._plan_batch(self._check_batch(*chunk_data), shared_args, *chunk_data, step_time, chunk_compilers,
                           via_window=True, unkept=unkept)
        except ValueError:
          return None
      return self._largest_micro[chunk]

    def bytes_from_smaller(plan) -> int:  # a lower bound of a cut, from cuts of no more samples, by arithmetic
      # larger micro-batches, or more of them in a larger chunk: the temporaries do not shrink (memory grows
      # with the micro-batch, as the search assumes), and the data and states grow with the chunk
      if plan.num_micro_batches < 2:  # in one piece a chunk is another step, without the micro-batch loop
        return 0
      known = [used - fixed_bytes_of_chunk(chunk) for (chunk, micro, remat), used in cut_bytes.items()
               if remat == plan.remat and micro <= plan.micro_batch_size and chunk <= plan.batch_size]
      return max(known) + fixed_bytes_of_chunk(plan.batch_size) if known else 0

    def can_hold(chunk: int, micro: int) -> bool:  # does some step of micro-batches of `micro` fit the chunk?
      chunk_data = fitting_chunk_of(chunk)
      if chunk_data is None:
        return False
      try:
        return any(bytes_from_smaller(plan) <= budget
                   and compilers.bytes_at_least(plan, shared_args, *chunk_data, True) <= budget
                   and memory_parts(probe(plan, shared_args, *chunk_data, True))[0] <= budget
                   for plan in (plan_of(chunk, micro, remat) for remat in options))
      except ValueError:  # not answered here: planning the chunk will say
        return True

    def likely() -> Optional[int]:  # a line through the largest chunk's quick probes, one per remat option
      fixed_least = {chunk: fixed_bytes_of_chunk(chunk) for chunk in chunk_candidates(batch_size)}
      top = max((chunk for chunk, least in fixed_least.items() if least <= budget), default=None)
      if top is None:
        return None
      chunk_data = chunk_of(top)  # (the first probes of its own search, if it is planned)
      measured = {remat: memory_parts(probe(plan_of(top, top, remat), shared_args, *chunk_data, True))
                  for remat in options}
      line['offset'] = max(fixed for _, fixed in measured.values()) - fixed_least[top]
      line['per_sample'] = {remat: (total - fixed) / top for remat, (total, fixed) in measured.items()}
      return likely_chunk(batch_size, budget, lambda chunk: fixed_least[chunk] + line['offset'],
                          list(line['per_sample'].values()))

    def guessed() -> Optional[int]:  # a guess that cannot be made only orders the planning differently
      try:
        return likely()
      except ValueError:
        return None

    key = None if step_time is not None else self._plan_key(shared_args, inputs, targets, False)
    key = None if key is None else dict(key, streamed=True)  # the choice of chunk, beside the batch's own plans

    def one_sample_need() -> Optional[int]:  # what streaming one sample at a time needs (a quick probe's figure)
      chunk_data = chunk_of(1)
      fixed = self._fixed_bytes_at_least(*chunk_data)
      if fixed > budget:
        return fixed
      try:
        return min(memory_parts(probe(plan_of(1, 1, remat), shared_args, *chunk_data, True))[0] for remat in options)
      except ValueError:
        return None

    need = None
    with values_restored(variables, any_shape=True):  # resets draw random numbers: all is put back as it was
      chunk = self._cached_chunk(key, batch_size, micro_batch_of)
      if chunk is None:
        chunk = best_chunk(batch_size, micro_batch_of, can_hold=can_hold, first=guessed())
        if chunk is not None:
          self._store_plan(key, {'stream_chunk': chunk})
        else:
          need = one_sample_need()
    if chunk is None:
      if need is not None and need > budget:  # the whole batch's error would name the need of the unstreamed step
        raise ValueError(f'memory_budget={format_memory(budget)} ({budget} bytes) is too small for batch {batch_size}: '
                         f'its step does not fit with its data on the device, and streamed from the host one sample '
                         f'at a time it needs about {format_memory(need)} ({need} bytes). Raise memory_budget to at '
                         f'least {need}' + (', or use remat=True.' if not self.remat else '.'))
      if error is None:  # skipped by arithmetic: the search itself gives the error that names the budget needed
        self._plan_batch(layout, shared_args, inputs, targets, step_time, compilers)
        return self.memory_plans[batch_size][0]
      raise error
    self.stream_chunks[batch_size] = chunk
    if chunk in unkept:  # fit runs it for each batch's last chunk
      unkept[chunk].keep()
    plan, used = self.memory_plans[chunk]
    tqdm.write(f'memory plan: batch {batch_size} does not fit memory_budget {format_memory(self.memory_budget)} '
               f'with its data on the device; streamed from the host in chunks of {chunk} '
               f'({plan.describe()}, train step {format_memory(used)}), one update per batch')
    return plan

  def _cached_chunk(self, key: Optional[dict], batch_size: int, micro_batch_of: Callable[[int], Optional[int]]
                    ) -> Optional[int]:
    """The chunk size an earlier run chose to stream a batch in, if the plan cache has it and its step still
    fits (``micro_batch_of`` plans it: from the cache too, its step compiled again and measured); else ``None``."""
    entry = None if key is None else self._plan_cache.get(key)
    if entry is None:
      return None
    chunk = entry.get('stream_chunk')
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk not in chunk_candidates(batch_size):
      warnings.warn(f'plan cache: ignored an entry for streaming batch {batch_size} that does not name a chunk '
                    f'size of it; planning anew.', UserWarning, stacklevel=2)
      return None
    if micro_batch_of(chunk) is None:
      warnings.warn(f'plan cache: the cached chunk size {chunk} for streaming batch {batch_size} does not fit '
                    f'memory_budget {format_memory(self.memory_budget)} now; planning anew.', UserWarning, stacklevel=2)
      return None
    return chunk

  def _plan_fastest(self, share: int, shared_args, inputs, targets, step_time, compilers: Compilers,
                    via_window: bool = False) -> Tuple[int, int, Union[bool, int], Optional[PlannedStep]]:
    """``remat='auto'``: ``(micro_batch_size, bytes, remat, compiled step)`` of the fastest plan that fits, its
    table printed.

    Only the largest fitting micro-batch of each remat option is weighed: those are the candidates that can
    win, since a finer cut of the same remat does the same work in more, smaller sequential steps. The
    search compiles the sizes it predicts to be the answer as training runs them, so the candidates timed are
    already compiled, their compilation's memory is the figure that must fit, and training runs the winner's
    executable.
    """
    compiled = {}

    def plan_of(size, remat):
      return plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)

    def probe(size, remat):
      return compilers.step_bytes(plan_of(size, remat), shared_args, inputs, targets, via_window)

    def compile_(size, remat):
      if (size, remat) not in compiled:
        compiled[size, remat] = compilers.trial(plan_of(size, remat), shared_args, inputs, targets, via_window)
      return compiled[size, remat]

    def timed(pairs):
      if step_time is not None:
        return step_time([plan_of(s, r) for s, r in pairs])
      steps = [compile_(*pair) for pair in pairs]
      if self._check_running is not None:
        self._check_running(report=False)  # the first-batch check compiles beside planning: not while timing
      # two interleaved runs each, the faster kept: the first run of a new executable is the slow one (about
      # 20% on CPU), so this is the second's time, for one run less per candidate than a warm-up and two rounds
      seconds = time_steps([step.run for step in steps], rounds=2, warm_up=False, estimate=min)
      # one compiled for training that does not fit after all (the quick probe measured otherwise) is never chosen
      return [t if step.memory.total <= self.memory_budget else float('inf') for t, step in zip(seconds, steps)]

    guess = None if compilers.guess(plan_of(share, False)) is None else (
      lambda size, remat: compilers.guess(plan_of(size, remat)))
    chosen, weighed = choose_fastest_plan(share, self.memory_budget, probe, timed, finer=0, guess=guess,
                                          measure_pick=lambda size, remat: compile_(size, remat).memory)
    if chosen.seconds == float('inf'):
      raise ValueError(f'memory_budget={format_memory(self.memory_budget)}: no plan fits when compiled for '
                       f'training, although quick compilations said so. Raise memory_budget.')
    self.weighed_plans[share] = weighed
    tqdm.write(describe_choice(share, self.memory_budget, chosen, weighed))
    planned = compiled.get((chosen.micro_batch_size, chosen.remat))
    if planned is None and compilers.keepable(via_window):  # measured by a quick probe: compile it for training
      planned = compile_(chosen.micro_batch_size, chosen.remat)
      if planned.memory.total > self.memory_budget:
        raise ValueError(f'memory_budget={format_memory(self.memory_budget)}: the chosen plan needs '
                         f'{format_memory(planned.memory.total)} compiled for training, although a quick '
                         f'compilation measured {format_memory(chosen.bytes)}. Raise memory_budget.')
    used = chosen.bytes if planned is None else planned.memory.total
    return chosen.micro_batch_size, used, chosen.remat, planned

  @property
  def weighed_plans(self) -> Dict[int, List[Candidate]]:
    """With ``remat='auto'``: every candidate plan weighed for each batch size (per device with a mesh),
    with its memory and trial step time, as :meth:`plan_memory` printed them."""
    return self.__dict__.setdefault('_weighed_plans', {})

  def _check_batch(self, inputs: Any, targets: Any) -> BatchLayout:
    """Check one batch and return its layout; raises ``ValueError`` before anything changes.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(3, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2)
    >>> trainer._check_batch(np.ones((8, 5, 3)), np.ones((8, 5, 2))).batch_size
    8
    >>> trainer._check_batch(np.ones((8, 5, 3)), np.ones((6, 5, 2)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: targets has shape (6, 5, 2), but the inputs hold batch_size=8 samples ...
    """
    layout = batch_layout(inputs, targets, self.data_first_axis, self.target_batch_axis,
                          resolve=functools.partial(self._decide_target_axes, inputs, targets))
    self._share_size(layout.batch_size)
    return layout

  def _decide_target_axes(self, inputs, targets, input_axes, batch_size: int, candidates) -> List[int]:
    """Target leaves with two axes of the batch's size: their batch axes from evidence
    (:mod:`~brainpy_accum.trainer._target_axes`), decided once per batch shape."""
    key = (jax.tree_util.tree_structure((inputs, targets), is_leaf=is_array),
           tuple(tuple(np.shape(x)) for x in jax.tree_util.tree_leaves((inputs, targets), is_leaf=is_array)),
           tuple(map(tuple, candidates)))
    decided = self.__dict__.setdefault('_decided_target_axes', {})
    if key not in decided:
      states = batched_variables(self.target, batch_size)
      shared_args = tools.DotDict({'fit': True})
      with declared_batch_axes(states.values()), self._without_time_step_bars():
        predict = predict_shapes_of(self._forward(shared_args), inputs, input_axes, list(states.values()))
        decided[key] = decide_target_axes(predict, self._loss_of, targets, batch_size, candidates)
    return decided[key]
