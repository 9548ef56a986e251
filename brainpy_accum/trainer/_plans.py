"""The trainer's plans per batch size: how a batch is cut, split over a mesh, and planned under a memory budget.

:class:`Planning` is a mixin of :class:`~brainpy_accum.AccumBPTT`: the public methods that say how a batch
of a given size runs (:meth:`~Planning.plan_for`, :meth:`~Planning.describe_batch`), and the private ones that
check a batch, choose micro-batches under a memory budget and re-plan after running out of memory. What it
compiles, times or rebuilds it receives as arguments (:class:`Compilers`, ``rebuild``, ``window``): it never
calls back into the trainer's steps.
"""

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import jax
import numpy as np
from brainpy import tools
from tqdm import tqdm

from ..core._batch import BatchLayout, batch_layout, is_array
from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._mesh import batch_spec, check_divisible, mesh_size, random_states
from ..core._states import batched_variables, declared_batch_axes, values_restored
from ..memory._budget import choose_micro_batch_size, compiled_step_bytes, format_memory
from ..memory._fastest import Candidate, choose_fastest_plan, describe_choice, time_steps
from ..memory._oom import finer_plan
from ..memory._stream import chunk_candidates, host_chunk
from ._target_axes import decide_target_axes, predict_shapes_of

__all__ = ['Compilers', 'Planning']


class Compilers(NamedTuple):
  """What planning compiles and times, given by the trainer.

  ``step_bytes(plan, shared_args, inputs, targets, via_window) -> bytes`` of the train step compiled for
  ``plan``; ``trial(plan, shared_args, inputs, targets) -> (compiled, run)``: that step compiled, and a
  ``run()`` of it that changes nothing (``remat='auto'``'s trial steps).
  """
  step_bytes: Callable[..., int]
  trial: Callable[..., Tuple[Any, Callable[[], Any]]]


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
                   compilers: Compilers, may_stream: bool) -> MicroBatchPlan:
    """:meth:`~brainpy_accum.AccumBPTT.plan_memory`, compiling and timing with ``compilers``; ``may_stream``:
    a batch whose data does not fit may be streamed from the host."""
    if self.num_micro_batch != 'auto':
      raise ValueError(f"plan_memory needs num_micro_batch='auto'; this trainer has "
                       f"num_micro_batch={self.num_micro_batch!r}, micro_batch_size={self.micro_batch_size!r}.")
    layout = self._check_batch(inputs, targets)
    batch_size = layout.batch_size
    if batch_size in self.stream_chunks:
      return self.memory_plans[self.stream_chunks[batch_size]][0]
    if batch_size not in self.memory_plans:
      try:
        self._plan_batch(layout, shared_args, inputs, targets, step_time, compilers)
      except ValueError as error:
        if not may_stream or batch_size == 1:
          raise
        return self._plan_stream(layout, shared_args, inputs, targets, step_time, compilers, error)
    return self.memory_plans[batch_size][0]

  def _plan_batch(self, layout, shared_args, inputs, targets, step_time, compilers: Compilers,
                  via_window: bool = False) -> None:
    """Plan one batch (or streamed chunk) whose step holds all of it; raises ``ValueError`` if none fits."""
    batch_size, share = layout.batch_size, self._share_size(layout.batch_size)
    measure = lambda size: compilers.step_bytes(
      plan_micro_batches(share, micro_batch_size=size), shared_args, inputs, targets, via_window)
    try:
      if self.remat == 'auto':
        size, used, remat = self._plan_fastest(share, shared_args, inputs, targets, step_time, compilers)
      else:
        (size, used), remat = choose_micro_batch_size(share, self.memory_budget, measure), None
    except ValueError as error:
      if self.mesh is None:
        raise
      raise ValueError(f'{error} With the mesh, each of the {self.num_devices} devices holds {share} samples of '
                       f'the batch of {batch_size}, and memory_budget is per device.') from None
    plan = plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)
    self.memory_plans[batch_size] = (plan, used)
    per_device = '' if self.mesh is None else ' per device'
    tqdm.write(f'memory plan: {self.describe_batch(batch_size)} ({plan.num_micro_batches} micro-batches), '
               f'train step {format_memory(used)}{per_device} of memory_budget {format_memory(self.memory_budget)}')

  def _plan_stream(self, layout, shared_args, inputs, targets, step_time, compilers: Compilers,
                   error: ValueError) -> MicroBatchPlan:
    """The batch's data does not fit beside its step: stream it from the host in chunks (:mod:`~brainpy_accum.memory._stream`).

    Of the chunk sizes whose step fits, the one with the largest micro-batches (the fewest sequential
    micro-batch steps per batch), then the largest chunk (the fewest transfers). Chunks are tried largest
    first; the search stops at a chunk that runs as one micro-batch, since smaller chunks cannot do better.
    """
    batch_size = layout.batch_size
    variables = list(self.vars().unique().values()) + random_states(self.target)
    fitting = []
    with values_restored(variables, any_shape=True):  # resets draw random numbers: all is put back as it was
      for chunk in chunk_candidates(batch_size):
        chunk_data = [host_chunk(tree, axes, 0, chunk) for tree, axes in
                      ((inputs, layout.input_axes), (targets, layout.target_axes))]
        if chunk not in self.memory_plans:
          self.target.reset(chunk)  # the chunk's step takes the model state at the chunk's size
          try:
            self._plan_batch(self._check_batch(*chunk_data), shared_args, *chunk_data, step_time, compilers,
                             via_window=True)
          except ValueError:
            continue
        fitting.append(chunk)
        if self.memory_plans[chunk][0].num_micro_batches == 1:
          break
    if not fitting:
      raise error
    chunk = max(fitting, key=lambda c: (self.memory_plans[c][0].micro_batch_size, c))
    self.stream_chunks[batch_size] = chunk
    plan, used = self.memory_plans[chunk]
    tqdm.write(f'memory plan: batch {batch_size} does not fit memory_budget {format_memory(self.memory_budget)} '
               f'with its data on the device; streamed from the host in chunks of {chunk} '
               f'({plan.describe()}, train step {format_memory(used)}), one update per batch')
    return plan

  def _plan_fastest(self, share: int, shared_args, inputs, targets, step_time,
                    compilers: Compilers) -> Tuple[int, int, Union[bool, int]]:
    """``remat='auto'``: ``(micro_batch_size, bytes, remat)`` of the fastest plan that fits, its table printed."""
    compiled = {}

    def compile_(size, remat):
      if (size, remat) not in compiled:
        plan = plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)
        compiled[size, remat] = compilers.trial(plan, shared_args, inputs, targets)
      return compiled[size, remat]

    def timed(pairs):
      if step_time is not None:
        return step_time([plan_micro_batches(share, micro_batch_size=s)._replace(remat=r) for s, r in pairs])
      return time_steps([compile_(*pair)[1] for pair in pairs])

    chosen, weighed = choose_fastest_plan(share, self.memory_budget,
                                          lambda size, remat: compiled_step_bytes(compile_(size, remat)[0]), timed)
    self.weighed_plans[share] = weighed
    tqdm.write(describe_choice(share, self.memory_budget, chosen, weighed))
    return chosen.micro_batch_size, chosen.bytes, chosen.remat

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
