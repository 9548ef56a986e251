"""The default mode's one-time check, at the first batch, that ``loss_fun`` is a mean over samples, and how its
scalar metrics combine.

Accumulating micro-batch gradients trains the weighted mean (``'sum'``: the sum) of the micro-batch losses.
For a loss that couples the samples of a batch (a batch-wide regulariser, a maximum) that is another
objective. The check evaluates ``loss_fun`` alone, on the first batch's data (targets, and inputs for
``loss_weight_fn``) with random outputs in place of the model's, at three points (:data:`POINTS`: uniform
values, 0-or-1 values like spikes, and each micro-batch at a level of its own): the loss of the whole batch
against the combination of the micro-batch losses and, at the third, their gradients with respect to every
output too (:mod:`~brainpy_accum.trainer._random_outputs` computes them). The model is only traced, for its outputs' shapes: nothing of it is compiled or run, so the check
costs one small compilation. Random outputs show what the model's first outputs may hide: a spike-count
penalty summed over the batch is 0 on every micro-batch while no neuron spikes yet, but not at random outputs.
At i.i.d. outputs every micro-batch's mean is nearly the batch's, so a term built on a batch-wide mean, variance
or norm (a squared mean voltage) differs by little there; with the micro-batches at levels of their own it
differs by a share of the gap between levels, and its gradient with respect to the output it reads (a monitor
the rest of the loss does not touch) differs by that share whatever the term's coefficient.

If they differ, a warning says by how much and points to ``whole_batch_loss=True``. A loss that is a
weighted mean (``'sum'``: a sum) of per-sample terms agrees everywhere, to float32 round-off (its gradient
entries too: each is the same expression of the same values). What it cannot see: a coupling through
something other than the outputs (a loss that reads a Variable), or one that only shows at outputs unlike all
points checked (and not at all where the loss is not finite at any: then it says so).

Scalar metrics (``loss_has_aux``): each one declared in ``aux_reduction`` is compared with its declared
combination; each undeclared one is combined by every reduction of ``aux_reduction`` (mean, sum, max, min)
exactly as a train step would, and the one that gives the whole batch's value at every point is the one the
train step uses (:func:`found_reductions`); none, or several (a metric constant at every point), keep the loss's
combination and warn, naming ``aux_reduction``. Stitched metrics (rows per sample, :mod:`~brainpy_accum.core._metrics`):
each one's micro-batch rows put together must give its whole-batch value at every point, in the one order of
``ORDERS`` that the train step then uses where it holds several rows per sample (a flattened ``(T * B, ...)``);
none, or both orders, refuse it by name (:func:`~brainpy_accum.core._metrics.found_orders`). Then the check must
end before the first train step is traced.

Where the device cannot hold the check's program (it holds random outputs of the whole batch at three points: at
4,096 spiking neurons and 512 trials of 2,200 steps, 69 GiB on the TPU v5e), the check of the batch's first
samples runs instead, as many as half the device's free memory holds by the size the refusal named, cut into
micro-batches of the plan's size: a coupling shows on a part of the batch as on the whole.

The check changes nothing, never stops training but to refuse a metric that cannot be stitched, and is one
compiled function. It is skipped (nothing to
compile) when ``loss_fun`` is BrainPy's own ``mean_squared_error`` or ``mean_absolute_error`` with its default
mean, without metrics, ``loss_weight_fn`` or ``grad_reduction='sum'``: a mean over every element is a mean over
samples, whatever the values.
"""

import threading
import warnings
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Union

import brainpy as bp
import brainpy.math as bm
import jax
import numpy as np

from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._metrics import MetricsError, found_orders
from ..core._states import batched_variables, values_restored, whole_batch_variables
from ..memory import _device
from ..memory._device import is_out_of_memory, refused_bytes
from ..memory._stream import host_chunk
from ..core._two_pass import output_axes, second_sizes, traced_shapes, whole_batch_like
from ..diagnostics._compiles import UNCOUNTED_THREAD_PREFIX
from ..diagnostics._phases import phase
from ._fit_check import NO_CHECK, PendingCheck, CheckProgram, check_device
from ._random_outputs import (LEVELS, POINTS, WHOLE, WHOLE_BATCH_FIX, CheckNames, Evidence, found_reductions,
                              loss_at_random_outputs, warn_coupled, warn_coupled_loss, warn_metrics)

