"""The default mode's one-time check, at the first batch, that ``loss_fun`` is a mean over samples.

Accumulating micro-batch gradients trains the weighted mean (``'sum'``: the sum) of the micro-batch losses.
For a loss that couples the samples of a batch (a batch-wide regulariser, a maximum) that is another
objective. The check evaluates ``loss_fun`` alone, on the first batch's data (targets, and inputs for
``loss_weight_fn``) with random outputs in place of the model's, at two points (:data:`POINTS`: uniform
values, and 0-or-1 values like spikes): the loss of the whole batch against the combination of the
micro-batch losses, and each scalar metric against its declared combination. The model is only traced, for
its outputs' shapes: nothing of it is compiled or run, so the check costs one small compilation. Random
outputs show what the model's first outputs may hide: a spike-count penalty summed over the batch is 0 on
every micro-batch while no neuron spikes yet, but not at either point.

If either differs, a warning says by how much and points to ``whole_batch_loss=True``. A loss that is a
weighted mean (``'sum'``: a sum) of per-sample terms agrees everywhere, to float32 round-off. What it cannot
see: a coupling through something other than the outputs (a loss that reads a Variable), or one that only
shows at outputs unlike both points checked (and not at all where the loss is not finite at either: then it
says so). The check changes nothing, never stops training, and is one
compiled function. It is skipped (nothing to compile) when ``loss_fun`` is BrainPy's own
``mean_squared_error`` or ``mean_absolute_error`` with its default mean, without metrics, ``loss_weight_fn``
or ``grad_reduction='sum'``: a mean over every element is a mean over samples, whatever the values.
"""

import functools
import threading
import warnings
from typing import Callable, NamedTuple, Optional, Sequence

import brainpy as bp
import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from ..core._batch import is_array
from ..core._combine import finish_values
from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._metrics import MetricsError, MetricPlan, finish_metrics, metric_name, plan_from_shapes
from ..core._shapes import first_samples
from ..core._states import values_restored, whole_batch_variables
from ..core._two_pass import forward_pass, output_axes, second_sizes, traced_shapes, whole_batch_like
from ..diagnostics._compiles import QUICK_COMPILE, UNCOUNTED_THREAD_PREFIX

__all__ = ['MEANS_OVER_ELEMENTS', 'POINTS', 'CheckParts', 'FirstBatchCheck', 'check_first_batch', 'check_in_background', 'check_loss',
           'loss_at_random_outputs', 'random_outputs', 'warn_coupled_loss', 'warn_if_coupled']


# BrainPy's losses that are, with their default reduction, the mean over every element of every leaf (a sum of
# such means for a tree of outputs): a mean over samples for any values, so the first-batch check has nothing to see.
# (Not cross_entropy_loss: with integer labels it divides by the count of labels other than ignore_index,
# which couples the samples when a batch holds ignored labels.)
MEANS_OVER_ELEMENTS = (bp.losses.mean_squared_error, bp.losses.mean_absolute_error)


# Where the loss is evaluated in place of the model's outputs: (name in the warning, how each leaf is drawn).
POINTS = ('uniform in [0.1, 0.9)', '0 or 1, like spikes')


def random_outputs(like, point: int):
  """Values for the output shapes ``like`` (a tree of ``jax.ShapeDtypeStruct``): floating leaves in [0.1, 0.9) at
  point 0 (inside every probability's and logarithm's domain) and 0 or 1 at point 1 (spikes); integer and
  boolean leaves 0 or 1 at both.

  Each value comes from a fixed integer hash of the element's position, its leaf and the point: values that
  vary from element to element with no pattern a loss could line up with, from a few integer operations (JAX's
  random generator would cost the check's compilation more than the loss itself does).
  """
  leaves, treedef = jax.tree_util.tree_flatten(like)
  return treedef.unflatten([_hashed(x, i, point) for i, x in enumerate(leaves)])


