"""``AccumBPTT``: :class:`brainpy.BPTT` with gradient accumulation over micro-batches inside one compiled step.

A thin trainer that composes its parts, each an object with its collaborators passed in: ``ModelLoss``,
``CompiledSteps``, the memory ``Planner`` (:attr:`AccumBPTT.planner`), ``FirstBatchCheck``, ``GradWindow``
and the fit loop's ``TrainerParts`` (``docs/architecture.md``). None of them reads the trainer's attributes.
"""

import contextlib
import functools
import os
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import brainpy as bp
from brainpy import tools
import brainpy.math as bm
import jax
from jax.sharding import Mesh, PartitionSpec

from ..checkpoint._save_load import load as load_checkpoint
from ..checkpoint._save_load import RunFiles
from ..checkpoint._save_load import save as save_checkpoint
from ..core._batch import BatchLayout, batch_layout
from ..core._cut import MicroBatchPlan, as_int
from ..core._mesh import auto_axes, check_mesh, mesh_size, place, random_states
from ..core._shared_env import restores_shared_env
from ..core._states import batched_variables
from ..core._written import progress_bars_run
from ..diagnostics._compiles import Compilations
from ..memory._budget import argument_bytes, compiled_step_bytes, fixed_bytes_at_least
from ..memory._cache import PlanCache, cache_folder, use_compilation_cache
from ..memory._device import Budget, is_refused_program
from ..memory._plan_key import plan_key
from ..memory._planner import PlannedModel, Planner
from ._arguments import check_fit_call, check_trainer_args, warn_inexact
from ._compiled_steps import CompiledSteps, StepOptions, StepParts, fit_args
from ._coupled_loss import CheckParts, FirstBatchCheck
from ._feed import prefetch_bytes, sends_ahead
from ._fit_loop import FitLoop, LoopOptions, LoopSettings, LoopView, TrainerHooks
from ._model_loss import BPTTFunctions, ModelLoss
from ..core._mesh import split_variables
from ..core._target_axes import TargetAxes
from ._window import GradWindow, check_accumulate_steps

__all__ = ['AccumBPTT']


