"""The trainer's compiled steps: the train step of a plan, jitted for fit, compiled ahead of time for the planner.

:class:`CompiledSteps` builds every step a trainer runs from one function of one batch (:meth:`~CompiledSteps.train`:
:mod:`~brainpy_accum.trainer._step`'s sums, settled, then the update), and keeps what fit runs: the jitted steps
(``'fit'``, ``'loss'``, ``'collect'``, ``'close'``, and a streamed batch's ``'piece'``, ``'piece-loss'`` and
``'statistics'``) and the executables the planner compiled for a batch size, run instead of compiling again. It gives
the planner its :class:`~brainpy_accum.memory._planner.Compilers`. What it computes with (the model, the loss, the
plan of a batch size, the window) it receives as :class:`StepParts`; its options as :class:`StepOptions`.
"""

import contextlib
import functools
import warnings
from typing import Any, Callable, ContextManager, Dict, NamedTuple, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import brainstate.environ
import jax
import jax.numpy as jnp
from brainpy import tools
from jax.sharding import Mesh

from ..core._batch_stats import marked_statistics, seeing_statistics, statistic_term, statistics_pass
from ..core._combine import same_type
from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._metrics import WHOLE_METRICS, MetricPlan, metric_plan_of
from ..core._mesh import random_states
from ..core._batch import traced_shapes
from ..core._states import values_restored, whole_batch_variables
from ..core._two_pass import Devices, two_pass_sums
from ..core._written import WriteEvidence, WriteReport
from ..diagnostics._compiles import QUICK_COMPILE, Compiling
from ..diagnostics._phases import phase
from ..memory._budget import PlannedStep, StepMemory, step_memory
from ..memory._live import temp_bytes_at_least
from ..memory._planner import Compilers
from ..memory._stream import StreamedStatistics
from ..core._mesh import on_mesh, split_variables
from ._step import WINDOW_HOLDS, Settled, batch_sums, clip_by_global_norm, guarded_update, micro_step, same, settle

__all__ = ['LOSS_KINDS', 'CompiledSteps', 'StepOptions', 'StepParts', 'fit_args']

# the evaluation steps: of a batch, and of a streamed batch's chunk (which reads the batch statistics of them all)
LOSS_KINDS = ('loss', 'piece-loss')


class StepOptions(NamedTuple):
  """The trainer's options that shape its steps."""
  grad_reduction: str
  skip_nonfinite: bool
  clip_grad_norm: Optional[float]
  accumulate_steps: Any
  whole_batch_loss: bool
  loss_has_aux: bool
  aux_reduction: dict
  mesh: Optional[Mesh]
  mesh_axis: Optional[str]
  devices: int


class StepParts(NamedTuple):
  """What the steps compute with, handed over by the trainer.

  ``model``, ``optimizer``: the trained DynamicalSystem and its optimizer; ``check_batch(inputs, targets) ->
  BatchLayout``; ``loss_and_aux(shared_args, inputs, targets)``, ``forward(shared_args) -> forward(micro_args,
  size)``, ``loss_of(predicts, targets)``, ``weigh(micro_args, size)``: the model's loss
  (:mod:`~brainpy_accum.trainer._model_loss`); ``tracing(plan)``: the context a plan's step is traced in (its
  remat); ``quiet()``: tracing without per-time-step progress bars; ``window``: the accumulation window (or
  ``None``); ``skipped``: the Variable counting skipped updates; ``jit``: the trainer's jit flags by phase;
  ``fixed_bytes(inputs, targets)``: a lower bound of a step's fixed bytes; ``note_compilations(phase, count)``:
  XLA compilations that count as a phase's (a kept step's are fit's).
  """
  model: Any
  optimizer: Any
  check_batch: Callable
  loss_and_aux: Callable
  forward: Callable
  loss_of: Callable
  weigh: Callable
  tracing: Callable[[Optional[MicroBatchPlan]], ContextManager]
  quiet: Callable[[], ContextManager]
  window: Any
  skipped: Any
  jit: dict
  fixed_bytes: Callable[[Any, Any], int]
  note_compilations: Callable[[str, int], None]