__all__ = ['MEANS_OVER_ELEMENTS', 'CheckParts', 'FirstBatchCheck', 'RunningCheck', 'check_first_batch', 'check_in_background',
           'check_loss', 'conclude', 'found_reductions', 'warn_coupled_loss', 'warn_if_coupled', 'warn_metrics']


# BrainPy's losses that are, with their default reduction, the mean over every element of every leaf (a sum of
# such means for a tree of outputs): a mean over samples for any values, so the first-batch check has nothing to see.
# (Not cross_entropy_loss: with integer labels it divides by the count of labels other than ignore_index,
# which couples the samples when a batch holds ignored labels.)
MEANS_OVER_ELEMENTS = (bp.losses.mean_squared_error, bp.losses.mean_absolute_error)


# A per-sample loss's gradient with respect to an output entry is the same expression of the same values in the
# whole batch and in a micro-batch, so the two agree to a few float32 roundings (measured: at most 3e-7 of the
# leaf's largest entry, for cross entropies of the last step, the mean and the max over time, logsumexp, squared
# errors, per-sample regularisers; batches up to 256 x 100 x 64, 2 to 7 micro-batches); a coupling at LEVELS moves
# them by a share of the gap between the levels (measured 0.33 to 0.45 for a squared batch-wide mean).
GRAD_RTOL = 1e-4
GRAD_TINY = 1e-30  # differences below this are underflow, not a coupling


def check_loss(compare: Callable, variables: Sequence, plan: MicroBatchPlan, reduction: str,
               use_found: Optional[Callable[[Dict[str, str]], None]] = None) -> None:
  """Run ``compare(names) -> Evidence`` (:func:`loss_at_random_outputs`'), give ``variables`` their values back,
  warn if the loss or a metric does not combine, and hand the metrics' reductions found to ``use_found``.

  A check that fails warns instead of raising: it must never stop training that would run without it.
  """
  names = CheckNames()  # the metrics compared, named while ``compare`` is traced
  with values_restored(variables):
    try:
      result = compare(names)
    except MetricsError:  # the user's metrics need a fix: the step would raise it too, so say it now
      raise
    except Exception as error:
      _could_not_check(error)
      return
  _use(conclude(result, names, plan, reduction), use_found)


def _use(found: Dict[str, str], use_found: Optional[Callable[[Dict[str, str]], None]]) -> None:
  if found and use_found is not None:
    use_found(found)


def conclude(evidence: Evidence, names: CheckNames, plan: MicroBatchPlan, reduction: str,
             on: str = WHOLE) -> Dict[str, str]:
  """Warn about the loss and its declared metrics from the check's ``evidence``, decide how each undeclared
  scalar metric combines and where each stitched metric's rows lie, and return those decisions that differ from
  the defaults (the loss's own combination; time-major rows), by the leaf's path, which the train step then uses.
  A stitched metric whose rows cannot be placed is refused (:func:`~brainpy_accum.core._metrics.found_orders`).
  ``on``: the samples checked, as the warnings name them."""
  found = found_orders(names.stitched, evidence.stitched, plan.describe_cuts())
  warn_if_coupled(evidence, names, plan, reduction, on)
  whole, combined = evidence.metrics
  warn_metrics(names.metrics, [np.asarray(v) for v in whole], [np.asarray(v) for v in combined], plan)
  return {**found_reductions(names.undecided, evidence.undecided, plan, reduction), **found}


