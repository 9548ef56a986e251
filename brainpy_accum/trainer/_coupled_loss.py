"""The default mode's one-time check, at the first batch, that ``loss_fun`` is a mean over samples.

Accumulating micro-batch gradients trains the weighted mean (``'sum'``: the sum) of the micro-batch losses.
For a loss that couples the samples of a batch (a batch-wide regulariser, a maximum) that is another
objective. One forward pass of the first batch, cut as training cuts it, gives the whole batch's predictions
and monitors; from them the check compares, touching ``loss_fun`` only (no model backward pass):

- the loss of the whole batch with the combination of the micro-batch losses;
- the gradient of the one with the gradient of the other with respect to the predictions and monitors,
  at the real outputs and at random ones in their place. A coupling whose value vanishes on the first
  batch (a spike-count penalty of a network that does not spike yet) still has a gradient there, and a
  coupling whose gradient vanishes too (a squared spike count) has one at random outputs.

If either differs, a warning says by how much and points to ``whole_batch_loss=True``. A loss that is a
weighted mean (``'sum'``: a sum) of per-sample terms agrees everywhere, to float32 round-off. What it cannot
see: a coupling through something other than the outputs (a loss that reads a Variable), or one that only
shows at outputs unlike both points checked. The check changes nothing, never stops training, and is one
compiled function. It is skipped (nothing to compile) when ``loss_fun`` is BrainPy's own
``mean_squared_error`` or ``mean_absolute_error`` with its default mean, without metrics, ``loss_weight_fn``
or ``grad_reduction='sum'``: a mean over every element is a mean over samples, whatever the values.
"""

import functools
import threading
import warnings
from typing import Callable, Optional, Sequence

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np

from ..core._batch import is_array, take_samples
from ..core._combine import finish_values
from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._metrics import MetricsError, MetricPlan, finish_metrics, metric_name, plan_from_shapes
from ..core._shapes import first_samples
from ..core._states import values_restored, whole_batch_variables
from ..core._two_pass import forward_pass
from ..diagnostics._compiles import QUICK_COMPILE, UNCOUNTED_THREAD_PREFIX

__all__ = ['MEANS_OVER_ELEMENTS', 'check_first_batch', 'check_in_background', 'check_loss', 'combined_loss',
           'gradient_gaps', 'warn_coupled_gradient', 'warn_coupled_loss', 'warn_if_coupled', 'whole_and_combined_loss']


# BrainPy's losses that are, with their default reduction, the mean over every element of every leaf (a sum of
# such means for a tree of outputs): a mean over samples for any values, so the first-batch check has nothing to see.
# (Not cross_entropy_loss: with integer labels it divides by the count of labels other than ignore_index,
# which couples the samples when a batch holds ignored labels.)
MEANS_OVER_ELEMENTS = (bp.losses.mean_squared_error, bp.losses.mean_absolute_error)


def whole_and_combined_loss(forward: Callable, loss_of: Callable, weigh: Callable, args: tuple, axes,
                            plan: MicroBatchPlan, states, reduction: str, names=None, declared=None):
  """``(loss of the whole batch, combination of the micro-batch losses, gradient gaps, metrics)`` from one
  forward pass.

  ``forward(micro_args, size)`` gives what ``loss_of(outputs, targets) -> (loss, aux)`` receives; ``args``
  is ``(inputs, targets)``; ``states`` hold the whole batch. The gaps are :func:`gradient_gaps`'; ``names``
  (an object with lists ``names`` and ``metrics``), if given, receives the compared outputs' and metrics'
  paths. ``metrics``: the whole batch's scalar metrics and their combinations over the micro-batches (by
  ``declared``, the ``aux_reduction``), two lists.
  """
  micro_loss = lambda outputs, micro_args: loss_of(outputs, micro_args[1])
  metrics_of = functools.partial(_metric_plan, loss_of, args, axes, declared or {}, reduction, plan.batch_size)
  sums, out_axes, metrics = forward_pass(forward, args, axes, plan, states, micro_loss, weigh, metrics_of)
  whole = lambda outputs: bm.as_jax(loss_of(outputs, args[1])[0])
  combined = combined_loss(loss_of, weigh, args, axes, out_axes, plan, reduction)
  gaps = gradient_gaps(whole, combined, sums.samples, out_axes, None if names is None else names.names)
  whole_loss, whole_aux = loss_of(sums.samples, args[1])  # one evaluation gives the loss and the metrics
  combined_aux = finish_metrics(sums.aux_sum, metrics.rules, sums.total_weight, sums.count, metrics.mean_by_weight)
  paths = jax.tree_util.tree_flatten_with_path(whole_aux)[0]
  scalar = [i for i, rule in enumerate(metrics.rules) if rule.axis is None]
  if names is not None:
    names.metrics[:] = [(jax.tree_util.keystr(paths[i][0]), metric_name(paths[i][0]), metrics.rules[i].reduction)
                        for i in scalar]
  pick = lambda tree: [jax.tree_util.tree_leaves(tree)[i] for i in scalar]
  return (bm.as_jax(whole_loss), finish_values(sums.loss_sum, sums.total_weight, reduction), gaps,
          (pick(whole_aux), pick(combined_aux)))