def _hashed(like, leaf: int, point: int):
  """Leaf number ``leaf``'s values at ``point`` (see :func:`random_outputs`), from a 32-bit integer hash of each
  element's index."""
  size = int(np.prod(like.shape, dtype=np.int64))
  seed = 2 * leaf + point
  bits = jax.lax.iota(jnp.uint32, size) + jnp.uint32((seed + 1) * 0x9E3779B9 % 2 ** 32)
  for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):  # a well-mixing 32-bit hash (two rounds)
    bits = (bits ^ (bits >> shift)) * jnp.uint32(factor)
  bits = bits ^ (bits >> 16)
  uniform = (bits >> 8).astype(jnp.float32) * (1. / 2 ** 24)  # in [0, 1)
  if jnp.issubdtype(like.dtype, jnp.floating) and point == 0:
    value = 0.1 + 0.8 * uniform
  else:
    value = (uniform < 0.5).astype(jnp.float32)
  return value.reshape(like.shape).astype(like.dtype)


def loss_at_random_outputs(loss_of: Callable, weigh: Callable, args: tuple, axes, outputs_like, out_axes,
                           plan: MicroBatchPlan, reduction: str, names=None, declared=None, has_metrics: bool = True):
  """``(whole, combined, metrics)``: at each of :data:`POINTS`, the loss of the whole batch and the combination
  (weighted mean, ``'sum'``: sum) of the micro-batch losses, with random outputs shaped ``outputs_like`` (the
  whole batch's; batch axes ``out_axes``) in place of the model's and the batch's own ``args``
  (``(inputs, targets)``, batch axes ``axes``). ``metrics``: the whole batch's scalar metrics and their
  combinations over the micro-batches (by ``declared``, the ``aux_reduction``) at point 0, two lists.
  ``names``, if given, receives the metrics' paths; ``has_metrics=False``: the loss has none (not traced for
  their shapes). Only ``loss_fun`` runs: no model, nothing to restore.
  """
  forward = lambda micro_args, size: micro_args[2]  # the outputs' micro-batch, cut like the data
  micro_loss = lambda outputs, micro_args: loss_of(outputs, micro_args[1])
  weigh_data = lambda micro_args, size: weigh(micro_args[:2], size)
  metric_plan = functools.partial(_metric_plan, loss_of if has_metrics else None, args, axes, declared or {},
                                  reduction, plan.batch_size)
  planned = []

  def metrics_of(small, large, sizes):  # the same output shapes at both points: the metrics are planned once
    if not planned:
      planned.append(metric_plan(small, large, sizes))
    return planned[0]

  wholes, combined = [], []
  for point in range(len(POINTS)):
    outputs = random_outputs(outputs_like, point)
    sums, _, metrics = forward_pass(forward, tuple(args) + (outputs,), list(axes) + list(out_axes), plan, [],
                                    micro_loss, weigh_data, metrics_of)
    whole_loss, whole_aux = loss_of(outputs, args[1])  # one evaluation gives the loss and the metrics
    wholes.append(bm.as_jax(whole_loss).astype(jnp.float32))
    combined.append(finish_values(sums.loss_sum, sums.total_weight, reduction).astype(jnp.float32))
    if point == 0:
      combined_aux = finish_metrics(sums.aux_sum, metrics.rules, sums.total_weight, sums.count,
                                    metrics.mean_by_weight)
      paths = jax.tree_util.tree_flatten_with_path(whole_aux)[0]
      scalar = [i for i, rule in enumerate(metrics.rules) if rule.axis is None]
      if names is not None:
        names.metrics[:] = [(jax.tree_util.keystr(paths[i][0]), metric_name(paths[i][0]), metrics.rules[i].reduction)
                            for i in scalar]
      pick = lambda tree: [jax.tree_util.tree_leaves(tree)[i] for i in scalar]
      point_metrics = (pick(whole_aux), pick(combined_aux))
  return jnp.stack(wholes), jnp.stack(combined), point_metrics