def warn_if_coupled(evidence: Evidence, names: CheckNames, plan: MicroBatchPlan, reduction: str,
                    on: str = WHOLE) -> None:
  """Warn once if the loss of the whole batch is not the combination of its micro-batch losses: in value at any of
  :data:`POINTS`, or in its gradient with respect to an output at :data:`LEVELS`."""
  whole, combined = np.asarray(evidence.whole, np.float64), np.asarray(evidence.combined, np.float64)
  magnitude = np.asarray(evidence.magnitude, np.float64)
  usable = [p for p in range(len(POINTS)) if np.isfinite(whole[p]) and np.isfinite(combined[p])]
  if not usable:
    warnings.warn(f'Could not check whether loss_fun is a mean over samples: it is not finite at random outputs '
                  f'({" nor ".join(POINTS)}); if it couples the samples of a batch, pass {WHOLE_BATCH_FIX}.',
                  UserWarning, stacklevel=2)
    return
  for point in usable:
    if warn_coupled_loss(whole[point], combined[point], plan, reduction, POINTS[point], magnitude=magnitude[point],
                         statistics=names.statistics, on=on):
      return
  if evidence.gaps is not None and LEVELS in usable:
    for path, (difference, scale) in zip(names.leaves, np.asarray(evidence.gaps, np.float64)):
      if difference > GRAD_RTOL * scale and difference > GRAD_TINY:
        warn_coupled(f'its gradient with respect to {path} on {on} differs from the gradient of the '
                      f'{"sum" if reduction == "sum" else "weighted mean"} of its values on the '
                      f'{plan.describe_cuts()} micro-batches by up to {difference / scale:.3g} of its largest entry '
                      f'(the loss itself: {whole[LEVELS]:.7g} and {combined[LEVELS]:.7g})', POINTS[LEVELS],
                      names.statistics)
        return


# Of the device's free memory, the share the check of fewer samples is sized to, where the whole batch's check did
# not fit: its program is mostly the random outputs (three points, and the gradients at one), which scale with the
# samples; the rest is room for what else the device holds then.
CHECK_SHARE = 0.5


def _could_not_check(error: Exception, samples: Optional[int] = None) -> None:
  if samples is not None and is_out_of_memory(error):
    why = (f"the check's program, loss_fun at random outputs of {samples} samples, needs "
           f"{refused_bytes(error, 0) / 2 ** 30:.3g} GiB or more of the device's memory, more than it holds, with "
           f"too little room for the check of two samples")
  else:
    why = f'{type(error).__name__}: {str(error)[:200]}'
  warnings.warn(f'Could not check whether loss_fun is a mean over samples ({why}); if it couples the samples of a '
                f'batch, pass {WHOLE_BATCH_FIX}.', UserWarning, stacklevel=6)  # fit's line


class RunningCheck:
  """The first-batch check compiling and running on a thread of its own (:func:`check_in_background`);
  :meth:`finish` waits for it and gives its warnings, once."""

  def __init__(self, program, inputs, targets, names: 'CheckNames', plan: MicroBatchPlan, reduction: str,
               use_found: Optional[Callable[[Dict[str, str]], None]],
               fewer: Optional[Callable[[BaseException], Optional['RunningCheck']]] = None, on: str = WHOLE):
    self._names, self._plan, self._reduction, self._use_found, self._on = names, plan, reduction, use_found, on
    self._fewer = fewer  # where the device cannot hold the check: the check of fewer samples, started (or None)
    self._instead: Optional[RunningCheck] = None  # that check, once started
    self._done: dict = {}
    self._reported: list = []  # the conclusion's warnings, given when finish() reports; reductions used at once
    self._thread = threading.Thread(target=self._run, args=(program, inputs, targets),
                                    name=f'{UNCOUNTED_THREAD_PREFIX} first-batch check', daemon=True)
    self._thread.start()

  def _run(self, program, inputs, targets) -> None:
    """Runs the check on the values given; the new values it returns are dropped: nothing changes."""
    try:
      with phase('first-batch check'):
        compiled, values = program.compile()
        self._done['result'] = jax.device_get(compiled(values, inputs, targets)[1])
    except Exception as error:  # reported by finish(), on the caller's thread; its frames hold the check's values
      self._done['error'] = error.with_traceback(None)

  def finish(self, report: bool = True, retry: bool = True) -> None:
    """Wait for the check and give its warnings (``report=False``: only wait). Where the device could not hold
    its program, the check of the batch's first samples, as many as it can hold, runs instead (not with
    ``retry=False``: a step raised)."""
    with phase('first-batch check'):
      self._thread.join()
    error = self._done.get('error')
    if error is not None and retry and self._instead is None and self._fewer is not None \
        and is_out_of_memory(error):
      self._instead = self._fewer(error)
    self._fewer = self._fewer if error is not None and not retry else None  # (it holds the batch's model state)
    if self._instead is not None:
      self._instead.finish(report, retry)
      return
    if error is not None:
      if report:
        _could_not_check(error, self._plan.batch_size)
      return
    if not self._reported:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        _use(conclude(self._done['result'], self._names, self._plan, self._reduction, self._on), self._use_found)
      self._reported.append(caught)
    if report:
      for warning in self._reported[0]:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