def _metric_plan(loss_of: Callable, args: tuple, axes, declared, reduction: str, batch_size: int, small, large,
                 sizes) -> MetricPlan:
  """The metrics' plan from the outputs' shapes ``small`` and ``large`` at the micro-batch ``sizes``: the loss
  alone is traced (``jax.eval_shape``), not the model."""
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)

  def metrics_at(outputs, n):
    micro_args = treedef.unflatten([x if a is None else first_samples(x, a, n) for x, a in zip(leaves, axes)])
    return jax.eval_shape(lambda o, t: loss_of(o, t)[1], outputs, micro_args[1])

  return plan_from_shapes(metrics_at(small, sizes[0]), metrics_at(large, sizes[1]), sizes, declared, reduction,
                          batch_size)


def combined_loss(loss_of: Callable, weigh: Callable, args: tuple, axes, out_axes, plan: MicroBatchPlan,
                  reduction: str) -> Callable:
  """``outputs -> `` the weighted mean (``'sum'``: the sum) of ``loss_of`` on each micro-batch of ``outputs``:
  the objective that accumulating micro-batch gradients trains, as a function of the whole batch's outputs."""
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)

  def one(outputs, start, size):
    out_leaves, out_def = jax.tree_util.tree_flatten(outputs)
    micro_args = treedef.unflatten([x if a is None else take_samples(x, a, start, size) for x, a in zip(leaves, axes)])
    micro_out = out_def.unflatten([o if a is None else take_samples(o, a, start, size)
                                   for o, a in zip(out_leaves, out_axes)])
    weight = jnp.asarray(weigh(micro_args, size), jnp.float32)
    return weight * bm.as_jax(loss_of(micro_out, micro_args[1])[0]).astype(jnp.float32), weight

  def combined(outputs):
    def body(carry, index):
      loss, weight = one(outputs, index * plan.micro_batch_size, plan.micro_batch_size)
      return (carry[0] + loss, carry[1] + weight), None

    zero = jnp.zeros((), jnp.float32)
    (total, weight), _ = jax.lax.scan(body, (zero, zero), jnp.arange(plan.num_full))
    if plan.remainder:
      loss, last = one(outputs, plan.num_full * plan.micro_batch_size, plan.remainder)
      total, weight = total + loss, weight + last
    return finish_values(total, weight, reduction)

  return combined


def gradient_gaps(whole: Callable, combined: Callable, outputs, out_axes, names: Optional[list] = None) -> jax.Array:
  """How far apart the gradients of ``whole`` and ``combined`` are, with respect to each floating-point output
  with a batch axis: ``|g_whole - g_combined| / (|g_whole| + |g_combined|)`` (norms over the leaf), at the
  real ``outputs`` (row 0) and at random values in [0, 1) in their place (row 1); 0 where either gradient is
  not finite (a loss undefined at random outputs) or both are 0. A mean over samples gives round-off only.
  ``names``, if given, receives the compared outputs' paths."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(outputs)
  leaves = [x for _, x in paths]
  chosen = [i for i, (x, a) in enumerate(zip(leaves, out_axes))
            if a is not None and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
  if names is not None:
    names[:] = [jax.tree_util.keystr(paths[i][0]) for i in chosen]
  if not chosen:
    return jnp.zeros((2, 0), jnp.float32)

  def at(values):
    def of(f):
      def g(picked):
        full = list(leaves)
        for i, v in zip(chosen, picked):
          full[i] = v
        return f(treedef.unflatten(full))
      return jax.grad(g)(values)

    gaps = []
    for gw, gc in zip(of(whole), of(combined)):
      gw, gc = jnp.ravel(gw).astype(jnp.float32), jnp.ravel(gc).astype(jnp.float32)
      scale = jnp.linalg.norm(gw) + jnp.linalg.norm(gc)
      gap = jnp.linalg.norm(gw - gc) / jnp.where(scale > 0, scale, 1.)
      gaps.append(jnp.where(jnp.isfinite(gap), gap, 0.))
    return jnp.stack(gaps)

  real = [jnp.asarray(leaves[i]) for i in chosen]
  keys = jax.random.split(jax.random.PRNGKey(0), len(chosen))
  noise = [jax.random.uniform(k, x.shape, x.dtype) for k, x in zip(keys, real)]
  return jnp.stack([at(real), at(noise)])


def check_loss(compare: Callable, variables: Sequence, plan: MicroBatchPlan, reduction: str) -> None:
  """Run ``compare() -> (whole, combined, gaps, metrics)``, give ``variables`` their values back, and warn if
  they differ.

  A check that fails warns instead of raising: it must never stop training that would run without it.
  """
  names = _Names()  # the outputs and metrics compared, named while ``compare`` is traced
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
  """Warn about the loss, its gradient and its scalar metrics from ``compare``'s ``result``."""
  whole, combined, gaps, (whole_metrics, combined_metrics) = result
  if not warn_coupled_loss(float(whole), float(combined), plan, reduction):
    warn_coupled_gradient(np.asarray(gaps), names.names, plan, reduction)
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
  for a step that raised): XLA compiles the check while the first train step is traced, compiled and run, and
  the check's result does not depend on that step. No thread outlives the call of ``finish``."""
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