def _metric_plan(loss_of: Optional[Callable], args: tuple, axes, declared, reduction: str, batch_size: int, small,
                 large, sizes) -> MetricPlan:
  """The metrics' plan from the outputs' shapes ``small`` and ``large`` at the micro-batch ``sizes``: the loss
  alone is traced (brainstate's ``eval_shape``: a loss that draws random numbers or writes a Variable leaves
  them as they were, with or without jit), not the model; ``loss_of=None``: a loss without metrics."""
  if loss_of is None:
    return plan_from_shapes({}, {}, sizes, declared, reduction, batch_size)
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)

  def metrics_at(outputs, n):
    micro_args = treedef.unflatten([x if a is None else first_samples(x, a, n) for x, a in zip(leaves, axes)])
    return brainstate.transform.eval_shape(lambda o, t: loss_of(o, t)[1], outputs, micro_args[1])

  return plan_from_shapes(metrics_at(small, sizes[0]), metrics_at(large, sizes[1]), sizes, declared, reduction,
                          batch_size)


def check_loss(compare: Callable, variables: Sequence, plan: MicroBatchPlan, reduction: str) -> None:
  """Run ``compare(names) -> (whole, combined, metrics)`` (:func:`loss_at_random_outputs`'), give ``variables``
  their values back, and warn if they differ.

  A check that fails warns instead of raising: it must never stop training that would run without it.
  """
  names = _Names()  # the metrics compared, named while ``compare`` is traced
  with values_restored(variables):
    try:
      result = compare(names)
    except MetricsError:  # the user's metrics need a fix: the step would raise it too, so say it now
      raise
    except Exception as error:
      _could_not_check(error)
      return
  warn_if_coupled(result, names, plan, reduction)


def warn_if_coupled(result, names: '_Names', plan: MicroBatchPlan, reduction: str) -> None:
  """Warn about the loss and its scalar metrics from ``compare``'s ``result`` (:func:`loss_at_random_outputs`')."""
  whole, combined, (whole_metrics, combined_metrics) = result
  whole, combined = np.asarray(whole, np.float64), np.asarray(combined, np.float64)
  usable = [p for p in range(len(POINTS)) if np.isfinite(whole[p]) and np.isfinite(combined[p])]
  if not usable:
    warnings.warn(f'Could not check whether loss_fun is a mean over samples: it is not finite at random outputs '
                  f'({" nor ".join(POINTS)}); if it couples the samples of a batch, pass whole_batch_loss=True.',
                  UserWarning, stacklevel=2)
    return
  for point in usable:
    if warn_coupled_loss(whole[point], combined[point], plan, reduction, POINTS[point]):
      break
  warn_metrics(names.metrics, [np.asarray(v) for v in whole_metrics], [np.asarray(v) for v in combined_metrics],
               plan)


def _could_not_check(error: Exception) -> None:
  warnings.warn(f'Could not check whether loss_fun is a mean over samples ({type(error).__name__}: '
                f'{str(error)[:200]}); if it couples the samples of a batch, pass whole_batch_loss=True.',
                UserWarning, stacklevel=6)  # fit's line