class UntracedCheck:
  """A check whose trace failed: it says so at ``finish(report=True)``, not before, so that a step failing the
  same way (an error in ``loss_fun``) raises its own error alone, as bp.BPTT's would."""

  def __init__(self, error: Exception):
    self._error, self._reported = error, False

  def finish(self, report: bool = True, retry: bool = True) -> None:
    if report and not self._reported:
      self._reported = True
      _could_not_check(self._error)


def check_in_background(step, shared_args, inputs, targets, variables: Sequence, plan: MicroBatchPlan, reduction: str,
                        use_found: Optional[Callable[[Dict[str, str]], None]] = None, fewer: Optional[Callable] = None,
                        on: str = WHOLE, device: Optional[jax.Device] = None) -> Union[RunningCheck, UntracedCheck]:
  """Trace and lower the jitted ``step(names, shared_args, inputs, targets)`` here (errors in the user's metrics
  raise now, before anything changes), then compile and run it on a background thread, on the Variables'
  values of now: the :class:`RunningCheck`, whose ``finish(report=True)`` waits for it and warns (an
  :class:`UntracedCheck` where the trace fails: it warns at ``finish`` too). XLA compiles
  and runs the check while fit goes on (the planner's search, or the first train steps, dispatched before the
  check is traced), and the check's result does not depend on what those steps change. No thread outlives the
  call of ``finish``.

  Where the loss has undeclared scalar metrics or stitched ones, the train step must know how they combine
  before it is traced (and a stitched metric whose rows cannot be placed must be refused before any step): then
  the check is waited for here, what it found handed to ``use_found``, and ``finish`` only warns. ``fewer(error)``:
  where the device cannot hold the check, the check of fewer samples (see :class:`RunningCheck`); ``on``: the
  samples checked, as the warnings name them; ``device``: where to compile and run it (see :class:`CheckProgram`)."""
  names = CheckNames()
  with values_restored(variables):
    try:
      values = step.stateful_fun.get_state_trace(names, shared_args, inputs, targets,
                                                 compile_if_miss=True).get_state_values()
      program = CheckProgram(device, step, values, names, shared_args, inputs, targets)
    except MetricsError:
      raise
    except Exception as error:
      return UntracedCheck(error)
  running = RunningCheck(program, inputs, targets, names, plan, reduction, use_found, fewer, on)
  if names.undecided or names.stitched:  # the step to be traced next combines them as found
    running.finish(report=False)
  return running