def fit_args(shared_args: Optional[dict] = None) -> tools.DotDict:
  """The shared arguments of a train step: ``fit=True`` unless given."""
  return tools.DotDict({'fit': True, **(shared_args or {})})


class CompiledSteps:
  """Every step the trainer runs, jitted or compiled ahead of time, and the executables kept from planning.

  Attributes
  ----------
  trace_counts : dict
    How many times the train step (``'fit'``) and the evaluation step (``'loss'``) were traced.
  """

  def __init__(self, parts: StepParts, options: StepOptions):
    self.parts, self.options = parts, options
    self.trace_counts = {'fit': 0, 'loss': 0}
    self.metric_rules: Optional[MetricPlan] = None  # the last traced step's, for combining streamed chunks
    self._metric_plans: Dict[tuple, MetricPlan] = {}  # per plan and batch shape
    self._statistic_calls: Dict[tuple, Any] = {}  # the batch statistics loss_fun marks, per plan and batch shape
    # a streamed batch's chunk shape -> the Variables its steps read the whole batch's statistics from (None: the
    # loss marks none); one per kind of statistics, made before any chunk step is traced (:meth:`streamed_statistics`)
    self._chunk_statistics: Dict[tuple, Optional[StreamedStatistics]] = {}
    self._stores: Dict[tuple, StreamedStatistics] = {}
    self.found_reductions: Dict[str, str] = {}  # undeclared scalar metrics' reductions, found by the loss check
    # warns of Variables without a batch axis that the micro-batches wrote differently, by their names in the model;
    # the steps' flags are an output of each step (a Variable), read where the fit loop reads the losses
    named = parts.model.vars().unique()
    self._names = {id(v): k for k, v in named.items()}
    self._read_warned = False  # whole_batch_loss=True: loss_fun reads a state the forward pass writes (once)
    self.writes = WriteReport(self._names,
                              None if parts.window is None and options.mesh is None else WINDOW_HOLDS,
                              WriteEvidence(list(named.values()), options.mesh_axis if options.mesh else None))
    self.planner = None  # the plans its steps are traced with (:meth:`attach`)
    self.rebuild()

  def attach(self, planner) -> None:
    """The planner whose plans the steps are traced with (its ``plan_for(batch_size)``), which itself plans by
    compiling these steps (:meth:`compilers`)."""
    self.planner = planner

  def rebuild(self) -> None:
    """Fresh jitted steps: they trace again, with the current plans; no kept executable."""
    self._jitted = {kind: bm.jit(functools.partial(self._traced, kind), static_argnums=(0,))
                    for kind in ('fit', 'loss', 'collect', 'close', 'piece', 'piece-loss', 'statistics')}
    # (kind, batch size) -> the planner's compiled step, which fit runs: 'fit', or a streamed batch's chunk's,
    # 'close' ('piece' where its loss reads the batch statistics of all the chunks)
    self._kept: Dict[Tuple[str, int], Any] = {}

  def use_found(self, found: Dict[str, str]) -> None:
    """The first-batch check found how undeclared metrics combine: steps traced before with other rules (the
    planner's, when the check could not run before it) are traced again."""
    if found and self._metric_plans:  # (nothing found but means: what was traced stands)
      self._metric_plans.clear()
      self.rebuild()
    self.found_reductions.update(found)

  def report_writes(self) -> None:
    """Warn of the Variables without a batch axis whose writes the steps found apart (read on the host: call it
    where the losses are read, after the steps that wrote them)."""
    self.writes.read()

  def jitted(self, kind: str) -> Callable:
    """The ``kind`` step (``'fit'``, ``'loss'``, ``'collect'``, ``'close'``; a streamed chunk's ``'piece'``,
    ``'piece-loss'``, and ``'statistics'``: its batch statistics' sums): jitted unless ``jit`` says otherwise."""
    phase = 'loss' if kind in LOSS_KINDS else 'fit'
    return self._jitted[kind] if self.parts.jit[phase] else functools.partial(self._traced, kind)

  def step(self, kind: str) -> Callable:
    """The compiled step that the fit loop runs: the planner's kept executable for the batch size, if any."""
    jitted = self.jitted(kind)
    if not any(kept == kind for kept, _ in self._kept):
      return jitted

    def kept_or_jitted(shared_args, inputs, targets):
      step = self._kept.get((kind, self.parts.check_batch(inputs, targets).batch_size), jitted)
      return step(shared_args, inputs, targets)

    return kept_or_jitted

  def _traced(self, kind: str, shared_args, inputs, targets):
    if kind == 'statistics':
      return self._chunk_sums(shared_args, inputs, targets)
    self.trace_counts['loss' if kind in LOSS_KINDS else 'fit'] += 1
    if kind in LOSS_KINDS:
      done = self._run_batch(shared_args, inputs, targets, with_grads=False, streamed=kind == 'piece-loss')
      return (done.loss, done.aux) if self.options.loss_has_aux else done.loss
    return self.train(shared_args, inputs, targets, update=kind != 'collect', via_window=kind != 'fit',
                      streamed=kind == 'piece')

  # ------------------------------------------------------------------ one batch

  def train(self, shared_args, inputs, targets, plan: Optional[MicroBatchPlan] = None, update: bool = True,
            via_window: bool = False, streamed: bool = False):
    """The train step of one batch: its gradient (cut by ``plan``, default the batch size's), then the update;
    ``streamed``: the batch is a streamed batch's chunk (through the window)."""
    via_window = via_window or self.options.accumulate_steps != 1
    if via_window and update is True and self.options.mesh is None:  # through the window, its flag says whether
      update = self.parts.window.closes.value  # it closes: one compiled step for both (on a mesh, the step that
      # only collects does without the devices' all-reduce, so it is a program of its own)
    done = self._run_batch(shared_args, inputs, targets, with_grads=True, update=update, plan=plan,
                           via_window=via_window, streamed=streamed)
    skipped = self.parts.skipped
    if done.finite is not None:
      skipped.value += jnp.where(done.finite, 0, 1).astype(skipped.dtype)
    if done.grads is not None:
      params = self.parts.model.train_vars().unique()
      grads = {k: same_type(g, params[k].value) for k, g in done.grads.items()}
      if self.options.clip_grad_norm is not None:
        grads = clip_by_global_norm(grads, self.options.clip_grad_norm)
      guarded_update(self.parts.optimizer, dict(params), grads, done.apply)
    return (done.loss, done.aux) if self.options.loss_has_aux else (done.loss,)

  def _run_batch(self, shared_args, inputs, targets, with_grads: bool, update: bool = True,
                 plan: Optional[MicroBatchPlan] = None, via_window: bool = False, streamed: bool = False) -> Settled:
    """One batch through :mod:`~brainpy_accum.trainer._step`: this device's sums, then settled (on a mesh: in
    ``shard_map``). ``streamed``: a streamed batch's chunk, whose loss sees the batch statistics of all its
    chunks (where it marks some)."""
    parts, options = self.parts, self.options
    layout = parts.check_batch(inputs, targets)
    plan = plan or self.planner.plan_for(layout.batch_size)
    window = parts.window if with_grads and via_window else None
    alone = options.mesh is None and window is None
    params = parts.model.train_vars().unique() if with_grads else None
    two_passes = self._two_passes(shared_args, targets, params) if options.whole_batch_loss else None
    axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    # a streamed chunk: the statistics of its batch, which fit (or the planner) looked for before tracing it
    store = self._chunk_statistics[_sizes_key((inputs, targets))] if streamed else None
    one_piece = alone and plan.num_micro_batches == 1 and store is None
    with whole_batch_variables(parts.model, layout.batch_size, whole=not one_piece) as states, \
         parts.tracing(plan):  # remat='auto': this plan's remat in the traced time loop
      if not one_piece:
        self.check_flat_states(shared_args, (inputs, targets), axes, plan, states, layout.batch_size)
      whole = one_piece or (two_passes is not None and (plan.num_micro_batches > 1 or not alone))
      metrics = WHOLE_METRICS if whole else self._metric_plan(shared_args, (inputs, targets), axes, plan, states)
      statistics = None if whole or (streamed and store is None) else self._statistics(
        shared_args, (inputs, targets), axes, plan, states, store)
      sums_of = functools.partial(batch_sums, micro_step(parts.loss_and_aux, shared_args, params, parts.weigh),
                                  axes=axes, plan=plan, states=states, params=params, alone=alone,
                                  two_passes=two_passes, metrics=metrics, report=self.writes, statistics=statistics)
      finish = functools.partial(settle, reduction=options.grad_reduction, skip_nonfinite=options.skip_nonfinite
                                 and with_grads, window=window, update=update, metrics=metrics, report=self.writes)
      if options.mesh is None:
        return finish(sums_of((inputs, targets)), same)
      specs = dict(split_variables(parts.model, window, options.mesh_axis, layout.batch_size))
      return on_mesh(sums_of, finish, options.mesh, options.mesh_axis, (inputs, targets), axes, specs,
                     random_states(parts.model))

  def check_flat_states(self, shared_args, args, axes, plan: MicroBatchPlan, states, batch_size: int) -> None:
    """One-dimensional ``(batch_size,)`` states without a ``batch_axis`` are never cut (a per-neuron statistic
    may have the batch's size); if the model fails on a micro-batch with them, say which and how to fix it,
    instead of JAX's shape error from inside the model (traced only: nothing runs)."""
    flat = [name for name, var in self.parts.model.vars().unique().items()
            if not isinstance(var, (bm.TrainVar, brainstate.random.RandomState))
            and getattr(var, 'batch_axis', None) is None and jnp.shape(var.value) == (batch_size,)]
    if not flat or batch_size < 2:
      return
    try:
      traced_shapes(self.parts.forward(shared_args), args, axes, states, (plan.micro_batch_size,))
    except Exception as error:
      raise ValueError(f'Model state {", ".join(flat)} of shape ({batch_size},) has no batch_axis, so micro-batches '
                       f'do not cut it (one-dimensional states are never cut: a per-neuron statistic may have the '
                       f'batch\'s size), and the model fails on a micro-batch of {plan.micro_batch_size} samples with '
                       f'it ({type(error).__name__}: {str(error)[:160]}). If it holds one value per sample, declare '
                       f'it with batch_axis=0 (bm.Variable(..., batch_axis=0)).') from None

  def _metric_plan(self, shared_args, args, axes, plan: MicroBatchPlan, states) -> Optional[MetricPlan]:
    """How each metric of ``loss_fun`` combines over ``plan``'s micro-batches (:mod:`~brainpy_accum.core._metrics`):
    from the metrics' shapes at two micro-batch sizes, traced only (nothing runs, nothing changes)."""
    if not self.options.loss_has_aux:
      return None
    key = (plan[:4], _shapes_key(args))
    if key not in self._metric_plans:  # the train and evaluation steps of a batch shape trace it once
      self._metric_plans[key] = metric_plan_of(
        lambda micro_args, n: self.parts.loss_and_aux(shared_args, *micro_args)[1], args, axes, plan, states,
        self.options.aux_reduction, self.options.grad_reduction, self.found_reductions)
    self.metric_rules = self._metric_plans[key]
    return self.metric_rules

  def _statistics(self, shared_args, args, axes, plan: MicroBatchPlan, states,
                  store: Optional[StreamedStatistics] = None) -> Optional[Callable]:
    """Where ``loss_fun`` marks batch statistics (:func:`~brainpy_accum.batch_mean`), what
    :func:`~brainpy_accum.trainer._step.batch_sums` runs for them: their pass over the micro-batches (on a mesh,
    added over the devices), then the micro-batches' losses seeing the whole batch's (found by tracing the
    loss at two micro-batch sizes, once per plan and batch shape; ``None``: the loss marks none). A streamed
    batch's chunk (``store``) reads the batch's from ``store`` instead, filled by a pass over every chunk."""
    if store is None and not self._marked(shared_args, args, axes, plan, states).names:
      return None
    options, loss_of = self.options, lambda micro_args, n: self.parts.loss_and_aux(shared_args, *micro_args)
    across = None if options.mesh is None else functools.partial(jax.lax.psum, axis_name=options.mesh_axis)

    replayed = self._replayed()

    def statistics(micro_fn, args, axes, plan, states):
      term_of = lambda found: statistic_term(self.parts.forward(shared_args), self.parts.loss_of, args, axes,  # noqa
                                             plan, states, found, replayed)
      found, kept = (None, 1.) if store is None else (store.statistics(), store.keep_term())
      return seeing_statistics(micro_fn, loss_of, self.parts.weigh, options.grad_reduction, args, axes, plan, states,
                               replayed, across, options.devices, term_of, found, kept)

    return statistics

  def streamed_statistics(self, shared_args, inputs, targets) -> Optional[StreamedStatistics]:
    """Where ``loss_fun`` marks batch statistics, the Variables that a streamed batch's chunks of this shape
    (``inputs, targets``, the model state at their size) read the whole batch's from (``None``: it marks none).
    Made before a chunk's step is traced (traced on the host, once per chunk shape: nothing runs), and shared
    by the chunks of every batch whose statistics have the same shapes."""
    key = _sizes_key((inputs, targets))
    if key not in self._chunk_statistics:
      layout = self.parts.check_batch(inputs, targets)
      plan = plan_micro_batches(layout.batch_size, num_micro_batch=min(2, layout.batch_size))
      axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
      with whole_batch_variables(self.parts.model, layout.batch_size) as states, self.parts.quiet():
        marked = self._marked(fit_args(shared_args), (inputs, targets), axes, plan, states)
      store = None
      if marked.names:
        signature = (marked.kinds, tuple((s.shape, str(s.dtype)) for s in marked.sums))
        store = self._stores.setdefault(signature, StreamedStatistics(marked))
      self._chunk_statistics[key] = store
    return self._chunk_statistics[key]

  def statistics_of_chunks(self, shared_args, chunks: Sequence[tuple],
                           enter: Callable[[int, int], None]) -> Optional[StreamedStatistics]:
    """:meth:`streamed_statistics` of a streamed batch's ``chunks`` (``(start, size, data())``): one chunk of each
    shape looked at, in its model state (``enter(start, size)``); ``None`` where the loss marks no statistics."""
    store = None
    for start, size, data in {size: (start, size, data) for start, size, data in chunks}.values():
      enter(start, size)
      store = self.streamed_statistics(shared_args, *data()) or store
    return store

  def random_keys_put_back(self) -> ContextManager:
    """While inside, the random keys (BrainPy's and the model's) may advance; on exit they are as they were."""
    return values_restored(random_states(self.parts.model))

  def _chunk_sums(self, shared_args, inputs, targets):
    """The ``'statistics'`` step of a streamed batch's chunk: its batch statistics' sums, element counts and
    total weight, from its micro-batches run forward (no gradient; the model state put back), for
    :meth:`StreamedStatistics.add`. The random keys are not put back: they advance from chunk to chunk as the
    chunks' steps will draw them (the fit loop puts them back before those)."""
    parts = self.parts
    layout = parts.check_batch(inputs, targets)
    plan = self.planner.plan_for(layout.batch_size)
    axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    loss_of = lambda micro_args, n: parts.loss_and_aux(shared_args, *micro_args)  # noqa
    keys = random_states(parts.model)
    replayed = [v for v in self._replayed() if all(v is not key for key in keys)]
    with whole_batch_variables(parts.model, layout.batch_size) as states, parts.tracing(plan):
      found = statistics_pass(loss_of, parts.weigh, (inputs, targets), axes, plan, states, replayed)
    return found.totals, found.counts, found.weight

  def _marked(self, shared_args, args, axes, plan: MicroBatchPlan, states):
    """The batch statistics ``loss_fun`` marks (:func:`~brainpy_accum.core._batch_stats.marked_statistics`),
    traced at two micro-batch sizes of ``plan``, once per plan and batch shape."""
    key = (plan[:4], _shapes_key(args))
    if key not in self._statistic_calls:
      self._statistic_calls[key] = marked_statistics(
        lambda micro_args, n: self.parts.loss_and_aux(shared_args, *micro_args), args, axes, states, plan)
    return self._statistic_calls[key]

  def _replayed(self) -> list:
    """The states a second pass over the micro-batches starts again from: the model's Variables but its
    parameters, and its random keys."""
    model = self.parts.model
    replayed = [v for v in model.vars().unique().values() if not isinstance(v, bm.TrainVar)]
    return replayed + [v for v in random_states(model) if all(v is not r for r in replayed)]

  def _two_passes(self, shared_args, targets, params):
    """``whole_batch_loss=True``: the core's two passes (:mod:`~brainpy_accum.core._two_pass`) as
    ``two_passes(args, axes, plan, states)``."""
    replayed = self._replayed()
    devices = None if self.options.mesh is None else Devices(self.options.mesh_axis, self.options.devices)
    return functools.partial(two_pass_sums, self.parts.forward(shared_args),
                             lambda p: self.parts.loss_of(p, targets), params, replayed, devices=devices,
                             report=self.writes, on_read=self._warn_read)

  def _warn_read(self, states: list) -> None:
    """``whole_batch_loss=True``, ``loss_fun`` reads states of the model that its forward pass writes: warn once,
    naming them, that no gradient flows back through them (bp.BPTT's does), and how to make it exact."""
    if self._read_warned:
      return
    self._read_warned = True
    names = ', '.join(self._names.get(id(s), type(s).__name__) for s in states)
    warnings.warn(f'loss_fun reads {names} itself, a state the model writes as it runs: with whole_batch_loss=True no '
                  f'gradient flows back through that read into the forward passes (bp.BPTT\'s does). If the loss '
                  f'depends on it through the parameters (a hidden state, a membrane potential), this trains another '
                  f'objective: monitor it instead (monitors={{\'name\': variable}}) and read it from predicts, where '
                  f'its gradient is pulled back, or train without whole_batch_loss (each micro-batch\'s loss reads '
                  f'its own). If it does not (a step counter), nothing is lost.', UserWarning, stacklevel=2)

  # ------------------------------------------------------------------ compiled ahead of time

  def compiling(self, kind: str, shared_args, inputs, targets) -> Optional[Compiling]:
    """The ``kind`` step traced here and compiled on a thread of its own while this one goes on (the check's trace);
    its call then finds it compiled. ``None`` (nothing started) but for fit's own jitted ``'fit'`` where the check
    cannot change the step (no metrics, whose combination it finds) and its trace succeeds (else the call raises)."""
    step = self.step(kind)
    if kind != 'fit' or self.options.loss_has_aux or not hasattr(step, 'lower'):
      return None
    try:
      return Compiling(step.lower(shared_args, inputs, targets), functools.partial(self.parts.note_compilations, 'fit'))
    except Exception:  # noqa: BLE001 -- the step's call traces again and raises it where it always did
      return None

  @contextlib.contextmanager
  def for_plan(self, plan: Optional[MicroBatchPlan], batch: tuple = (), update: bool = True,
               via_window: bool = False):
    """The train step for ``plan``, jitted on its own (not fit's), to trace, lower or compile inside the
    ``with``: the context its trace needs (no time-step bars, the plan's tracing). ``via_window``: a streamed
    batch's chunk, ``batch`` (``shared_args, inputs, targets``) its data."""
    if via_window:
      self.streamed_statistics(*batch)
    step = bm.jit(functools.partial(self.train, plan=plan, update=update, via_window=via_window, streamed=via_window),
                  static_argnums=(0,))
    with self.parts.quiet(), self.parts.tracing(plan):
      yield step

  def compile(self, inputs, targets, shared_args: Optional[dict] = None, plan: Optional[MicroBatchPlan] = None,
              update: bool = True, via_window: bool = False, quick: bool = False):
    """The train step for this batch shape compiled ahead of time (see :meth:`AccumBPTT.compile_step`)."""
    with self.for_plan(plan, (shared_args, inputs, targets), update=update, via_window=via_window) as step:
      return step.lower(fit_args(shared_args), inputs, targets).compile(
        compiler_options=QUICK_COMPILE if quick else None)

  def compilers(self, before_timing: Callable[[], None]) -> Compilers:
    """What the planner compiles and times; ``before_timing()`` runs before trial steps are timed."""
    return Compilers(step_bytes=self._probe, trial=self._compiled_for_training, keepable=self.keepable,
                     bytes_at_least=self._bytes_at_least, unkeep=self._unkeep, before_timing=before_timing)

  def _unkeep(self, batch_size: int) -> None:
    """Forget the planner's step kept for ``batch_size`` (and its pieces'): fit traces the new plan's."""
    self._kept.pop(('fit', batch_size), None)
    self._kept.pop(('close', batch_size), None)
    self._kept.pop(('piece', batch_size), None)

  def _probe(self, plan: MicroBatchPlan, shared_args, inputs, targets, via_window: bool = False) -> StepMemory:
    """The planner's quick probe: the step's memory, compiled without optimising its code."""
    with phase('planning probes', note=plan.describe()):
      return step_memory(self.compile(inputs, targets, shared_args, plan=plan, via_window=via_window, quick=True))

  def _bytes_at_least(self, plan: MicroBatchPlan, shared_args, inputs, targets, via_window: bool = False) -> int:
    """A lower bound of the step's memory for ``plan``, from its trace alone (no compilation): the fixed bytes
    known by arithmetic and the temporaries that its jaxpr's loops must hold (:mod:`~brainpy_accum.memory._live`).
    0 (rules nothing out) on a mesh, where the figures are per device, and off the CPU: the bound holds for
    XLA:CPU, but on a TPU v5e XLA was measured below it (a small rate RNN's step: 0.87 MB of working memory where
    its trace counts 3.6 MB of stacked residuals), so there every candidate is compiled."""
    if self.options.mesh is not None or jax.default_backend() != 'cpu':
      return 0
    with phase('planning probes'), self.for_plan(plan, (shared_args, inputs, targets), via_window=via_window) as step:
      jaxpr = step.stateful_fun.get_jaxpr(fit_args(shared_args), inputs, targets)
    return self.parts.fixed_bytes(inputs, targets) + temp_bytes_at_least(jaxpr)

  def keepable(self, via_window: bool) -> bool:
    """Whether fit can run the planner's compiled step itself, jitted, without a mesh or an ``accumulate_steps``
    window: the train step, or through the window (``via_window``) the step of a streamed batch's last chunk."""
    return self.options.accumulate_steps == 1 and self.options.mesh is None and bool(self.parts.jit['fit'])

  def _compiled_for_training(self, plan: MicroBatchPlan, shared_args, inputs, targets,
                             via_window: bool = False) -> PlannedStep:
    """The train step compiled for ``plan`` as fit runs it; its ``keep()`` makes fit run this executable for the
    batch size, so that the planner's compilation is the training's (no second one)."""
    batch_size, shared_args = self.parts.check_batch(inputs, targets).batch_size, fit_args(shared_args)
    step = None
    store = self.streamed_statistics(shared_args, inputs, targets) if via_window else None

    def traced(shared_args, inputs, targets):
      if any(kept is step for kept in self._kept.values()):  # a retrace of a kept step counts as fit's
        self.trace_counts['fit'] += 1
      return self.train(shared_args, inputs, targets, plan=plan, via_window=via_window, streamed=via_window)

    step = bm.jit(traced, static_argnums=(0,))
    with phase('planned step compiles', note=plan.describe()), self.parts.quiet(), self.parts.tracing(plan), \
         brainstate.environ.context(fit=True):
      compiled = step.compile(shared_args, inputs, targets)  # the jit's own call runs this executable
      values = step.stateful_fun.get_state_trace(shared_args, inputs, targets).get_state_values()

    def keep():
      if self.keepable(via_window):
        self._kept['fit' if not via_window else 'close' if store is None else 'piece', batch_size] = step
        self.trace_counts['fit'] += 1  # its trace and compilation are fit's: fit will not repeat them
        self.parts.note_compilations('fit', 1)

    return PlannedStep(step_memory(compiled), lambda: jax.block_until_ready(compiled(values, inputs, targets)), keep)


def _sizes_key(args) -> tuple:
  """The shapes of ``args``' leaves (host arrays and the traced arrays of a step alike)."""
  return tuple(tuple(jnp.shape(x)) for x in jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, bm.Array)))


def _shapes_key(args) -> tuple:
  """The shapes and dtypes of ``args``' leaves: what a trace of the loss at a plan depends on."""
  return tuple((tuple(jnp.shape(x)), str(jnp.result_type(x)))
               for x in jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, bm.Array)))