def check_in_background(step, shared_args, inputs, targets, variables: Sequence, plan: MicroBatchPlan,
                        reduction: str) -> Optional[Callable[..., None]]:
  """Trace and lower the jitted ``step(names, shared_args, inputs, targets)`` here (errors in the user's metrics
  raise now, before anything changes), then compile and run it on a background thread, on the Variables'
  values of now. Returns ``finish(report=True)``, which waits for it and warns (``report=False``: only waits,
  for a step that raised): XLA compiles and runs the check while fit goes on (the planner's search, or the
  first train steps, dispatched before the check is traced), and the check's result does not depend on what
  those steps change. No thread outlives the call of ``finish``."""
  names = _Names()
  with values_restored(variables):
    try:
      values = step.stateful_fun.get_state_trace(names, shared_args, inputs, targets,
                                                 compile_if_miss=True).get_state_values()
      lowered = step.jitted_fun.lower(values, names, shared_args, inputs, targets)
    except MetricsError:
      raise
    except Exception as error:
      _could_not_check(error)
      return None
  done: dict = {}

  def run():  # runs the check on the values above; the new values it returns are dropped: nothing changes
    try:
      compiled = lowered.compile(compiler_options=QUICK_COMPILE)
      done['result'] = jax.device_get(compiled(values, inputs, targets)[1])
    except Exception as error:  # reported by finish(), on the caller's thread
      done['error'] = error

  thread = threading.Thread(target=run, name=f'{UNCOUNTED_THREAD_PREFIX} first-batch check', daemon=True)
  thread.start()

  def finish(report: bool = True) -> None:
    thread.join()
    if not report:
      return
    if 'error' in done:
      _could_not_check(done['error'])
    else:
      warn_if_coupled(done['result'], names, plan, reduction)

  return finish


def warn_metrics(names: Sequence, whole: Sequence[np.ndarray], combined: Sequence[np.ndarray], plan: MicroBatchPlan,
                 rtol: float = 1e-5, atol: float = 1e-6) -> list:
  """Warn once for every scalar metric whose whole-batch value differs from its combination over the micro-batches.

  ``names``: ``(path, name, reduction)`` of each metric. Returns the paths warned about.
  """
  warned = []
  for (path, name, how), w, c in zip(names, whole, combined):
    if w.shape == c.shape and np.allclose(w.astype(np.float64), c.astype(np.float64), rtol=rtol, atol=atol) \
        and w.dtype == c.dtype:
      continue
    warned.append(path)
    fix = {'mean': "'sum' for a count, 'max' or 'min' for an extreme", 'sum': "'mean' for a mean over samples"}.get(
      how, "'mean' or 'sum'")
    warnings.warn(f'The metric metrics{path} of loss_fun is {_show(w)} on the whole first batch, but its {how!r} over '
                  f'the {plan.describe_cuts()} micro-batches is {_show(c)}: the recorded history would differ from '
                  f'bp.BPTT\'s. Declare how it combines with aux_reduction={{{name!r}: ...}} ({fix}), make it a '
                  f'per-sample array (stitched exactly) or a mean over samples, or pass whole_batch_loss=True to '
                  f'compute the metrics on the whole batch.', UserWarning, stacklevel=2)
  return warned


def _show(value: np.ndarray) -> str:
  text = np.array2string(value, precision=7, threshold=6) if value.ndim else f'{value.item():.7g}'
  return f'{text} ({value.dtype})'


def warn_coupled_loss(whole: float, combined: float, plan: MicroBatchPlan, grad_reduction: str, point: str,
                      rtol: float = 1e-5, atol: float = 1e-6) -> bool:
  """Warn if the loss of the whole batch differs from the combination of its micro-batch losses, both at the
  same random outputs (drawn as ``point`` says).

  A loss that is a weighted mean (``'sum'``: a sum) of per-sample terms agrees to float32 round-off at any
  outputs; one that couples the samples does not. Returns whether it warned.
  """
  if abs(whole - combined) <= atol + rtol * abs(whole):
    return False
  how = 'sum' if grad_reduction == 'sum' else 'weighted mean'
  warnings.warn(f'loss_fun couples the samples of a batch: with the first batch\'s data and random outputs '
                f'({point}) in place of the model\'s, its value on the whole batch is {whole:.7g}, but the {how} '
                f'of its values on the {plan.describe_cuts()} micro-batches is {combined:.7g} (difference '
                f'{whole - combined:.3g}). Accumulating micro-batch gradients would train that other objective '
                f'(e.g. a batch-wide firing-rate regulariser, or a spike count summed over the batch, shrinks '
                f'with the micro-batch). Pass whole_batch_loss=True to train the whole-batch loss exactly '
                f'(about one extra forward pass), or make the loss a mean over samples.', UserWarning, stacklevel=2)
  return True