def check_first_batch(model, shared_args, inputs, targets, *, check_batch: Callable, plan: MicroBatchPlan,
                      forward: Callable, loss_of: Callable, weigh: Callable, variables: Sequence, jit: bool,
                      reduction: str, declared: Optional[dict] = None, has_metrics: bool = True,
                      use_found: Optional[Callable[[Dict[str, str]], None]] = None,
                      device: Optional[jax.Device] = None) -> Optional[RunningCheck]:
  """Default mode, first batch: warn if the loss is not the weighted mean of its micro-batch values.

  ``check_batch(inputs, targets) -> BatchLayout``; ``plan``: the micro-batches of the batch (of each device's
  share, with a mesh): the check cuts the whole batch into micro-batches of its size;
  ``forward(shared_args)``: the model as ``forward(micro_args, size) -> outputs`` (traced only, for the outputs'
  shapes);
  ``loss_of(predicts, targets) -> (loss, aux)``; ``weigh(micro_args, size)``: a micro-batch's weight;
  ``variables``: what the check must leave as it found it; ``jit``: compile the check; ``declared``: the
  metrics' ``aux_reduction``; ``has_metrics``: whether ``loss_of`` returns any (``loss_has_aux``);
  ``use_found(found)``: receives how the undeclared scalar metrics combine where that is not the loss's own
  combination (``{path: reduction}``, see :func:`found_reductions`), before this returns if there are any;
  ``device``: where the check compiles and runs with ``jit`` (see :func:`check_in_background`).

  With ``jit`` the check is compiled and run beside the first train steps (:func:`check_in_background`); the
  returned :class:`RunningCheck`'s ``finish()``, called after them, waits for it and warns. Without: it runs and
  warns now, and ``None`` is returned.
  """
  # the whole batch cut into micro-batches of the plan's size (with a mesh the plan cuts one device's share)
  plan = plan_micro_batches(check_batch(inputs, targets).batch_size, micro_batch_size=plan.micro_batch_size)
  if plan.num_micro_batches == 1:
    return None

  def comparing(plan: MicroBatchPlan) -> Callable:  # the check of a batch cut by ``plan``
    def compare(names, shared_args, inputs, targets):
      layout = check_batch(inputs, targets)
      axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
      with whole_batch_variables(model, layout.batch_size) as states:  # the outputs' shapes: traced only
        small, large = traced_shapes(forward(shared_args), (inputs, targets), axes, states, second_sizes(plan))
      out_axes = output_axes(small, large)
      return loss_at_random_outputs(loss_of, weigh, (inputs, targets), axes,
                                    whole_batch_like(small, out_axes, plan.batch_size), out_axes, plan, reduction,
                                    names, declared, has_metrics)
    return compare

  if not jit:
    check_loss(lambda names: comparing(plan)(names, shared_args, inputs, targets), variables, plan, reduction,
               use_found)
    return None

  # the batch's model state as the check starts, for a check of fewer samples (the model may hold another then)
  state = [(var, axis, var.value) for var, axis in batched_variables(model, plan.batch_size).values()]

  def start(cut: MicroBatchPlan, inputs, targets) -> Optional[RunningCheck]:  # compiled quickly, beside the steps
    on = WHOLE if cut.batch_size == plan.batch_size else (
      f"the batch's first {cut.batch_size} of its {plan.batch_size} samples (the device cannot hold the check of all)")
    return check_in_background(bm.jit(comparing(cut), static_argnums=(0, 1)), shared_args, inputs, targets,
                               variables, cut, reduction, use_found,
                               lambda error: _first_samples_check(error, state, check_batch, start, cut, inputs,
                                                                  targets), on, device)

  return start(plan, inputs, targets)


def _first_samples_check(error: BaseException, state: Sequence, check_batch: Callable, start: Callable,
                         plan: MicroBatchPlan, inputs, targets):
  """Where the device could not hold the check of a batch cut by ``plan`` (``error``), the check of its first
  samples, as many as it holds (:func:`_samples_held`), cut in micro-batches of the plan's size (in two where they
  are fewer), from their slice of the batch's model ``state`` as the first check started (``(Variable, batch axis,
  value)``; the model may hold another by now: a streamed batch's piece, a chunk being planned), put back after:
  ``start(plan, inputs, targets)``'s :class:`RunningCheck`; ``None`` where no two samples fit, :data:`_WARNED`
  where it could not start (and said so)."""
  size = _samples_held(error, plan.batch_size)
  if size is None:
    return None
  layout = check_batch(inputs, targets)
  cut = plan_micro_batches(size, micro_batch_size=plan.micro_batch_size) if plan.micro_batch_size < size \
      else plan_micro_batches(size, num_micro_batch=2)
  with values_restored([var for var, _, _ in state]):
    for var, axis, value in state:  # (one sample held for all stays one)
      value = bm.as_jax(value)
      var.value = value if value.shape[axis] == 1 else jax.lax.slice_in_dim(value, 0, size, axis=axis)
    running = start(cut, host_chunk(inputs, layout.input_axes, 0, size), host_chunk(targets, layout.target_axes,
                                                                                     0, size))
  return _WARNED if running is None else running


