"""``AccumBPTT``: :class:`brainpy.BPTT` with gradient accumulation over micro-batches inside one compiled step.

The class is a thin client: the step of one batch is :mod:`~brainpy_accum.trainer._step` (built on the core's
:func:`~brainpy_accum.core.accumulate`; on a mesh wrapped by :mod:`~brainpy_accum.trainer._sharded`), the
two-pass mode :mod:`~brainpy_accum.core._two_pass`, the default mode's loss check
:mod:`~brainpy_accum.trainer._coupled_loss`, the epochs :mod:`~brainpy_accum.trainer._fit_loop`, plans per
batch size :mod:`~brainpy_accum.trainer._plans`, checkpoints :mod:`brainpy_accum.checkpoint`. This class hands
each of them what it calls (the loop's :class:`~brainpy_accum.trainer._fit_loop.TrainerParts`, the planner's
:class:`~brainpy_accum.trainer._plans.Compilers`, the checkpoint's window): none of them reads its private
attributes.
"""

import contextlib
import functools
import os
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import brainpy as bp
import brainpy.math as bm
import brainstate
import brainstate.environ
import jax
import jax.numpy as jnp
from brainpy import tools
from jax.sharding import Mesh, PartitionSpec
from brainpy.running import constants as c

from ..checkpoint._save_load import load as load_checkpoint
from ..checkpoint._save_load import save as save_checkpoint
from ..core._combine import same_type
from ..core._cut import MicroBatchPlan, as_int, plan_micro_batches
from ..core._metrics import WHOLE_METRICS, MetricPlan, check_aux_reduction, metric_plan_of
from ..core._mesh import auto_axes, check_mesh, place, random_states
from ..core._states import values_restored, whole_batch_variables
from ..core._shapes import traced_shapes
from ..core._two_pass import Devices, two_pass_sums
from ..diagnostics._compiles import QUICK_COMPILE, Compilations
from ..memory._budget import StepMemory, compiled_step_bytes, parse_memory, step_memory
from ..memory._cache import PlanCache, cache_folder, use_compilation_cache
from ..memory._live import temp_bytes_at_least
from ._arguments import (check_accumulation_args, check_remat, check_update_args, check_whole_batch_loss,
                         warn_batch_statistics)
from ._coupled_loss import MEANS_OVER_ELEMENTS, check_first_batch
from ._fit_loop import TrainerParts
from ._fit_loop import fit as run_fit
from ._model_loss import ModelLoss
from ._plans import Compilers, PlannedStep, Planning
from ._sharded import on_mesh
from ._step import Settled, batch_sums, micro_step, same, settle
from ._update import clip_by_global_norm, guarded_update
from ._window import GradWindow, check_accumulate_steps

__all__ = ['AccumBPTT']