class AccumBPTT(bp.BPTT):
  """Back-propagation through time with gradient accumulation over micro-batches.

  A drop-in replacement for :class:`brainpy.BPTT`: the same constructor
  arguments and the same :meth:`fit`, plus the accumulation options below.
  Each batch is cut into micro-batches that run one after another inside one
  compiled train step, so only one micro-batch's activations are alive at a
  time; their gradients are combined and the optimizer updates once::

    for each micro-batch i of the batch (n_i samples):
      model state <- its n_i samples of the batch's model state
      g_i, loss_i = grad(loss)(micro-batch i)
      acc += w_i * g_i                      # w_i = n_i ('mean') or 1 ('sum')
    optimizer.update(acc / sum_i w_i)       # one update per batch ('mean')

  With ``grad_reduction='mean'`` and a loss that averages over samples, the
  update, the reported loss and the auxiliary metrics equal those of
  :class:`brainpy.BPTT` on the whole batch (to float32 round-off), for any
  batch size: a batch that does not divide evenly runs one shorter
  micro-batch, weighted by its sample count.

  Parameters
  ----------
  target : DynamicalSystem
    The model to train, in a batching or training mode.
  loss_fun : str, callable
    The loss ``loss_fun(predicts, targets)``, or a name from ``brainpy.losses``.
  optimizer : Optimizer, optional
    The optimizer; defaults as in :class:`brainpy.BPTT`.
  num_micro_batch : int or 'auto', optional
    Cut each batch into at most this many micro-batches of ``ceil(batch_size /
    num_micro_batch)`` samples (or give ``micro_batch_size``; neither: ``1``,
    exactly :class:`brainpy.BPTT`). ``'auto'`` picks, per batch size, the
    fewest micro-batches whose compiled step fits ``memory_budget``
    (:meth:`plan_memory`).
  micro_batch_size : int, optional
    Cut each batch into micro-batches of this many samples (the last shorter).
  grad_reduction : {'mean', 'sum'}
    ``'mean'`` (default) weights each micro-batch by its sample count and divides
    by the batch size (losses that average over samples); ``'sum'`` adds them
    (losses that sum over samples).
  target_batch_axis : int, optional
    The batch axis of every target leaf (default: ``data_first_axis``'s, or
    axis 0 where that axis does not hold the batch).
  memory_budget : int or str, optional
    With ``num_micro_batch='auto'``: bytes, ``'2GiB'``, or a share of the device
    (``'90%'``); left out on a GPU or TPU: the device's own memory, less what
    other arrays hold and a margin, checked again at each :meth:`fit`. A host
    batch that does not run in one micro-batch there (or whose data does not fit
    beside its step) is streamed in pieces, one update per batch.
  accumulate_steps : int or dict
    Also accumulate across batches: one update every ``k`` batches (and at an
    epoch's last), weighted by what each held, so ``k`` batches of ``b`` give
    the update of one of ``k * b``; ``{first_epoch: k}`` changes ``k`` by epoch.
  loss_weight_fn : callable, optional
    ``loss_weight_fn(inputs, targets) -> weight`` of a (micro-)batch, for losses
    normalised by something else than the sample count (the valid steps of a
    masked loss): micro-batches are weighted by it. ``'mean'`` only.
  clip_grad_norm : float, optional
    Clip the combined gradient (after all micro-batches and batches of an
    update) to this global L2 norm, once per optimizer update.
  skip_nonfinite : bool
    Skip an update whose gradient holds a NaN or an infinity (nothing changes;
    counted in ``skipped_steps``; with ``accumulate_steps``, the batch only).
  remat : bool, int or 'auto'
    Rematerialise over time: ``True`` checkpoints the time loop every
    ``round(sqrt(T))`` steps, an int every that many (about one extra forward
    pass; same gradients); ``'auto'`` (with ``num_micro_batch='auto'``): the
    planner chooses per batch size, the fastest plan that fits.
  mesh : jax.sharding.Mesh, optional
    Data parallelism: each batch is split over the ``D`` devices of ``mesh_axis``
    (sizes multiples of ``D``), one all-reduce per step; the micro-batch options
    and ``memory_budget`` describe one device's share.
  mesh_axis : str, optional
    The mesh axis that splits the batch (needed if the mesh has several).
  whole_batch_loss : bool
    ``False`` (default): each micro-batch's loss is its own, exact for losses
    that are a (weighted) mean or sum of per-sample terms (the first batch is
    checked once, at random outputs, with a warning if not). ``True``: exact
    for ANY loss of the whole batch's predictions and monitors, by two passes
    inside the one step (about one extra forward pass); not with
    ``accumulate_steps > 1``, ``grad_reduction='sum'`` or ``loss_weight_fn``.
  aux_reduction : dict, optional
    With ``loss_has_aux=True``: how scalar metrics combine over micro-batches,
    by name: ``'mean'``, ``'sum'``, ``'max'`` or ``'min'``, e.g.
    ``{'n_correct': 'sum'}``; undeclared ones get the reduction the first
    batch's check finds; per-sample metrics are stitched, as bp.BPTT records.
  cache : bool, str or os.PathLike
    Caches that make a rerun start fast: JAX's persistent compilation cache and
    the planner's plans (measured again, never trusted). ``True`` (default):
    ``BRAINPY_ACCUM_CACHE_DIR`` or ``~/.cache/brainpy_accum`` (none if
    ``BRAINPY_ACCUM_CACHE=0``); ``False``: none; a path: that folder.
  **kwargs
    Any other :class:`brainpy.BPTT` argument (``loss_has_aux``, ``monitors``, ...).

  Attributes
  ----------
  trace_counts : dict
    How many times the train (``'fit'``) and evaluation (``'loss'``) steps
    were traced: one per distinct batch shape when jitted.
  planner : brainpy_accum.memory.Planner
    How each batch size is cut: its budget, plans (:attr:`memory_plans`),
    streamed chunks (:attr:`stream_chunks`), ``weighed_plans`` and plan cache.

  Examples
  --------
  >>> import brainpy as bp, brainpy.math as bm, numpy as np
  >>> from brainpy_accum import AccumBPTT
  >>> bm.random.seed(0)
  >>> with bm.training_environment():
  ...   model = bp.Sequential(bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, 2))
  >>> trainer = AccumBPTT(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=1e-2),
  ...                     num_micro_batch=4, progress_bar=False)
  >>> x, y = np.ones((10, 5, 3), 'float32'), np.zeros((10, 5, 2), 'float32')
  >>> trainer.fit([(x, y)], num_epoch=2)  # doctest: +ELLIPSIS
  Train 0 epoch, use ... s, loss ... (batch 10 = 3 x 3 + 1)
  Train 1 epoch, use ... s, loss ... (batch 10 = 3 x 3 + 1)
  >>> trainer.train_losses.shape
  (2,)
  """

  def __init__(
      self,
      target: bp.DynamicalSystem,
      loss_fun: Union[str, Callable],
      optimizer: Optional[bp.optim.Optimizer] = None,
      *,
      num_micro_batch: Union[int, str, None] = None,
      micro_batch_size: Optional[int] = None,
      grad_reduction: str = 'mean',
      target_batch_axis: Optional[int] = None,
      memory_budget: Union[int, str, None] = None,
      remat: Union[bool, int, str] = False,
      accumulate_steps: Union[int, Dict[int, int]] = 1,
      loss_weight_fn: Optional[Callable] = None,
      clip_grad_norm: Optional[float] = None,
      skip_nonfinite: bool = False,
      mesh: Optional[Mesh] = None,
      mesh_axis: Optional[str] = None,
      whole_batch_loss: bool = False,
      aux_reduction: Optional[Dict[str, str]] = None,
      cache: Union[bool, str, os.PathLike] = True,
      **kwargs,
  ):
    num_micro_batch, micro_batch_size, target_batch_axis, remat = map(  # NumPy integers work as ints
      as_int, (num_micro_batch, micro_batch_size, target_batch_axis, remat))
    self.mesh_axis = check_mesh(mesh, mesh_axis)
    folder = cache_folder(cache)  # checks the argument before anything changes
    num_micro_batch, self.aux_reduction = check_trainer_args(
      num_micro_batch=num_micro_batch, micro_batch_size=micro_batch_size, grad_reduction=grad_reduction,
      target_batch_axis=target_batch_axis, memory_budget=memory_budget, remat=remat, mesh=mesh,
      whole_batch_loss=whole_batch_loss, loss_weight_fn=loss_weight_fn, clip_grad_norm=clip_grad_norm,
      skip_nonfinite=skip_nonfinite, accumulate_steps=accumulate_steps, aux_reduction=aux_reduction,
      loss_has_aux=kwargs.get('loss_has_aux', False), data_first_axis=kwargs.get('data_first_axis'))
    self.accumulate_steps = check_accumulate_steps(accumulate_steps)
    budget = Budget(memory_budget) if num_micro_batch == 'auto' else None  # a device budget: is there a device?
    super().__init__(target, loss_fun, optimizer=optimizer, **kwargs)
    self.num_micro_batch, self.micro_batch_size, self.grad_reduction = num_micro_batch, micro_batch_size, grad_reduction
    self.target_batch_axis, self.remat, self.loss_weight_fn = target_batch_axis, remat, loss_weight_fn
    self.memory_budget = memory_budget if budget is None or budget.from_device else budget.bytes()
    self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
    self.skip_nonfinite, self.whole_batch_loss = skip_nonfinite, whole_batch_loss
    self.mesh, self.cache_folder = None if mesh is None else auto_axes(mesh), folder
    self._build_parts(budget)
    warn_inexact(self.target, getattr(self, '_monitors', None))

  def _build_parts(self, budget: Optional[Budget]) -> None:
    """The parts the trainer is made of, each handed what it calls (see the module's docstring)."""
    if self.cache_folder is not None:
      use_compilation_cache(self.cache_folder)
    cache = PlanCache(self.cache_folder) if self.cache_folder and self.num_micro_batch == 'auto' else None
    self._compiles = Compilations()
    devices, streams = self._build_model_parts()
    model = self._model
    self._steps = CompiledSteps(
      StepParts(model=self.target, optimizer=self.optimizer, check_batch=self._check_batch,
                loss_and_aux=model.loss_and_aux, forward=model.forward, loss_of=model.loss_of, weigh=model.weigh,
                tracing=model.tracing, quiet=self._quiet, window=self._window, skipped=self.skipped_steps,
                jit=self.jit, fixed_bytes=self._fixed_bytes, note_compilations=self._compiles.note),
      StepOptions(grad_reduction=self.grad_reduction, skip_nonfinite=self.skip_nonfinite,
                  clip_grad_norm=self.clip_grad_norm, accumulate_steps=self.accumulate_steps,
                  whole_batch_loss=self.whole_batch_loss, loss_has_aux=self.loss_has_aux,
                  aux_reduction=self.aux_reduction, mesh=self.mesh, mesh_axis=self.mesh_axis, devices=devices))
    self.trace_counts = self._steps.trace_counts
    self._check = FirstBatchCheck(
      self.target, CheckParts(check_batch=self._check_batch, argument_bytes=self._argument_bytes,
                              check_flat_states=self._steps.check_flat_states, quiet=self._quiet,
                              forward=model.forward, loss_of=model.loss_of, weigh=model.weigh,
                              variables=self._variables, use_found=self._steps.use_found),
      loss_func=self._loss_func, jit=bool(self.jit['fit']), on_mesh=self.mesh is not None,
      reduction=self.grad_reduction, declared=self.aux_reduction, has_metrics=self.loss_has_aux,
      weighted=self.loss_weight_fn is not None, done=self.whole_batch_loss)
    self.planner = Planner(
      PlannedModel(check_batch=self._check_batch, variables=self._variables, reset=self.target.reset,
                   batched=functools.partial(batched_variables, self.target), fixed_bytes=self._fixed_bytes,
                   ahead_bytes=self._ahead_bytes),
      self._steps.compilers(before_timing=self._check.wait), num_micro_batch=self.num_micro_batch,
      micro_batch_size=self.micro_batch_size, budget=budget, remat=self.remat, devices=devices,
      mesh_axis=None if self.mesh is None else self.mesh_axis, streams=streams,
      whole_batch_loss=self.whole_batch_loss, cache=cache, key_of=self._plan_key)
    # the steps are traced with the planner's plans, which it makes by compiling the steps: the loop, made here
    self._steps.attach(self.planner)
    self._check.attach(self.planner)

  def _build_model_parts(self) -> Tuple[int, bool]:
    """The model's loss over bp.BPTT's functions, its target axes, the counters and the window; returns the
    devices a batch is split over and whether batches may be streamed."""
    self._model = ModelLoss(
      BPTTFunctions(self._predict, self._step_func_predict, self._time_steps_of, self._time_origin,
                    self._step_func_loss, self._loss_func),
      batch_first=isinstance(self.target.mode, bm.BatchingMode) and self.data_first_axis == 'B',
      loss_has_aux=self.loss_has_aux, grad_reduction=self.grad_reduction, loss_weight_fn=self.loss_weight_fn,
      remat=self.remat, jit_predict=self.jit['predict'])
    self._target_axes = TargetAxes(self.target, self._model.forward, self._model.loss_of, self._quiet)
    self.skipped_steps = bm.Variable(jax.numpy.zeros((), jax.numpy.int32))
    streams = self.num_micro_batch == 'auto' and self.mesh is None and not self.whole_batch_loss
    devices = 1 if self.mesh is None else mesh_size(self.mesh, self.mesh_axis)  # a batch is split over them
    needs_window = self.accumulate_steps != 1 or streams  # sums between steps
    self._window = GradWindow(self.target.train_vars().unique(), None if self.mesh is None else devices,
                              self._variables()) if needs_window else None
    return devices, streams

  def __repr__(self):
    return (f'{self.__class__.__name__}(target={self.target}, num_micro_batch={self.num_micro_batch}, '
            f'micro_batch_size={self.micro_batch_size}, grad_reduction={self.grad_reduction!r}, '
            f'optimizer={self.optimizer})')

  def fit(self, train_data: Union[Callable, Iterable], test_data: Optional[Union[Callable, Iterable]] = None,
          num_epoch: int = 100, num_report: int = -1, reset_state: bool = True, shared_args: Optional[Dict] = None,
          fun_after_report: Optional[Callable] = None, batch_size: None = None,
          checkpoint: Optional[Union[str, os.PathLike]] = None, checkpoint_every: Optional[int] = None) -> None:
    """Train on ``train_data`` for ``num_epoch`` epochs, one optimizer update per batch.

    The arguments and the recorded metrics are those of :meth:`brainpy.BPTT.fit`; every batch is micro-batched,
    and so is the evaluation on ``test_data``.

    Parameters
    ----------
    train_data : iterable or callable
      Batches ``(inputs, targets)``, or a function returning them (called once per epoch).
    test_data : iterable or callable, optional
      Evaluation batches, run after each training epoch.
    num_epoch : int
      Number of passes over ``train_data``.
    num_report : int
      ``-1`` reports once per epoch; ``k > 0`` every ``k`` batches.
    reset_state : bool
      Reset the model state at the batch size before each batch; ``False``: each sample keeps its state from
      the previous batch (truncated BPTT), which must then be of the same size.
    shared_args : dict, optional
      Shared arguments for the model; ``fit`` is set to ``True`` unless given.
    fun_after_report : callable, optional
      Called as ``fun_after_report(idx, metrics, phase)`` after each report.
    batch_size : None
      Removed from :class:`brainpy.BPTT`: anything but ``None`` raises, as in BrainPy.
    checkpoint : str or os.PathLike, optional
      A file for checkpoints of the run (:meth:`save_checkpoint`'s content, where the run stands and its metric
      history), written atomically at each epoch's end and every ``checkpoint_every`` updates. If it exists
      when ``fit`` starts, the run resumes from it and ends as an uninterrupted run would (the data must give
      the same batches in the same order); a damaged file raises before anything trains; a checkpoint that
      cannot be written warns and training goes on (the guide's "Resuming an interrupted run").
    checkpoint_every : int, optional
      Also write the checkpoint every this many optimizer updates (needs ``checkpoint``).

    Notes
    -----
    Ctrl-C and SIGTERM are held until the running batch is done: ``fit`` stops there, writes the checkpoint
    if one is configured, then lets the signal act (a second Ctrl-C stops at once, without a checkpoint).
    """
    checkpoint_every = check_fit_call(train_data, test_data, num_epoch, num_report, reset_state, shared_args,
                                      fun_after_report, batch_size, checkpoint, checkpoint_every)
    options = LoopOptions(int(num_report), reset_state, tools.DotDict({'fit': True, **(shared_args or {})}),
                          fun_after_report, None if checkpoint is None else os.fspath(checkpoint), checkpoint_every)
    FitLoop(self._loop_view(), options).fit(train_data, test_data, int(num_epoch))

  def _loop_view(self) -> LoopView:
    """The trainer as the fit loop sees it: its parts, options and the methods the loop calls."""
    settings = LoopSettings(
      accumulate_steps=self.accumulate_steps, auto=self.num_micro_batch == 'auto', on_mesh=self.mesh is not None,
      loss_has_aux=self.loss_has_aux, loss_weight_fn=self.loss_weight_fn, grad_reduction=self.grad_reduction,
      skip_nonfinite=self.skip_nonfinite, jit=dict(self.jit), show_bars=self.progress_bar)
    hooks = TrainerHooks(
      check_batch=self._check_batch, reset_state=self.reset_state, place_on_mesh=self.place_on_mesh,
      plan=self.plan_memory, replan_finer=self._replan_finer, quiet=self._quiet, bptt_loss=self._step_func_loss,
      keep_history=self._keep_history, files=RunFiles(self, self._window))
    return LoopView(target=self.target, optimizer=self.optimizer, planner=self.planner, steps=self._steps,
                    window=self._window, check=self._check, compilations=self._compiles,
                    skipped_steps=self.skipped_steps, settings=settings, hooks=hooks)

  # ------------------------------------------------------------------ plans (the planner's answers)

  def plan_memory(self, inputs: Any, targets: Any, shared_args: Optional[Dict] = None, *,
                  step_time: Optional[Callable[[Sequence[MicroBatchPlan]], Sequence[float]]] = None
                  ) -> MicroBatchPlan:
    """Choose and cache the fewest micro-batches whose compiled train step fits the budget (:attr:`planner`'s).

    Candidate micro-batch sizes are compiled ahead of time and measured with XLA's memory analysis; nothing
    runs or changes but the choice, printed and kept in :attr:`memory_plans`. With ``remat='auto'``: the
    fastest plan that fits, by trial steps that change nothing (``step_time(plans) -> seconds`` replaces
    them). Returns the batch's plan; a batch whose data does not fit beside its step streams in chunks (on a GPU
    or TPU: pieces of one micro-batch), one update per batch: the plan of a chunk, ``stream_chunks[batch_size]``.

    Raises
    ------
    ValueError
      If one sample per micro-batch does not fit either (the message gives
      the smallest budget that would).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.Sequential(bp.dyn.RNNCell(3, 16), bp.dnn.Dense(16, 2))
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch='auto', memory_budget='64KiB')
    >>> x, y = np.ones((32, 20, 3), 'float32'), np.zeros((32, 20, 2), 'float32')
    >>> plan = trainer.plan_memory(x, y)  # doctest: +ELLIPSIS
    memory plan: batch 32 = ... micro-batches), train step ... of memory_budget 64.0 KiB...
    >>> trainer.memory_plans[32][1] <= 64 * 1024
    True
    """
    return self.planner.plan(inputs, targets, fit_args(shared_args), step_time=step_time)

  def plan_for(self, batch_size: int) -> MicroBatchPlan:
    """The micro-batches that a batch of ``batch_size`` samples is cut into (:attr:`planner`'s). With
    ``num_micro_batch='auto'`` the batch size must have been planned (:meth:`plan_memory`, which :meth:`fit`
    calls on each new batch size).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=4)
    >>> trainer.plan_for(10).sizes, trainer.num_micro_batch_for(10), trainer.describe_batch(10)
    ((3, 3, 3, 1), 4, 'batch 10 = 3 x 3 + 1')
    """
    return self.planner.plan_for(batch_size)

  def num_micro_batch_for(self, batch_size: int) -> int:
    """How many micro-batches a batch of ``batch_size`` samples runs in (see :meth:`plan_for`)."""
    return self.plan_for(batch_size).num_micro_batches

  def describe_batch(self, batch_size: int) -> str:
    """How a batch of ``batch_size`` samples is cut, as the report line shows it (see :meth:`plan_for`)."""
    return self.planner.describe(batch_size)

  @property
  def memory_plans(self) -> Dict[int, Tuple[MicroBatchPlan, int]]:
    """With ``num_micro_batch='auto'``: ``{batch_size: (plan, bytes)}`` of every batch (or streamed chunk) size
    planned, the plan and its train step's memory by XLA's analysis, with the next batch where it is sent to the
    device beside the step (:attr:`planner`'s)."""
    return self.planner.memory_plans

  @property
  def stream_chunks(self) -> Dict[int, int]:
    """``{batch_size: chunk_size}`` of the batch sizes streamed from the host (see ``memory_budget``); empty when
    every batch fits with its data (:attr:`planner`'s)."""
    return self.planner.stream_chunks

  @property
  def compilations(self) -> Dict[str, int]:
    """XLA compilations so far of the train (``'fit'``) and evaluation (``'loss'``) steps run by :meth:`fit`:
    one per distinct batch shape (and, with ``accumulate_steps`` on a mesh, one more for the step that only
    collects), counted from JAX's backend-compilation events while a step is called."""
    return dict(self._compiles.counts)

  def compiled_step_bytes(self, plan: MicroBatchPlan, shared_args, inputs, targets, via_window: bool = False) -> int:
    """Memory of the train step compiled ahead of time for ``plan`` (arguments + outputs + temporaries - aliases).

    The model state enters at its current size, as :meth:`fit` leaves it before a step
    (reset at the batch size); nothing is executed and nothing changes. With a
    mesh the figure is per device.
    """
    return compiled_step_bytes(self.compile_step(inputs, targets, shared_args, plan=plan, via_window=via_window))

  def compile_step(self, inputs, targets, shared_args: Optional[Dict] = None,
                   plan: Optional[MicroBatchPlan] = None, update: bool = True, via_window: bool = False,
                   quick: bool = False):
    """The train step for this batch shape, compiled ahead of time by XLA; nothing runs, nothing changes.

    Returns JAX's compiled object (``memory_analysis()``: its memory, per device with a mesh; ``as_text()``:
    its optimised HLO). The model state enters at its current size: ``model.reset(batch_size)`` first, as
    :meth:`fit` does. ``plan`` overrides the batch's plan; ``update=False``: the step that only adds a batch to
    the ``accumulate_steps`` window; ``via_window=True``: a streamed chunk's step; ``quick=True``: XLA's code
    generation unoptimised (the same memory analysis: the planner's probes).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.Sequential(bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, 2))
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=4)
    >>> x, y = np.ones((16, 5, 3), 'float32'), np.zeros((16, 5, 2), 'float32')
    >>> model.reset(16)
    >>> compiled = trainer.compile_step(x, y)
    >>> compiled.memory_analysis().temp_size_in_bytes > 0
    True
    """
    return self._steps.compile(inputs, targets, shared_args, plan=plan, update=update, via_window=via_window,
                               quick=quick)

  def place_on_mesh(self, batch_size: Optional[int] = None) -> None:
    """Put the trainer's Variables on the mesh: model states split along their batch axis, the
    ``accumulate_steps`` window one row per device, everything else (parameters, optimizer state,
    counters, random keys) replicated. :meth:`fit` calls it before every step; without a mesh it does nothing.
    """
    if self.mesh is None:
      return
    split = split_variables(self.target, self._window, self.mesh_axis, batch_size)
    specs = {id(var): spec for var, spec in split}
    variables = list(self.vars().unique().values()) + [var for var, _ in split] + random_states(self.target)
    place([(var, specs.get(id(var), PartitionSpec())) for var in variables], self.mesh)

  def save_checkpoint(self, path: str) -> str:
    """Save parameters, model state, optimizer state (learning-rate step included), accumulation counters and
    BrainPy's global random state to ``path``, atomically (a temporary file, flushed to the disk, then renamed),
    with a SHA-256 of every part of the file that :meth:`load_checkpoint` verifies.

    A file that cannot be written raises an ``OSError`` naming ``path``; the previous checkpoint there is left
    as it was. :meth:`save_state` / :meth:`load_state` and ``state_dict`` keep their BrainPy meanings.

    Examples
    --------
    >>> import os, tempfile, brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2)
    >>> path = trainer.save_checkpoint(os.path.join(tempfile.mkdtemp(), 'run.ckpt'))
    >>> trainer.load_checkpoint(path)
    """
    return save_checkpoint(self, path, self._window)

  def load_checkpoint(self, path: str) -> None:
    """Restore what :meth:`save_checkpoint` wrote; a damaged or mismatched file raises and changes nothing.

    Every checksum of the file is verified, then its Variables are checked against the trainer's, before
    anything is assigned: a byte changed anywhere, a truncated file, another model's or optimizer's checkpoint
    raise a ``ValueError`` naming the file and the part that failed, and the trainer keeps every value it had.
    A file of the previous format (without checksums) loads with a warning.

    Examples
    --------
    >>> import os, pathlib, tempfile, brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2)
    >>> path = pathlib.Path(trainer.save_checkpoint(os.path.join(tempfile.mkdtemp(), 'run.ckpt')))
    >>> damaged = bytearray(path.read_bytes())
    >>> damaged[-1] ^= 1  # one bit of the last array, BrainPy's random key
    >>> _ = path.write_bytes(bytes(damaged))
    >>> trainer.load_checkpoint(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: Checkpoint path=... is damaged: random variable default ... Nothing was loaded.
    """
    load_checkpoint(self, path, self._window)

  # ------------------------------------------------------------------ bp.BPTT's hooks

  @property
  def f_train(self):
    """The micro-batched train step (jitted unless ``jit`` says otherwise)."""
    return self._steps.jitted('fit')

  @property
  def f_loss(self):
    """The micro-batched evaluation step (jitted unless ``jit`` says otherwise)."""
    return self._steps.jitted('loss')

  def predict(self, inputs: Any, reset_state: bool = False, shared_args: Optional[Dict] = None,
              eval_time: bool = False):
    """:meth:`brainpy.BPTT.predict`; without its per-time-step progress bar where its host callback could not run:
    JAX has no CPU backend (``JAX_PLATFORMS=tpu``), or ``fit`` laid the parameters over a mesh's devices."""
    with contextlib.nullcontext() if not self.progress_bar or progress_bars_run(self._variables()) else self._quiet():
      return super().predict(inputs, reset_state=reset_state, shared_args=shared_args, eval_time=eval_time)

  @restores_shared_env  # the time step's bp.share.save(i=..., t=..., **shared_args) holds tracers: gone at its end
  def _step_func_predict(self, *args, **kwargs):
    return super()._step_func_predict(*args, **kwargs)

  def _fun_predict(self, indices, *inputs, shared_args=None):
    plain = super()._fun_predict
    if self._memory_efficient:
      return plain(indices, *inputs, shared_args=shared_args)
    return self._model.over_time(plain, indices, inputs, shared_args)

  # ------------------------------------------------------------------ what the parts are handed

  def _check_batch(self, inputs: Any, targets: Any) -> BatchLayout:
    """Check one batch and return its layout (:func:`~brainpy_accum.core._batch.batch_layout`); raises
    ``ValueError`` before anything changes."""
    layout = batch_layout(inputs, targets, self.data_first_axis, self.target_batch_axis,
                          resolve=functools.partial(self._target_axes, inputs, targets))
    self.planner.share_size(layout.batch_size)
    return layout

  def _time_steps_of(self, xs) -> int:
    return self._get_input_time_step(xs=xs)

  def _time_origin(self):
    return self.i0  # bp.BPTT's running step counter, read when a step is traced

  def _variables(self) -> list:
    """Every Variable a step reads or writes, random states included."""
    return list(self.vars().unique().values()) + random_states(self.target)

  def _argument_bytes(self, inputs, targets) -> int:
    return argument_bytes(self._variables(), inputs, targets)

  def _fixed_bytes(self, inputs, targets) -> int:
    return fixed_bytes_at_least(self._variables(), list(self.target.train_vars().unique().values()),
                                self.optimizer.vars().unique().values(), inputs, targets)

  def _ahead_bytes(self, inputs, targets) -> int:
    """Device bytes of the next batch, sent while a step of this one runs (:mod:`~brainpy_accum.trainer._feed`)."""
    return prefetch_bytes(inputs, targets) if self.mesh is None and sends_ahead() else 0

  def _replan_finer(self, batch_size: int, error: BaseException, inputs, targets, shared_args) -> str:
    """After the device ran out of memory: the planner's finer cut of ``batch_size``; the steps trace anew. A
    fixed cut whose step the device refused to compile is the user's to change: the error that says to what."""
    if self.num_micro_batch != 'auto' and is_refused_program(error):
      raise self.planner.refusal(error, inputs, targets, shared_args) from None
    change = self.planner.finer(batch_size)
    self._steps.rebuild()
    return change

  def _plan_key(self, shared_args, inputs, targets, via_window: bool, budget: int) -> dict:
    """The plan cache's key of a batch: the model, loss, options and batch (:mod:`~brainpy_accum.memory._plan_key`)."""
    options = {name: getattr(self, name) for name in ('remat', 'grad_reduction', 'whole_batch_loss', 'clip_grad_norm',
                                                     'skip_nonfinite', 'data_first_axis', 'target_batch_axis',
                                                     'loss_has_aux')}
    options.update(memory_budget=budget, accumulate_steps=repr(self.accumulate_steps), via_window=via_window,
                   aux_reduction=sorted(self.aux_reduction.items()), optimizer=type(self.optimizer).__qualname__,
                   jit=repr(dict(self.jit)))
    return plan_key(self.target, self.vars().unique().values(), (self._loss_func, self.loss_weight_fn), options,
                    shared_args, inputs, targets)

  def _keep_history(self, report_train, detailed_train, report_test, detailed_test) -> None:
    """The metric history the fit loop recorded, where bp.BPTT keeps it (its ``get_hist_metric`` reads it)."""
    self._report_train_metrics, self._detailed_train_metrics = report_train, detailed_train
    self._report_test_metrics, self._detailed_test_metrics = report_test, detailed_test

  @contextlib.contextmanager
  def _quiet(self):
    """Trace steps without bp.BPTT's per-time-step progress bars (host callbacks inside the compiled step)."""
    shown, self.progress_bar = self.progress_bar, False
    try:
      yield
    finally:
      self.progress_bar = shown