def _samples_held(error: BaseException, batch_size: int) -> Optional[int]:
  """Of a check of ``batch_size`` samples that the device could not hold (``error``), the samples whose check
  it can (:data:`CHECK_SHARE` of its free memory, by the size the refusal names; at most half): ``None`` under 2,
  or where the device reports no memory."""
  memory = _device.device_memory()  # (looked up when called: the tests' simulated device replaces it)
  if memory is None:
    return None
  free = max(0, memory.limit - memory.in_use)
  size = min(batch_size // 2, int(batch_size * CHECK_SHARE * free / refused_bytes(error, memory.limit + 1)))
  return size if size >= 2 else None


class _Warned:
  """A check that could not start and has warned so: nothing to wait for."""

  def finish(self, report: bool = True, retry: bool = True) -> None:
    pass


_WARNED = _Warned()


class CheckParts(NamedTuple):
  """What the first-batch check reads of the trainer, handed over by it.

  ``check_batch(inputs, targets) -> BatchLayout``; ``argument_bytes(inputs, targets)``: whether the check fits
  beside planning; ``check_flat_states(shared_args, args, axes, plan, states, batch_size)``: the error naming
  ``batch_axis`` for a model that fails on a micro-batch; ``quiet()``: tracing without time-step bars;
  ``forward``, ``loss_of``, ``weigh``: the model's loss; ``variables()``: what the check must leave as it found
  it; ``use_found(found)``: receives how the undeclared scalar metrics combine (:func:`found_reductions`),
  before the first step is traced. The plans come from the planner (:meth:`FirstBatchCheck.attach`).
  """
  check_batch: Callable
  argument_bytes: Callable
  check_flat_states: Callable
  quiet: Callable
  forward: Callable
  loss_of: Callable
  weigh: Callable
  variables: Callable[[], list]
  use_found: Callable[[Dict[str, str]], None]


class FirstBatchCheck:
  """The default mode's first-batch check, once per trainer (:func:`check_first_batch`).

  Parameters
  ----------
  model : DynamicalSystem
    The trained model.
  parts : CheckParts
    What the check reads of the trainer.
  loss_func : callable
    ``loss_fun`` as the trainer resolved it (BrainPy's own means over every element need no check).
  jit, on_mesh : bool
    Whether the train step is jitted, and split over a mesh.
  reduction, declared, has_metrics, weighted
    ``grad_reduction``, ``aux_reduction``, ``loss_has_aux`` and whether ``loss_weight_fn`` is given.
  done : bool
    Nothing to check (``whole_batch_loss=True`` trains the whole batch's loss).
  """

  def __init__(self, model, parts: CheckParts, *, loss_func: Callable, jit: bool, on_mesh: bool, reduction: str,
               declared: dict, has_metrics: bool, weighted: bool, done: bool = False):
    self.model, self.parts, self.loss_func, self.jit, self.on_mesh = model, parts, loss_func, jit, on_mesh
    self.reduction, self.declared, self.has_metrics, self.weighted = reduction, declared, has_metrics, weighted
    self.checked = done
    self._running: Optional[RunningCheck] = None  # the check, once started
    self.planner = None  # the plans it cuts the batch by (:meth:`attach`)

  def attach(self, planner) -> None:
    """The planner whose plans the check cuts a batch by (``plan_for``, ``known_plan``, ``budget``)."""
    self.planner = planner

  def wait(self) -> None:
    """Wait for a check running beside planning (planning times trial steps after it), without its report."""
    if self._running is not None:
      self._running.finish(report=False)

  def pending(self, shared_args, inputs, targets, before_planning: bool = False, streamed: bool = False
              ) -> 'PendingCheck':
    """Default mode, first batch: the check that the loss is the weighted mean of its micro-batch values (once
    per trainer), as a :class:`PendingCheck` to start (or :data:`NO_CHECK`: nothing to check).

    A model that fails on a micro-batch raises now (the error that names the fix). ``start()`` checks the loss
    on the values the Variables hold then (fit starts it once the first step is dispatched, so that the check's
    tracing overlaps the step's run; nothing the check computes depends on those values). With
    ``loss_has_aux`` it has started already (how undeclared metrics combine shapes the train step, so it is
    found first; where it is found only after planning compiled a step, that step is traced again).
    ``before_planning`` (``num_micro_batch='auto'``, a batch not planned yet): cut in two, so that it can start
    before planning and compile beside the planner's search (its cut does not wait for the plan, and is the
    same whether the plan is searched or read from the plan cache); only where it can (jit, no mesh, the
    batch's data well within the budget), else :data:`NO_CHECK` and fit checks the planned cut, beside the first
    step as usual. ``streamed``: ``inputs, targets`` are samples of a streamed batch, whose chunks combine like
    micro-batches: cut in two where their plan would not cut them.
    """
    if self.checked:
      return NO_CHECK
    with phase('first-batch check'):
      return self._pending(shared_args, inputs, targets, before_planning, streamed)

  def _pending(self, shared_args, inputs, targets, before_planning: bool, streamed: bool) -> 'PendingCheck':
    layout = self.parts.check_batch(inputs, targets)
    plan = self._plan(layout.batch_size, inputs, targets, before_planning, streamed)
    if plan is None or plan_micro_batches(layout.batch_size, micro_batch_size=plan.micro_batch_size
                                          ).num_micro_batches == 1:
      return NO_CHECK  # (a batch that trains whole, on every device: nothing to compare; a later cut one is checked)
    self.checked = True
    if plan.num_micro_batches > 1:  # a model that fails on a micro-batch: the error that names the fix, first
      with whole_batch_variables(self.model, layout.batch_size) as states, \
           values_restored([var for var, _ in states]):
        self.parts.check_flat_states(shared_args, (inputs, targets), jax.tree_util.tree_leaves(
          (layout.input_axes, layout.target_axes)), plan, states, layout.batch_size)
    if self.loss_func in MEANS_OVER_ELEMENTS and not self.has_metrics and not self.weighted \
        and self.reduction == 'mean':
      return NO_CHECK  # a mean over every element is a mean over samples: nothing to check (see the module)
    pending = PendingCheck(self, (shared_args, inputs, targets, plan))
    if self.has_metrics:  # how undeclared metrics combine shapes the train step: found before it is traced
      try:
        pending.start()
      except MetricsError:
        self.checked = False  # a refused metric: the next fit checks it again (and refuses it again)
        raise
    return pending

  def _plan(self, batch_size: int, inputs, targets, before_planning: bool, streamed: bool
            ) -> Optional[MicroBatchPlan]:
    """The cut the check compares the whole batch with (``None``: no check now)."""
    if before_planning:
      budget = self.planner.budget
      if (batch_size < 2 or self.on_mesh or not self.jit or self.planner.known_plan(batch_size) is not None
          or 2 * self.parts.argument_bytes(inputs, targets) > budget):
        return None
      return plan_micro_batches(batch_size, num_micro_batch=2)
    if streamed:
      plan = self.planner.known_plan(batch_size)
      return plan_micro_batches(batch_size, num_micro_batch=2) if plan is None or plan.num_micro_batches == 1 \
          else plan
    return self.planner.plan_for(batch_size)

  def run(self, shared_args, inputs, targets, plan: MicroBatchPlan) -> Optional[RunningCheck]:
    """Start the check of this batch cut by ``plan`` (:func:`check_first_batch`); its :class:`RunningCheck`, or
    ``None`` where it ran already (without jit) or could not start."""
    variables = self.parts.variables()
    with phase('first-batch check'), self.parts.quiet():
      running = check_first_batch(self.model, shared_args, inputs, targets, check_batch=self.parts.check_batch,
                                  plan=plan, forward=self.parts.forward, loss_of=self.parts.loss_of,
                                  weigh=self.parts.weigh, variables=variables, jit=self.jit,
                                  reduction=self.reduction, declared=self.declared, has_metrics=self.has_metrics,
                                  use_found=self.parts.use_found, device=None if self.on_mesh else check_device())
    self._running = running  # the planner waits for it before timing trial steps
    return running