def check_first_batch(model, shared_args, inputs, targets, *, check_batch: Callable, plan: MicroBatchPlan,
                      forward: Callable, loss_of: Callable, weigh: Callable, variables: Sequence, jit: bool,
                      reduction: str, declared: Optional[dict] = None, has_metrics: bool = True
                      ) -> Optional[Callable[..., None]]:
  """Default mode, first batch: warn if the loss is not the weighted mean of its micro-batch values.

  ``check_batch(inputs, targets) -> BatchLayout``; ``plan``: the micro-batches of the batch (of each device's
  share, with a mesh): the check cuts the whole batch into micro-batches of its size;
  ``forward(shared_args)``: the model as ``forward(micro_args, size) -> outputs`` (traced only, for the outputs'
  shapes);
  ``loss_of(predicts, targets) -> (loss, aux)``; ``weigh(micro_args, size)``: a micro-batch's weight;
  ``variables``: what the check must leave as it found it; ``jit``: compile the check; ``declared``: the
  metrics' ``aux_reduction``; ``has_metrics``: whether ``loss_of`` returns any (``loss_has_aux``).

  With ``jit`` the check is compiled and run beside the first train steps (:func:`check_in_background`); the
  returned ``finish()``, called after them, waits for it and warns. Without: it runs and warns now, and
  ``None`` is returned.
  """
  # the whole batch cut into micro-batches of the plan's size (with a mesh the plan cuts one device's share)
  plan = plan_micro_batches(check_batch(inputs, targets).batch_size, micro_batch_size=plan.micro_batch_size)
  if plan.num_micro_batches == 1:
    return None

  def compare(names, shared_args, inputs, targets):
    layout = check_batch(inputs, targets)
    axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    with whole_batch_variables(model, layout.batch_size) as states:  # the outputs' shapes: the model is traced only
      small, large = traced_shapes(forward(shared_args), (inputs, targets), axes, states, second_sizes(plan))
    out_axes = output_axes(small, large)
    return loss_at_random_outputs(loss_of, weigh, (inputs, targets), axes,
                                  whole_batch_like(small, out_axes, plan.batch_size), out_axes, plan, reduction,
                                  names, declared, has_metrics)

  if jit:  # it runs once: compiled quickly (unoptimised code), beside the first step
    return check_in_background(bm.jit(compare, static_argnums=(0, 1)), shared_args, inputs, targets, variables,
                               plan, reduction)
  check_loss(lambda names: compare(names, shared_args, inputs, targets), variables, plan, reduction)
  return None


class _Names:
  """A list to fill while tracing (the compared metrics), hashable by identity, so that ``jit`` can take it as
  a static argument."""

  def __init__(self):
    self.metrics = []