class AccumBPTT(Planning, ModelLoss, Compilations, bp.BPTT):
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
    Cut each batch into at most this many micro-batches of
    ``ceil(batch_size / num_micro_batch)`` samples. Give this or ``micro_batch_size``;
    with neither, each batch runs whole (``1``), exactly as in :class:`brainpy.BPTT`.
    ``'auto'`` picks, for each batch size, the fewest micro-batches whose
    compiled train step fits ``memory_budget`` (see :meth:`plan_memory`);
    with ``remat='auto'`` as well, the fastest (micro-batches, remat) plan
    that fits instead.
  micro_batch_size : int, optional
    Cut each batch into micro-batches of this many samples (the last one may
    be shorter). Give this or ``num_micro_batch``.
  grad_reduction : {'mean', 'sum'}
    ``'mean'`` (default) weights each micro-batch by its sample count and
    divides by the batch size: the right choice for losses that average over
    samples. ``'sum'`` adds the micro-batch gradients, losses and metrics: the
    right choice for losses that sum over samples.
  target_batch_axis : int, optional
    The batch axis of every target leaf. By default it follows
    ``data_first_axis`` (axis 0 for ``'B'``, axis 1 for ``'T'``) and falls back
    to axis 0 for leaves whose preferred axis does not hold the batch.
  memory_budget : int or str, optional
    With ``num_micro_batch='auto'``: bytes, or a string like ``'512MiB'`` or ``'2GiB'``.
    A batch whose data does not fit beside its step even at one sample per
    micro-batch is streamed from the host in chunks that fit, still with one
    optimizer update per batch (no mesh, default loss mode; :attr:`stream_chunks`).
  accumulate_steps : int or dict
    Also accumulate across batches: one optimizer update every ``k`` batches
    of the data iterator (and at the last batch of each epoch), weighted by
    what each batch held, so ``k`` batches of ``b`` samples give the update of
    one batch of ``k * b``. A dict ``{first_epoch: k}`` changes ``k`` by epoch
    (``{0: 1, 5: 4}``). The running sums live in Variables on the device.
  loss_weight_fn : callable, optional
    ``loss_weight_fn(inputs, targets) -> weight`` of a (micro-)batch, for
    losses normalised by something other than the sample count, e.g. the
    number of valid time steps of a masked loss. Each micro-batch's gradient
    is weighted by it and the total divided by the batch's total weight: the
    gradient of the whole batch's normalised loss. ``'mean'`` only.
  clip_grad_norm : float, optional
    Clip the combined gradient (after all micro-batches and batches of an
    update) to this global L2 norm, once per optimizer update.
  skip_nonfinite : bool
    Skip an update whose gradient holds a NaN or an infinity: parameters,
    optimizer state and the learning-rate step stay exactly as before, the
    skip is counted in :attr:`skipped_steps` and shown in the report line.
    With ``accumulate_steps`` a non-finite batch is left out of its window
    (and counted); the rest of the window still makes its update.
  remat : bool or int
    Rematerialise over time: ``True`` checkpoints the time loop every
    ``round(sqrt(T))`` steps, an int every that many steps, so that the
    backward pass keeps one model state per segment instead of every step's
    activations (about one extra forward pass of compute; same gradients).
    ``False`` (default) stores every step, as :class:`brainpy.BPTT` does.
    ``'auto'`` (with ``num_micro_batch='auto'`` and ``memory_budget``) lets
    the planner choose per batch size between remat and more micro-batches:
    it compiles the candidates, times a few trial steps of each that fits
    (changing nothing), prints them, and keeps the fastest.
  mesh : jax.sharding.Mesh, optional
    Data parallelism: every batch is split along its batch axis over the
    devices of ``mesh_axis`` (contiguous shares of ``batch_size / D``
    samples), each device runs its own micro-batch loop on its share, and
    the devices' gradient sums are added once per train step, not once per
    micro-batch. Parameters and optimizer state are replicated. The
    micro-batch options then describe each device's share: with
    ``num_micro_batch=N`` each device runs ``N`` micro-batches of
    ``batch_size / (D N)`` samples, and ``memory_budget`` is per device.
    Batch sizes must be multiples of ``D``. For several hosts, call
    :func:`jax.distributed.initialize` first and build the mesh from
    :func:`jax.devices` (all hosts' devices); every process runs the same
    :meth:`fit` on the same batches. Without a mesh nothing changes.
  mesh_axis : str, optional
    The mesh axis that splits the batch; needed only when the mesh has more
    than one axis (the others then hold replicas).
  whole_batch_loss : bool
    ``False`` (default): each micro-batch's loss is its own, and the combined
    gradient is exact for losses that are a (weighted) mean or sum of
    per-sample terms. At the first batch :meth:`fit` checks once, evaluating
    ``loss_fun`` at random outputs (the model is not run; i.i.d. values, and
    each micro-batch at a level of its own so that batch-wide means and
    norms differ), whether the loss and its gradient with respect to the
    outputs are such a mean's, and warns, with the measured difference, if
    they are not. ``True``: exact for ANY loss of the
    whole batch's predictions and monitors (batch-wide firing-rate
    regularisers, batch statistics, maxima, contrastive terms), by two
    passes inside the one compiled step: every micro-batch runs forward
    keeping only its predictions, ``loss_fun`` runs once on the whole
    batch's predictions and gives their gradient, then every micro-batch
    runs forward and backward again from the same initial state and random
    numbers, pulling back its slice of that gradient. Memory: the whole
    batch's predictions plus one micro-batch's activations; compute: about
    one extra forward pass. It combines with ``remat``, ``clip_grad_norm``,
    ``skip_nonfinite``, the memory planner and ``mesh`` (outputs gathered
    over the devices, one gradient all-reduce), but not with
    ``accumulate_steps > 1`` (the loss of several batches together is not
    known from their separate losses), ``grad_reduction='sum'`` or
    ``loss_weight_fn`` (the loss itself normalises).
  aux_reduction : dict, optional
    With ``loss_has_aux=True``: how scalar metrics combine over micro-batches
    (and devices, and streamed chunks), by metric name: ``'mean'``, ``'sum'``
    (counts; integer dtypes kept), ``'max'`` or ``'min'``, e.g.
    ``{'max_rate': 'max', 'n_correct': 'sum'}``. A declaration always wins.
    Undeclared scalar metrics get, in the default mode, the one of the four
    that the first batch's check finds to give the whole batch's value from
    the micro-batches' values at random outputs (before the first step is
    traced); where none or several do (a metric constant there), they
    combine like the loss (weighted mean; a sum with
    ``grad_reduction='sum'``) and it warns, naming the metric. Per-sample
    metrics, arrays whose shape holds the batch (``(B,)``, ``(B, T)``,
    ``(T, B, ...)``), need no declaration: they are stitched along their
    batch axis into the whole batch's array, as :class:`brainpy.BPTT`
    records them. A declared scalar metric whose combination differs from
    its whole-batch value at the first batch warns too.
  cache : bool, str or os.PathLike
    Caches that make a rerun of the same script start fast: JAX's
    persistent compilation cache (in ``<folder>/jax``, only if JAX has no
    cache folder yet: ``JAX_COMPILATION_CACHE_DIR`` or ``jax.config`` are
    kept) and, with ``num_micro_batch='auto'``, the memory planner's plans
    (``<folder>/plans``, keyed by the model, batch, options, versions and
    device; a cached plan's step is compiled and measured again, never
    trusted). ``True`` (default): the folder ``BRAINPY_ACCUM_CACHE_DIR``, else
    ``~/.cache/brainpy_accum``, none if ``BRAINPY_ACCUM_CACHE=0``; ``False``:
    no caches; a path: that folder.
  **kwargs
    Any other :class:`brainpy.BPTT` argument (``loss_has_aux``, ``monitors``,
    ``jit``, ``data_first_axis``, ``progress_bar``, ...).

  Attributes
  ----------
  trace_counts : dict
    How many times the train step (``'fit'``) and the evaluation step
    (``'loss'``) were traced: one per distinct batch shape when jitted.
    :attr:`compilations` counts the XLA executables behind them.
  stream_chunks : dict
    ``{batch_size: chunk_size}`` of the batch sizes streamed from the host
    (see ``memory_budget``); empty when every batch fits with its data.

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
    if remat == 'auto' and mesh is not None:
      raise ValueError("remat='auto' is not supported with a mesh (its trial steps run unsharded): choose remat=True "
                       "or False with mesh=..., or drop the mesh.")
    check_whole_batch_loss(whole_batch_loss, grad_reduction, loss_weight_fn, accumulate_steps)
    if num_micro_batch is None and micro_batch_size is None:
      num_micro_batch = 1  # no option: bp.BPTT's whole-batch step
    check_accumulation_args(num_micro_batch, micro_batch_size, grad_reduction, target_batch_axis, memory_budget)
    check_remat(remat, num_micro_batch, memory_budget)
    check_update_args(grad_reduction, loss_weight_fn, clip_grad_norm, skip_nonfinite)
    self.accumulate_steps = check_accumulate_steps(accumulate_steps)
    self.aux_reduction = check_aux_reduction(aux_reduction)
    if self.aux_reduction and not kwargs.get('loss_has_aux', False):
      raise ValueError(f'{aux_reduction=} declares how metrics combine, but there are none without '
                       f'loss_has_aux=True (loss_fun returning (loss, dict of metrics)). Pass loss_has_aux=True or '
                       f'drop aux_reduction.')
    super().__init__(target, loss_fun, optimizer=optimizer, **kwargs)
    self._metric_rules: Optional[MetricPlan] = None  # the last traced step's, for combining streamed chunks
    self._metric_plans: Dict[tuple, MetricPlan] = {}  # per plan and batch shape
    self._found_reductions: Dict[str, str] = {}  # undeclared scalar metrics' reductions, found by the loss check
    self.num_micro_batch, self.micro_batch_size, self.grad_reduction = num_micro_batch, micro_batch_size, grad_reduction
    self.target_batch_axis, self.remat, self.loss_weight_fn = target_batch_axis, remat, loss_weight_fn
    self.memory_budget = None if memory_budget is None else parse_memory(memory_budget)
    self.memory_plans: Dict[int, Tuple[MicroBatchPlan, int]] = {}
    self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
    self.skip_nonfinite, self.whole_batch_loss, self._loss_checked = skip_nonfinite, whole_batch_loss, whole_batch_loss
    self._check_running: Optional[Callable[..., None]] = None  # the first-batch check's finish(), once started
    self.mesh = None if mesh is None else auto_axes(mesh)
    self.cache_folder = folder
    if self.cache_folder is not None:
      use_compilation_cache(self.cache_folder)
    self._plan_cache = PlanCache(self.cache_folder) if self.cache_folder and num_micro_batch == 'auto' else None
    self._init_steps()
    warn_batch_statistics(self.target)

  def _init_steps(self) -> None:
    """The counters, the ``accumulate_steps`` window and the jitted steps besides bp.BPTT's train step."""
    self.skipped_steps = bm.Variable(jnp.zeros((), jnp.int32))
    copies = None if self.mesh is None else self.num_devices
    self._window = GradWindow(self.target.train_vars().unique(), copies) if self._needs_window else None
    self.stream_chunks: Dict[int, int] = {}  # batch sizes streamed from the host, and their chunk size
    self.trace_counts = {'fit': 0, 'loss': 0}
    self._jit_steps()

  def _jit_steps(self) -> None:
    """Fresh jitted steps (bp.BPTT's train step too): they trace again, with the current plans."""
    self._jit_step_func_fit = bm.jit(self._step_func_fit, static_argnums=(0,))
    self._jit_step_func_eval = bm.jit(self._step_func_eval, static_argnums=(0,))
    self._jit_step_func_collect = bm.jit(self._step_func_collect, static_argnums=(0,))
    self._jit_step_func_close = bm.jit(self._step_func_close, static_argnums=(0,))
    # (kind, batch size) -> the planner's compiled step, which fit runs: 'fit', or 'close' (a streamed batch's
    # last chunk, whose step is the one the planner compiles for a chunk)
    self._kept_steps: Dict[Tuple[str, int], Any] = {}

  @property
  def _needs_window(self) -> bool:
    """Running sums between steps: for ``accumulate_steps``, or for streaming batches larger than the device."""
    return self.accumulate_steps != 1 or self._may_stream

  @property
  def _may_stream(self) -> bool:
    return self.num_micro_batch == 'auto' and self.memory_budget is not None and self.mesh is None \
        and not self.whole_batch_loss

  def __repr__(self):
    return (f'{self.__class__.__name__}(target={self.target}, num_micro_batch={self.num_micro_batch}, '
            f'micro_batch_size={self.micro_batch_size}, grad_reduction={self.grad_reduction!r}, '
            f'optimizer={self.optimizer})')

  def fit(
      self,
      train_data: Union[Callable, Iterable],
      test_data: Optional[Union[Callable, Iterable]] = None,
      num_epoch: int = 100,
      num_report: int = -1,
      reset_state: bool = True,
      shared_args: Optional[Dict] = None,
      fun_after_report: Optional[Callable] = None,
      batch_size: None = None,
      checkpoint: Optional[Union[str, os.PathLike]] = None,
      checkpoint_every: Optional[int] = None,
  ) -> None:
    """Train on ``train_data`` for ``num_epoch`` epochs, one optimizer update per batch.

    The arguments and the recorded metrics are those of
    :meth:`brainpy.BPTT.fit`; every batch is micro-batched, and so is the
    evaluation on ``test_data``.

    Parameters
    ----------
    train_data : iterable or callable
      Batches ``(inputs, targets)``, or a function returning such an iterable
      (called once per epoch).
    test_data : iterable or callable, optional
      Evaluation batches, run after each training epoch.
    num_epoch : int
      Number of passes over ``train_data``.
    num_report : int
      ``-1`` reports once per epoch; ``k > 0`` every ``k`` batches.
    reset_state : bool
      Reset the model state at the batch size before each batch. With
      ``False`` each sample keeps its model state from the previous batch
      (truncated BPTT over consecutive chunks).
    shared_args : dict, optional
      Shared arguments for the model; ``fit`` is set to ``True`` unless given.
    fun_after_report : callable, optional
      Called as ``fun_after_report(idx, metrics, phase)`` after each report.
    batch_size : None
      Removed from :class:`brainpy.BPTT`: give batches in the data. Anything
      but ``None`` raises, as in BrainPy (an instance of its ``NoLongerSupportError``).
    checkpoint : str or os.PathLike, optional
      A file for checkpoints of the run (:meth:`save_checkpoint`'s content plus where the run stands
      and its metric history), written atomically at each epoch's end and every ``checkpoint_every``
      updates. If the file exists when ``fit`` starts, the run resumes from it: the same call run
      again after a crash, a killed job or Ctrl-C skips the epochs and batches already trained and
      ends as an uninterrupted run would (same parameters, optimizer and learning-rate step, random
      state, ``accumulate_steps`` window, losses and history). The data must give the same batches
      in the same order when run again (a list, or a function that shuffles with a seed per epoch).
      A larger ``num_epoch`` continues a finished run.
    checkpoint_every : int, optional
      Also write the checkpoint every this many optimizer updates (needs ``checkpoint``).

    Notes
    -----
    Ctrl-C (SIGINT) and SIGTERM during ``fit`` are held until the running batch is done: ``fit``
    then stops with the trainer at its last completed batch and a consistent history, writes the
    checkpoint if one is configured, and lets the signal act through the handler that was there before
    (Python's raises KeyboardInterrupt; SIGTERM's default ends the process; one that returns ends ``fit``).
    An ignored signal stays ignored. A second Ctrl-C stops at once, without a checkpoint.
    """
    parts = TrainerParts(check_batch=self._check_batch, place_on_mesh=self.place_on_mesh,
                         check_loss_once=self._check_loss_once,
                         replan_finer=functools.partial(self._replan_finer, rebuild=self._jit_steps),
                         note_compilations=self._note_compilations, step=self._step_of,
                         without_time_step_bars=self._without_time_step_bars, window=self._window,
                         metric_plan=lambda: self._metric_rules, plan_cached=self._plan_cached)
    run_fit(self, parts, train_data, test_data, num_epoch, num_report, reset_state, shared_args, fun_after_report,
            batch_size, checkpoint, checkpoint_every)

  def _check_loss_once(self, shared_args, inputs, targets, before_planning: bool = False, streamed: bool = False
                       ) -> Optional[Callable[[], Optional[Callable[..., None]]]]:
    """Default mode, first batch: warn if the loss is not the weighted mean of its micro-batch values (once).

    A model that fails on a micro-batch raises now (the error that names the fix). Returns ``start()``, or
    ``None`` where there is nothing to check: ``start()`` checks the loss, on the values the Variables hold
    then (fit calls it once the first step is dispatched, so that the check's tracing overlaps the step's run;
    nothing the check computes depends on those values), and returns ``finish()`` for fit to call after the
    first step when the check runs beside it, else ``None``.
    ``before_planning`` (``num_micro_batch='auto'``, a batch not planned yet): cut in two, so that it can start
    before planning and compile beside the planner's search (its cut does not wait for the plan, and is the same
    whether the plan is searched or read from the plan cache); only where it can (jit, no mesh, the batch's data
    well within the budget), else ``None`` and fit checks the planned cut, beside the first step as usual.
    ``streamed``: ``inputs, targets`` are samples of a streamed batch, whose chunks combine like micro-batches:
    cut in two where their plan would not cut them.
    """
    if self._loss_checked:
      return None
    layout = self._check_batch(inputs, targets)
    if before_planning:
      if (layout.batch_size < 2 or self.mesh is not None or not self.jit[c.FIT_PHASE]
          or layout.batch_size in self.memory_plans or 2 * self._argument_bytes(inputs, targets) > self.memory_budget):
        return None
      plan = plan_micro_batches(layout.batch_size, num_micro_batch=2)
    elif streamed:
      plan = self._finer_plans.get(layout.batch_size) or self.memory_plans.get(layout.batch_size, (None,))[0]
      if plan is None or plan.num_micro_batches == 1:
        plan = plan_micro_batches(layout.batch_size, num_micro_batch=2)
    else:
      plan = self.plan_for(layout.batch_size)
    self._loss_checked = True
    if plan.num_micro_batches > 1:  # a model that fails on a micro-batch: the error that names the fix, first
      with whole_batch_variables(self.target, layout.batch_size) as states, values_restored([var for var, _ in states]):
        self._check_flat_states(shared_args, (inputs, targets), jax.tree_util.tree_leaves(
          (layout.input_axes, layout.target_axes)), plan, states, layout.batch_size)
    if self._loss_func in MEANS_OVER_ELEMENTS and not self.loss_has_aux and self.loss_weight_fn is None \
        and self.grad_reduction == 'mean':
      return None  # a mean over every element is a mean over samples: nothing to check (see _coupled_loss)

    def start() -> Optional[Callable[..., None]]:
      variables = list(self.vars().unique().values()) + random_states(self.target)
      with self._without_time_step_bars():
        finish = check_first_batch(self.target, shared_args, inputs, targets, check_batch=self._check_batch,
                                   plan=plan, forward=self._forward, loss_of=self._loss_of,
                                   weigh=self._weigh, variables=variables, jit=self.jit[c.FIT_PHASE],
                                   reduction=self.grad_reduction, declared=self.aux_reduction,
                                   has_metrics=self.loss_has_aux, use_found=self._use_found_reductions)
      self._check_running = finish  # the planner waits for it before timing trial steps
      return finish

    if self.loss_has_aux:  # it finds how undeclared metrics combine: started before any step is traced
      finish = start()
      return lambda: finish
    return start

  def _use_found_reductions(self, found: Dict[str, str]) -> None:
    """The first-batch check found how undeclared metrics combine: steps traced before with other rules (the
    planner's, when the check could not run before it) are traced again."""
    if self._metric_plans:
      self._metric_plans.clear()
      self._jit_steps()
    self._found_reductions.update(found)

  # ------------------------------------------------------------------ placement, plans, checkpoints

  def place_on_mesh(self, batch_size: Optional[int] = None) -> None:
    """Put the trainer's Variables on the mesh: model states split along their batch axis, the
    ``accumulate_steps`` window one row per device, everything else (parameters, optimizer state,
    counters, random keys) replicated. :meth:`fit` calls it before every step; without a mesh it does nothing.
    """
    if self.mesh is None:
      return
    split = self._split_variables(self._window, batch_size)
    specs = {id(var): spec for var, spec in split}
    variables = list(self.vars().unique().values()) + [var for var, _ in split] + random_states(self.target)
    place([(var, specs.get(id(var), PartitionSpec())) for var in variables], self.mesh)

  def plan_memory(self, inputs: Any, targets: Any, shared_args: Optional[Dict] = None, *,
                  step_time: Optional[Callable[[Sequence[MicroBatchPlan]], Sequence[float]]] = None
                  ) -> MicroBatchPlan:
    """Choose and cache the fewest micro-batches whose compiled train step fits ``memory_budget``.

    Each candidate micro-batch size is compiled ahead of time and measured
    with XLA's memory analysis; no step runs and nothing changes but the
    cached choice, which is printed and kept in :attr:`memory_plans` as
    ``{batch_size: (plan, bytes)}``.

    With ``remat='auto'`` the choice is the fastest plan that fits instead:
    for remat off and remat every ``sqrt(T)`` steps, the largest micro-batch
    that fits and two finer cuts are compiled, and the fitting ones are timed
    with trial steps on this batch (the compiled step run on the current
    Variable values, its results discarded: no Variable or random key
    changes). The candidates and the reason are printed; the plan's
    :attr:`~MicroBatchPlan.remat` is used when the step is traced.
    ``step_time(plans) -> seconds`` replaces the trial steps (e.g. a cost model).

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
    memory plan: batch 32 = ... micro-batches), train step ... of memory_budget 64.0 KiB
    >>> trainer.memory_plans[32][1] <= 64 * 1024
    True
    """
    shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
    return self._plan_memory(inputs, targets, shared_args, step_time, self._compilers(), self._may_stream)

  def _compilers(self) -> Compilers:
    return Compilers(self._probe_memory, self._planned_step, self._keepable, self._bytes_at_least)

  def _plan_streamed_chunk(self, inputs, targets, shared_args: Optional[Dict] = None) -> MicroBatchPlan:
    """Plan a streamed batch's chunk: the shorter last one has a plan of its own, for its step through the window
    (the step fit runs for it, and keeps from planning)."""
    shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
    return self._plan_memory(inputs, targets, shared_args, None, self._compilers(), may_stream=False, via_window=True)

  def _probe_memory(self, plan: MicroBatchPlan, shared_args, inputs, targets, via_window: bool = False) -> StepMemory:
    """The planner's quick probe: the step's memory, compiled without optimising its code."""
    return step_memory(self.compile_step(inputs, targets, shared_args, plan=plan, via_window=via_window, quick=True))

  def _bytes_at_least(self, plan: MicroBatchPlan, shared_args, inputs, targets, via_window: bool = False) -> int:
    """A lower bound of the step's memory for ``plan``, from its trace alone (no compilation): the fixed bytes
    known by arithmetic and the temporaries that its jaxpr's loops must hold (:mod:`~brainpy_accum.memory._live`).
    0 on a mesh, where the figures are per device."""
    if self.mesh is not None:
      return 0
    with self._step_for(plan, via_window=via_window) as step:
      jaxpr = step.stateful_fun.get_jaxpr(shared_args, inputs, targets)
    return self._fixed_bytes_at_least(inputs, targets) + temp_bytes_at_least(jaxpr)

  def _keepable(self, via_window: bool) -> bool:
    """Whether fit can run the planner's compiled step itself, jitted, without a mesh or an ``accumulate_steps``
    window: the train step, or through the window (``via_window``) the step of a streamed batch's last chunk."""
    return self.accumulate_steps == 1 and self.mesh is None and bool(self.jit[c.FIT_PHASE])

  def _planned_step(self, plan: MicroBatchPlan, shared_args, inputs, targets, via_window: bool = False) -> PlannedStep:
    """The train step compiled for ``plan`` as fit runs it; its ``keep()`` makes fit run this executable for the
    batch size, so that the planner's compilation is the training's (no second one)."""
    batch_size = self._check_batch(inputs, targets).batch_size
    shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
    step = None

    def traced(shared_args, inputs, targets):
      if any(kept is step for kept in self._kept_steps.values()):  # a retrace of a kept step counts as fit's
        self.trace_counts['fit'] += 1
      return self._train_step(shared_args, inputs, targets, plan=plan, via_window=via_window)

    step = bm.jit(traced, static_argnums=(0,))
    with self._without_time_step_bars(), self._tracing(plan), brainstate.environ.context(fit=True):
      compiled = step.compile(shared_args, inputs, targets)  # the jit's own call runs this executable
      values = step.stateful_fun.get_state_trace(shared_args, inputs, targets).get_state_values()

    def keep():
      if self._keepable(via_window):
        self._kept_steps['close' if via_window else 'fit', batch_size] = step
        self.trace_counts['fit'] += 1  # its trace and compilation are fit's: fit will not repeat them
        self._note_compilations(c.FIT_PHASE, 1)

    return PlannedStep(step_memory(compiled), lambda: jax.block_until_ready(compiled(values, inputs, targets)), keep)

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

    Returns JAX's compiled object: ``memory_analysis()`` gives its memory
    (per device with a mesh), ``as_text()`` its optimised HLO, e.g. to count
    the cross-device reductions (``all-reduce``) of a sharded step. The model
    state enters at its current size: call ``model.reset(batch_size)`` first,
    as :meth:`fit` does. ``plan`` overrides the trainer's micro-batch plan;
    ``update=False`` compiles the step that only adds a batch to the
    ``accumulate_steps`` window (``update=True`` through the window without a
    mesh: the step fit runs for both, which updates where the window's flag
    says); ``via_window=True`` the step that passes its
    gradient through the window (that of a streamed batch's last chunk).
    ``quick=True`` leaves XLA's code generation unoptimised: faster to compile,
    slower to run, with the same memory analysis (the planner's probes).

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
    shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
    with self._step_for(plan, update=update, via_window=via_window) as step:
      return step.lower(shared_args, inputs, targets).compile(compiler_options=QUICK_COMPILE if quick else None)

  def compile_trial(self, inputs, targets, shared_args: Optional[Dict] = None, *, plan: MicroBatchPlan):
    """``(compiled, run)``: the train step compiled for ``plan``, and ``run()``, a trial of it that changes nothing.

    ``run()`` calls the executable on the current Variable values and drops its new values, so that nothing
    (parameters, optimizer, random keys) changes: the trial steps that ``remat='auto'`` times, for timing plans
    outside :meth:`plan_memory` (as ``python -m brainpy_accum.bench.planner`` does).
    """
    shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
    with self._step_for(plan) as step:
      values = step.stateful_fun.get_state_trace(shared_args, inputs, targets, compile_if_miss=True).get_state_values()
      compiled = step.jitted_fun.lower(values, shared_args, inputs, targets).compile()
    return compiled, lambda: jax.block_until_ready(compiled(values, inputs, targets))

  @contextlib.contextmanager
  def _step_for(self, plan: Optional[MicroBatchPlan], update: bool = True, via_window: bool = False):
    """The train step for ``plan``, jitted on its own (not fit's), to trace, lower or compile inside the
    ``with``: the context its trace needs (no time-step bars, the plan's tracing)."""
    step = bm.jit(functools.partial(self._train_step, plan=plan, update=update, via_window=via_window),
                  static_argnums=(0,))
    with self._without_time_step_bars(), self._tracing(plan):
      yield step

  @contextlib.contextmanager
  def _without_time_step_bars(self):
    """Trace steps without bp.BPTT's per-time-step progress bars (host callbacks inside the compiled step)."""
    shown, self.progress_bar = self.progress_bar, False
    try:
      yield
    finally:
      self.progress_bar = shown

  def save_checkpoint(self, path: str) -> str:
    """Save parameters, model state, optimizer state (learning-rate step included), accumulation counters and
    BrainPy's global random state to ``path``, atomically (temporary file, then rename).

    :meth:`save_state` / :meth:`load_state` and ``state_dict`` keep their BrainPy meanings.

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
    """Restore what :meth:`save_checkpoint` wrote; a corrupt or mismatched file raises and changes nothing.

    Examples
    --------
    >>> import os, tempfile, brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2)
    >>> trainer.load_checkpoint(os.path.join(tempfile.mkdtemp(), 'missing.ckpt'))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    FileNotFoundError: No checkpoint at path=...
    """
    load_checkpoint(self, path, self._window)

  # ------------------------------------------------------------------ compiled steps

  def _step_of(self, kind: str):
    """The compiled step that the fit loop runs: ``'loss'``, ``'fit'``, ``'collect'`` or ``'close'``."""
    steps = {'loss': self.f_loss, 'fit': self.f_train, 'collect': self._f_collect, 'close': self._f_close}
    if any(kept == kind for kept, _ in self._kept_steps):
      return functools.partial(self._kept_or_jitted, kind, steps[kind])
    return steps[kind]

  def _kept_or_jitted(self, kind: str, jitted, shared_args, inputs, targets):
    """The ``kind`` step: the planner's compiled one for this batch size if it kept one, else ``jitted``."""
    step = self._kept_steps.get((kind, self._check_batch(inputs, targets).batch_size), jitted)
    return step(shared_args, inputs, targets)

  @property
  def f_loss(self):
    """The micro-batched evaluation step (jitted unless ``jit`` says otherwise)."""
    return self._jit_step_func_eval if self.jit[c.LOSS_PHASE] else self._step_func_eval

  @property
  def _f_collect(self):
    """The train step that adds a batch to the ``accumulate_steps`` window without updating."""
    return self._jit_step_func_collect if self.jit[c.FIT_PHASE] else self._step_func_collect

  def _step_func_fit(self, shared_args, inputs, targets):
    self.trace_counts['fit'] += 1
    return self._train_step(shared_args, inputs, targets)

  @property
  def _f_close(self):
    """The train step that adds a batch's last streamed chunk to the window and updates from the window."""
    return self._jit_step_func_close if self.jit[c.FIT_PHASE] else self._step_func_close

  def _step_func_collect(self, shared_args, inputs, targets):
    self.trace_counts['fit'] += 1
    return self._train_step(shared_args, inputs, targets, update=False, via_window=True)

  def _step_func_close(self, shared_args, inputs, targets):
    self.trace_counts['fit'] += 1
    return self._train_step(shared_args, inputs, targets, via_window=True)

  def _step_func_eval(self, shared_args, inputs, targets):
    self.trace_counts['loss'] += 1
    done = self._run_batch(shared_args, inputs, targets, with_grads=False)
    return (done.loss, done.aux) if self.loss_has_aux else done.loss

  def _train_step(self, shared_args, inputs, targets, plan: Optional[MicroBatchPlan] = None, update: bool = True,
                  via_window: bool = False):
    via_window = via_window or self.accumulate_steps != 1
    if via_window and update is True and self.mesh is None:  # through the window, the window's flag says whether
      update = self._window.closes.value  # it closes: one compiled step for both (on a mesh, the step that only
      # collects does without the devices' all-reduce, so it is a program of its own)
    done = self._run_batch(shared_args, inputs, targets, with_grads=True, update=update, plan=plan,
                           via_window=via_window)
    if done.finite is not None:
      self.skipped_steps.value += jnp.where(done.finite, 0, 1).astype(self.skipped_steps.dtype)
    if done.grads is not None:
      params = self.target.train_vars().unique()
      grads = {k: same_type(g, params[k].value) for k, g in done.grads.items()}
      if self.clip_grad_norm is not None:
        grads = clip_by_global_norm(grads, self.clip_grad_norm)
      guarded_update(self.optimizer, dict(params), grads, done.apply)
    return (done.loss, done.aux) if self.loss_has_aux else (done.loss,)

  def _run_batch(self, shared_args, inputs, targets, with_grads: bool, update: bool = True,
                 plan: Optional[MicroBatchPlan] = None, via_window: bool = False) -> Settled:
    """One batch through :mod:`~brainpy_accum.trainer._step`: this device's sums, then settled (on a mesh: in
    ``shard_map``)."""
    layout = self._check_batch(inputs, targets)
    plan = plan or self.plan_for(layout.batch_size)
    window = self._window if with_grads and via_window else None
    alone = self.mesh is None and window is None
    params = self.target.train_vars().unique() if with_grads else None
    micro_fn = micro_step(self._loss_and_aux, shared_args, params, self._weigh)
    two_passes = self._two_passes(shared_args, targets, params) if self.whole_batch_loss else None
    axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    one_piece = alone and plan.num_micro_batches == 1
    with whole_batch_variables(self.target, layout.batch_size, whole=not one_piece) as states, \
         self._tracing(plan):  # remat='auto': this plan's remat in the traced time loop
      if not one_piece:
        self._check_flat_states(shared_args, (inputs, targets), axes, plan, states, layout.batch_size)
      whole = one_piece or (two_passes is not None and (plan.num_micro_batches > 1 or not alone))
      metrics = WHOLE_METRICS if whole else self._metric_plan(shared_args, (inputs, targets), axes, plan, states)
      sums_of = functools.partial(batch_sums, micro_fn, axes=axes, plan=plan, states=states, params=params,
                                  alone=alone, two_passes=two_passes, metrics=metrics)
      finish = functools.partial(settle, reduction=self.grad_reduction, skip_nonfinite=self.skip_nonfinite and
                                 with_grads, window=window, update=update, metrics=metrics)
      if self.mesh is None:
        return finish(sums_of((inputs, targets)), same)
      specs = dict(self._split_variables(window, layout.batch_size))
      return on_mesh(sums_of, finish, self.mesh, self.mesh_axis, (inputs, targets), axes, specs,
                     random_states(self.target))

  def _check_flat_states(self, shared_args, args, axes, plan: MicroBatchPlan, states, batch_size: int) -> None:
    """One-dimensional ``(batch_size,)`` states without a ``batch_axis`` are never cut (a per-neuron statistic
    may have the batch's size); if the model fails on a micro-batch with them, say which and how to fix it,
    instead of JAX's shape error from inside the model (traced only: nothing runs)."""
    flat = [name for name, var in self.target.vars().unique().items()
            if not isinstance(var, (bm.TrainVar, brainstate.random.RandomState))
            and getattr(var, 'batch_axis', None) is None and jnp.shape(var.value) == (batch_size,)]
    if not flat or batch_size < 2:
      return
    try:
      traced_shapes(self._forward(shared_args), args, axes, states, (plan.micro_batch_size,))
    except Exception as error:
      raise ValueError(f'Model state {", ".join(flat)} of shape ({batch_size},) has no batch_axis, so micro-batches '
                       f'do not cut it (one-dimensional states are never cut: a per-neuron statistic may have the '
                       f'batch\'s size), and the model fails on a micro-batch of {plan.micro_batch_size} samples with '
                       f'it ({type(error).__name__}: {str(error)[:160]}). If it holds one value per sample, declare '
                       f'it with batch_axis=0 (bm.Variable(..., batch_axis=0)).') from None

  def _metric_plan(self, shared_args, args, axes, plan: MicroBatchPlan, states) -> MetricPlan:
    """How each metric of ``loss_fun`` combines over ``plan``'s micro-batches (:mod:`~brainpy_accum.core._metrics`):
    from the metrics' shapes at two micro-batch sizes, traced only (nothing runs, nothing changes)."""
    if not self.loss_has_aux:
      return None
    key = (plan[:4], tuple((tuple(jnp.shape(x)), str(jnp.result_type(x))) for x in
                           jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, bm.Array))))
    if key not in self._metric_plans:  # the train and evaluation steps of a batch shape trace it once
      self._metric_plans[key] = metric_plan_of(
        lambda micro_args, n: self._loss_and_aux(shared_args, *micro_args)[1], args, axes, plan, states,
        self.aux_reduction, self.grad_reduction, self._found_reductions)
    self._metric_rules = self._metric_plans[key]
    return self._metric_rules

  def _two_passes(self, shared_args, targets, params):
    """``whole_batch_loss=True``: the core's two passes (:mod:`~brainpy_accum.core._two_pass`) as
    ``two_passes(args, axes, plan, states)``."""
    replayed = [v for v in self.target.vars().unique().values() if not isinstance(v, bm.TrainVar)]
    replayed += [v for v in random_states(self.target) if all(v is not r for r in replayed)]
    devices = None if self.mesh is None else Devices(self.mesh_axis, self.num_devices)
    return functools.partial(two_pass_sums, self._forward(shared_args), lambda p: self._loss_of(p, targets),
                             params, replayed, devices=devices)