def warn_coupled_gradient(gaps: np.ndarray, names: Sequence[str], plan: MicroBatchPlan, grad_reduction: str,
                          rtol: float = 1e-3) -> bool:
  """Warn if :func:`gradient_gaps` (rows: real and random outputs; columns: the outputs ``names``) shows a
  gradient of the whole batch's loss that the micro-batch losses do not have. Returns whether it warned."""
  if gaps.size == 0 or gaps.max() <= rtol:
    return False
  point = 0 if gaps[0].max() > rtol else 1  # the first batch's own outputs first
  leaf = int(np.argmax(gaps[point]))
  name = names[leaf] if leaf < len(names) else f'#{leaf}'
  where = 'on the first batch' if point == 0 else 'at random outputs in place of the first batch\'s'
  how = 'sum' if grad_reduction == 'sum' else 'weighted mean'
  warnings.warn(f'loss_fun couples the samples of a batch: its value on the whole batch equals the {how} of '
                f'its values on the {plan.describe_cuts()} micro-batches, but its gradient with respect to the '
                f'outputs{name} does not ({where}: relative difference {gaps[point, leaf]:.3g}), e.g. a penalty on the '
                f'spike count summed over the batch while no neuron spikes yet. Accumulating micro-batch '
                f'gradients would train that other objective. Pass whole_batch_loss=True to train the '
                f'whole-batch loss exactly (about one extra forward pass), or make the loss a mean over samples.',
                UserWarning, stacklevel=2)
  return True


def warn_coupled_loss(whole: float, combined: float, plan: MicroBatchPlan, grad_reduction: str,
                      rtol: float = 1e-5, atol: float = 1e-6) -> bool:
  """Warn if the loss of the whole batch differs from the combination of its micro-batch losses.

  Both come from the same predictions, so a loss that is a weighted mean (``'sum'``: a sum) of per-sample
  terms agrees to float32 round-off; one that couples the samples does not. Returns whether it warned.
  """
  if abs(whole - combined) <= atol + rtol * abs(whole):
    return False
  how = 'sum' if grad_reduction == 'sum' else 'weighted mean'
  warnings.warn(f'loss_fun couples the samples of a batch: on the first batch its value on the whole batch is '
                f'{whole:.7g}, but the {how} of its values on the {plan.describe_cuts()} micro-batches is '
                f'{combined:.7g} (difference {whole - combined:.3g}). Accumulating micro-batch gradients would '
                f'train that other objective (e.g. a batch-wide firing-rate regulariser shrinks with the '
                f'micro-batch). Pass whole_batch_loss=True to train the whole-batch loss exactly (about one '
                f'extra forward pass), or make the loss a mean over samples.', UserWarning, stacklevel=2)
  return True


def check_first_batch(model, shared_args, inputs, targets, *, check_batch: Callable, plan_for: Callable,
                      forward: Callable, loss_of: Callable, weigh: Callable, variables: Sequence, jit: bool,
                      reduction: str, declared: Optional[dict] = None) -> Optional[Callable[..., None]]:
  """Default mode, first batch: warn if the loss is not the weighted mean of its micro-batch values.

  ``check_batch(inputs, targets) -> BatchLayout``; ``plan_for(batch_size)``: the batch's micro-batches;
  ``forward(shared_args)``: the ``forward(micro_args, size)`` of :func:`whole_and_combined_loss`;
  ``loss_of(predicts, targets) -> (loss, aux)``; ``weigh(micro_args, size)``: a micro-batch's weight;
  ``variables``: what the check must leave as it found it; ``jit``: compile the forward pass.

  With ``jit`` the check is compiled and run beside the first train step (:func:`check_in_background`); the
  returned ``finish()``, called after that step, waits for it and warns. Without: it runs and warns now, and
  ``None`` is returned.
  """
  layout = check_batch(inputs, targets)
  plan = plan_micro_batches(layout.batch_size, micro_batch_size=plan_for(layout.batch_size).micro_batch_size)
  if plan.num_micro_batches == 1:
    return None

  def compare(names, shared_args, inputs, targets):
    layout = check_batch(inputs, targets)
    axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    with whole_batch_variables(model, layout.batch_size) as states:
      return whole_and_combined_loss(forward(shared_args), loss_of, weigh, (inputs, targets), axes, plan, states,
                                     reduction, names, declared)

  if jit:  # it runs once: compiled quickly (unoptimised code), beside the first step
    return check_in_background(bm.jit(compare, static_argnums=(0, 1)), shared_args, inputs, targets, variables,
                               plan, reduction)
  check_loss(lambda names: compare(names, shared_args, inputs, targets), variables, plan, reduction)
  return None


class _Names:
  """Lists to fill while tracing (outputs, metrics), hashable by identity, so that ``jit`` can take them as a
  static argument."""

  def __init__(self):
    self.names, self.metrics = [], []