class CheckParts(NamedTuple):
  """What the first-batch check reads of the trainer, handed over by it.

  ``check_batch(inputs, targets) -> BatchLayout``; ``plan_for(batch_size)``, ``known_plan(batch_size)``: the
  planner's plans (:class:`~brainpy_accum.memory._planner.Planner`); ``argument_bytes(inputs, targets)`` and
  ``budget()``: whether the check fits beside planning; ``check_flat_states(shared_args, args, axes, plan,
  states, batch_size)``: the error naming ``batch_axis`` for a model that fails on a micro-batch;
  ``quiet()``: tracing without time-step bars; ``forward``, ``loss_of``, ``weigh``: the model's loss;
  ``variables()``: what the check must leave as it found it.
  """
  check_batch: Callable
  plan_for: Callable
  known_plan: Callable
  argument_bytes: Callable
  budget: Callable[[], Optional[int]]
  check_flat_states: Callable
  quiet: Callable
  forward: Callable
  loss_of: Callable
  weigh: Callable
  variables: Callable[[], list]


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
    self._running: Optional[Callable[..., None]] = None  # the check's finish(), once started

  def wait(self) -> None:
    """Wait for a check running beside planning (planning times trial steps after it), without its report."""
    if self._running is not None:
      self._running(report=False)

  def __call__(self, shared_args, inputs, targets, before_planning: bool = False, streamed: bool = False
               ) -> Optional[Callable[[], Optional[Callable[..., None]]]]:
    """Default mode, first batch: warn if the loss is not the weighted mean of its micro-batch values (once).

    A model that fails on a micro-batch raises now (the error that names the fix). Returns ``start()``, or
    ``None`` where there is nothing to check: ``start()`` checks the loss, on the values the Variables hold
    then (fit calls it once the first step is dispatched, so that the check's tracing overlaps the step's run;
    nothing the check computes depends on those values), and returns ``finish()`` for fit to call after the
    first step when the check runs beside it, else ``None``.
    ``before_planning`` (``num_micro_batch='auto'``, a batch not planned yet): cut in two, so that it can start
    before planning and compile beside the planner's search (its cut does not wait for the plan, and is the
    same whether the plan is searched or read from the plan cache); only where it can (jit, no mesh, the
    batch's data well within the budget), else ``None`` and fit checks the planned cut, beside the first step
    as usual. ``streamed``: ``inputs, targets`` are samples of a streamed batch, whose chunks combine like
    micro-batches: cut in two where their plan would not cut them.
    """
    if self.checked:
      return None
    layout = self.parts.check_batch(inputs, targets)
    plan = self._plan(layout.batch_size, inputs, targets, before_planning, streamed)
    if plan is None:
      return None
    self.checked = True
    if plan.num_micro_batches > 1:  # a model that fails on a micro-batch: the error that names the fix, first
      with whole_batch_variables(self.model, layout.batch_size) as states, \
           values_restored([var for var, _ in states]):
        self.parts.check_flat_states(shared_args, (inputs, targets), jax.tree_util.tree_leaves(
          (layout.input_axes, layout.target_axes)), plan, states, layout.batch_size)
    if self.loss_func in MEANS_OVER_ELEMENTS and not self.has_metrics and not self.weighted \
        and self.reduction == 'mean':
      return None  # a mean over every element is a mean over samples: nothing to check (see the module)
    return functools.partial(self._start, shared_args, inputs, targets, plan)

  def _plan(self, batch_size: int, inputs, targets, before_planning: bool, streamed: bool
            ) -> Optional[MicroBatchPlan]:
    """The cut the check compares the whole batch with (``None``: no check now)."""
    if before_planning:
      budget = self.parts.budget()
      if (batch_size < 2 or self.on_mesh or not self.jit or self.parts.known_plan(batch_size) is not None
          or 2 * self.parts.argument_bytes(inputs, targets) > budget):
        return None
      return plan_micro_batches(batch_size, num_micro_batch=2)
    if streamed:
      plan = self.parts.known_plan(batch_size)
      return plan_micro_batches(batch_size, num_micro_batch=2) if plan is None or plan.num_micro_batches == 1 \
          else plan
    return self.parts.plan_for(batch_size)

  def _start(self, shared_args, inputs, targets, plan: MicroBatchPlan) -> Optional[Callable[..., None]]:
    variables = self.parts.variables()
    with self.parts.quiet():
      finish = check_first_batch(self.model, shared_args, inputs, targets, check_batch=self.parts.check_batch,
                                 plan=plan, forward=self.parts.forward, loss_of=self.parts.loss_of,
                                 weigh=self.parts.weigh, variables=variables, jit=self.jit,
                                 reduction=self.reduction, declared=self.declared, has_metrics=self.has_metrics)
    self._running = finish  # the planner waits for it before timing trial steps
    return finish
