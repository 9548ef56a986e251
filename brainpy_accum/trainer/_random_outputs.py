"""What the default mode's first-batch check computes: ``loss_fun`` and its metrics at random outputs.

The check (:mod:`~brainpy_accum.trainer._coupled_loss`) needs, at each of :data:`POINTS`, the loss of the whole
batch and the combination of its micro-batch losses, at random outputs in place of the model's (i.i.d.
values, 0-or-1 values like spikes, and each micro-batch at a level of its own, :data:`LEVELS`, where batch-wide
means and norms differ between micro-batches); at :data:`LEVELS` the gradients of both with respect to the
outputs; every scalar metric, combined as declared or by each candidate reduction; and every stitched metric,
its micro-batches' rows put together by its rule (in each of ``ORDERS`` where it holds several rows per sample,
a flattened ``(T * B, ...)``), beside its whole-batch value. This module computes
all of it as one traced function (:func:`loss_at_random_outputs`, an :class:`Evidence`); the check compiles,
runs and reads it. What the evidence says is worded here too: the warnings of a coupled loss
(:func:`warn_coupled_loss`, :func:`warn_coupled`) and of metrics that do not combine (:func:`warn_metrics`,
:func:`found_reductions`).
"""

import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from ..core._accumulate import MicroResult, accumulate
from ..core._batch_stats import Statistics, applying, statistic_calls, statistic_term, statistics_pass
from ..core._batch import is_array
from ..core._combine import finish_values, scaled
from ..core._cut import MicroBatchPlan
from ..core._metrics import (AUX_REDUCTIONS, ORDERS, MetricPlan, default_reduction, finish_metrics, metric_name,
                             plan_from_shapes, reductions_that_fit, undeclared_leaves, with_candidates)
from ..core._batch import samples_shape
from ..core._two_pass import second_sizes, traced_shapes

__all__ = ['CheckNames', 'Evidence', 'LEVELS', 'POINTS', 'WHOLE', 'WHOLE_BATCH_FIX', 'found_reductions',
           'loss_at_random_outputs', 'random_outputs', 'warn_coupled', 'warn_coupled_loss', 'warn_metrics']


WHOLE = 'the whole batch'  # what the check compares with its micro-batches, as its warnings name it
# the fix the warnings name for a loss or metric that couples samples: it trains loss_fun of the whole batch as it
# is, and refuses the options that weigh micro-batches
WHOLE_BATCH_FIX = 'whole_batch_loss=True (with grad_reduction and loss_weight_fn left at their defaults)'


# Where the loss is evaluated in place of the model's outputs: (name in the warning, how each leaf is drawn).
POINTS = ('uniform in [0.1, 0.9)', '0 or 1, like spikes', 'each micro-batch at a level of its own')
LEVELS = 2  # the point whose micro-batches differ; the gradients with respect to the outputs are compared there


def random_outputs(like, point: int, axes: Optional[Sequence[Optional[int]]] = None,
                   micro_batch_size: Optional[int] = None):
  """Values for the output shapes ``like`` (a tree of ``jax.ShapeDtypeStruct``, the whole batch's) at one of
  :data:`POINTS`: floating leaves in [0.1, 0.9) at point 0 (inside every probability's and logarithm's domain)
  and 0 or 1 at point 1 (spikes); integer and boolean leaves 0 or 1 at both. At point 2 (:data:`LEVELS`) the
  samples of each micro-batch (``micro_batch_size`` samples on each leaf's batch axis in ``axes``) lie at a
  level of their own: the ``k``-th of ``M`` micro-batches in [0.1 + 0.8 k / M, 0.1 + 0.8 (k + 1/2) / M) (integer
  and boolean leaves: 1 with probability (k + 1) / (M + 1)), so that batch-wide means, variances and norms of
  the micro-batches differ from one another and from the whole batch's; leaves without a batch axis as at 0.

  Each value comes from a fixed integer hash of the element's position, its leaf and the point: values that
  vary from element to element with no pattern a loss could line up with, from a few integer operations (JAX's
  random generator would cost the check's compilation more than the loss itself does).

  >>> import jax, jax.numpy as jnp
  >>> like = jax.ShapeDtypeStruct((4, 3), jnp.float32)  # 4 samples on axis 0, in micro-batches of 2
  >>> levels = random_outputs(like, LEVELS, axes=[0], micro_batch_size=2)
  >>> bool((levels[:2] < 0.3).all()), bool((levels[2:] >= 0.5).all() and (levels[2:] < 0.7).all())
  (True, True)
  """
  leaves, treedef = jax.tree_util.tree_flatten(like)
  axes = [None] * len(leaves) if axes is None else list(axes)
  return treedef.unflatten([_hashed(x, i, point, a, micro_batch_size) for i, (x, a) in enumerate(zip(leaves, axes))])


def _hashed(like, leaf: int, point: int, axis: Optional[int] = None, micro_batch_size: Optional[int] = None):
  """Leaf number ``leaf``'s values at ``point`` (see :func:`random_outputs`), from a 32-bit integer hash of each
  element's index."""
  size = int(np.prod(like.shape, dtype=np.int64))
  seed = 2 * leaf + (point if point < LEVELS else 0)  # the levels point spreads point 0's draws
  bits = jax.lax.iota(jnp.uint32, size) + jnp.uint32((seed + 1) * 0x9E3779B9 % 2 ** 32)
  for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):  # a well-mixing 32-bit hash (two rounds)
    bits = (bits ^ (bits >> shift)) * jnp.uint32(factor)
  bits = bits ^ (bits >> 16)
  uniform = ((bits >> 8).astype(jnp.float32) * (1. / 2 ** 24)).reshape(like.shape)  # in [0, 1)
  floating = jnp.issubdtype(like.dtype, jnp.floating)
  if point == LEVELS and axis is not None:
    count = -(-like.shape[axis] // micro_batch_size)  # micro-batches
    k = (jax.lax.broadcasted_iota(jnp.int32, like.shape, axis) // micro_batch_size).astype(jnp.float32)
    value = 0.1 + 0.8 * (k + 0.5 * uniform) / count if floating else (uniform < (k + 1.) / (count + 1.))
  elif floating and point != 1:
    value = 0.1 + 0.8 * uniform
  else:
    value = uniform < 0.5
  return jnp.asarray(value, jnp.float32).astype(like.dtype)


class Evidence(NamedTuple):
  """What the check computes, at each of :data:`POINTS`: the loss, its metrics, their combinations."""
  whole: Any        # (points,) float32: the loss of the whole batch
  combined: Any     # (points,): the combination of the micro-batch losses (weighted mean; 'sum': sum)
  magnitude: Any    # (points,): that combination of their absolute values, the scale of its round-off
  gaps: Any         # (floating output leaves, 2), at LEVELS: the largest difference of the gradients of the two
  #                   with respect to the leaf, and the largest entry of either; None where JAX cannot take them
  metrics: Any      # at point 0, (whole, combined): the declared scalar metrics, two lists
  undecided: Any    # at each point, (whole, candidates): each undeclared scalar metric, and its combination by
  #                   each of AUX_REDUCTIONS
  stitched: Any     # at each point, (whole, candidates): each stitched metric, and its micro-batches' rows put
  #                   together by its rule (one row per sample) or in each of ORDERS (several)


def loss_at_random_outputs(loss_of: Callable, weigh: Callable, args: tuple, axes, outputs_like, out_axes,
                           plan: MicroBatchPlan, reduction: str, names=None, declared=None,
                           has_metrics: bool = True) -> Evidence:
  """The :class:`Evidence` of the loss and its metrics at each of :data:`POINTS`: the loss of the whole batch
  and the combination (weighted mean, ``'sum'``: sum) of the micro-batch losses, with random outputs shaped
  ``outputs_like`` (the whole batch's; batch axes ``out_axes``) in place of the model's and the batch's own
  ``args`` (``(inputs, targets)``, batch axes ``axes``); at :data:`LEVELS` their gradients with respect to the
  outputs too. Scalar metrics: those ``declared`` (the ``aux_reduction``) combined as declared, the others by
  each of :data:`AUX_REDUCTIONS`, exactly as a train step would combine them; stitched metrics put together by
  their rule, or in each of :data:`ORDERS` where they hold several rows per sample. ``names``, if given, receives
  the metrics' and the outputs' paths; ``has_metrics=False``: the loss has none (not traced for their shapes).
  Only ``loss_fun`` runs: no model, nothing to restore. The micro-batches of every point are evaluated in one
  scan of the engine (one program to compile, whatever the number of points).
  """
  names = CheckNames() if names is None else names
  declared = declared or {}
  points = [random_outputs(outputs_like, point, out_axes, plan.micro_batch_size) for point in range(len(POINTS))]
  # the whole batch at every point (at LEVELS with the gradients: they show a coupling however small its share)
  whole_of = lambda outputs: loss_of(outputs, args[1])  # one evaluation gives the loss and the metrics
  wholes = [whole_of(outputs) + (None,) if point != LEVELS else _with_gradients(whole_of, outputs)
            for point, outputs in enumerate(points)]
  names.leaves[:] = _floating_paths(points[LEVELS])
  metric_plan, (undecided, orders), metrics = _point_metrics(loss_of if has_metrics else None, args, axes, points[0],
                                                             out_axes, plan, declared, reduction, names)
  with_grads = wholes[LEVELS][2] is not None
  statistics = _statistics_at_points(loss_of, weigh, args, axes, points, out_axes, plan, names)
  micro_fn = _check_at_points(loss_of, weigh, (undecided, orders), points[LEVELS], out_axes, with_grads, statistics,
                              reduction)
  like, cut = _gradients_like(points[LEVELS], out_axes)
  split = lambda items, batch: [x for x, c in zip(items, cut) if c == batch]
  sums = accumulate(micro_fn, tuple(args) + tuple(points), list(axes) + list(out_axes) * len(POINTS), plan, [],
                    split(like, False) if with_grads else None, split(like, True) if with_grads else None,
                    split([out_axes[i] for i in _floating_leaves(points[LEVELS])], True) if with_grads else None,
                    metrics)
  extra = None if statistics is None or reduction != 'sum' else _extra_terms(
    loss_of, args, axes, points, out_axes, plan, statistics)
  return _evidence(wholes, sums, cut, metric_plan, metrics, (undecided, orders), reduction, extra)


def _point_metrics(loss_of: Optional[Callable], args: tuple, axes, outputs, out_axes, plan: MicroBatchPlan,
                   declared: dict, reduction: str, names):
  """How the metrics combine at every point: declared ones as declared, undeclared ones by every candidate,
  stitched ones of several rows per sample in each of :data:`ORDERS` too, and ``|loss|`` like the loss.
  ``(metric_plan, (undecided, orders), metrics)``: one point's plan, the positions of the undeclared scalars and
  of the stitched leaves of several rows, and the plan of all points' metrics together; ``names`` receives their
  paths (and the stitched leaves' shapes)."""
  sizes = second_sizes(plan)
  small, large = traced_shapes(lambda micro_args, size: micro_args[2], tuple(args) + (outputs,),
                               list(axes) + list(out_axes), [], sizes)
  metric_plan, paths, shapes = _metrics_by_shapes(loss_of, args, axes, declared, reduction, plan.batch_size, small,
                                                  large, sizes)
  undecided = undeclared_leaves(paths, metric_plan.rules, declared)
  rules = metric_plan.rules
  names.metrics[:] = [(jax.tree_util.keystr(paths[i]), metric_name(paths[i]), rule.reduction)
                      for i, rule in enumerate(rules) if rule.axis is None and i not in undecided]
  names.undecided[:] = [(jax.tree_util.keystr(paths[i]), metric_name(paths[i])) for i in undecided]
  names.stitched[:] = [(jax.tree_util.keystr(paths[i]), *shapes[i], sizes, rule)
                       for i, rule in enumerate(rules) if rule.axis is not None]
  orders = [i for i, rule in enumerate(rules) if rule.rows > 1]
  one = with_candidates(metric_plan, undecided, extra=[default_reduction(reduction)], orders=orders)  # one point's
  return metric_plan, (undecided, orders), one._replace(rules=one.rules * len(POINTS),
                                                        stitched_like=one.stitched_like * len(POINTS))


def _statistics_at_points(loss_of: Callable, weigh: Callable, args: tuple, axes, points: list, out_axes,
                          plan: MicroBatchPlan, names) -> Optional[List[Statistics]]:
  """Where ``loss_fun`` marks batch statistics (:func:`~brainpy_accum.batch_mean`), their values over the
  whole batch at every point, from one pass over the micro-batches, as a train step computes them (``names``
  receives theirs); ``None``: it marks none."""
  names.statistics[:] = statistic_calls(lambda micro_args, n: loss_of(micro_args[2], micro_args[1]),
                                        tuple(args) + (points[0],), list(axes) + list(out_axes), [], plan)
  if not names.statistics:
    return None

  def every_point(micro_args, n):
    for point in range(len(POINTS)):
      loss_of(micro_args[2 + point], micro_args[1])

  found = statistics_pass(every_point, lambda micro_args, n: weigh(micro_args[:2], n), tuple(args) + tuple(points),
                          list(axes) + list(out_axes) * len(POINTS), plan, [], [])
  return [found.part(point, len(POINTS)) for point in range(len(POINTS))]


def _extra_terms(loss_of: Callable, args: tuple, axes, points: list, out_axes, plan: MicroBatchPlan,
                 statistics: List[Statistics]):
  """``'sum'``: at every point, what the micro-batches' sum holds too much, as a train step takes it away: the
  statistics' term ``F(S)`` once per micro-batch but one (:func:`~brainpy_accum.core._batch_stats.statistic_term`)."""
  terms = [statistic_term(lambda micro_args, n: micro_args[2], lambda outputs, targets: loss_of(outputs, targets),
                          tuple(args) + (outputs,), list(axes) + list(out_axes), plan, [], found, [])
           for outputs, found in zip(points, statistics)]
  return (plan.num_micro_batches - 1.) * jnp.stack(terms)


def _gradients_like(outputs, out_axes) -> Tuple[list, list]:
  """The floating output leaves (the gradients' shapes: summed where whole, stitched on the batch axis where
  cut) and, for each, whether it has a batch axis."""
  leaves, floating = jax.tree_util.tree_leaves(outputs), _floating_leaves(outputs)
  return [leaves[i] for i in floating], [out_axes[i] is not None for i in floating]


def _check_at_points(loss_of: Callable, weigh: Callable, candidates: Tuple[list, list], outputs, out_axes,
                     with_grads: bool, statistics: Optional[List[Statistics]] = None,
                     reduction: str = 'mean') -> Callable:
  """The engine's ``micro_fn`` of the check: at every point the micro-batch's loss, its metrics (each undecided one
  per candidate reduction, each stitched one of several rows per sample per candidate order: ``candidates``, their
  positions) and ``|loss|``; at LEVELS each micro-batch's loss differentiated with respect to its slice of
  the outputs (the gradient of the combination: every slice's weighted gradient in its place, the weighted sum
  for outputs without a batch axis), cheaper to compile than the gradient of the scan. ``statistics``: the
  whole batch's batch statistics at each point, which every micro-batch's loss sees as in a train step."""
  _, cut = _gradients_like(outputs, out_axes)
  split = lambda items, batch: [x for x, c in zip(items, cut) if c == batch]
  undecided, orders = candidates

  def micro_loss(micro_args, outputs):
    loss, aux = loss_of(outputs, micro_args[1])
    leaves = jax.tree_util.tree_leaves(aux)
    return loss, (aux, [[leaves[i]] * len(AUX_REDUCTIONS) for i in undecided],
                  [[leaves[i]] * len(ORDERS) for i in orders], jnp.abs(bm.as_jax(loss)).astype(jnp.float32))

  def micro_fn(micro_args, size):
    weight = weigh(micro_args[:2], size)
    losses, auxs, grads = [], [], None
    for point in range(len(POINTS)):
      at = lambda outputs: micro_loss(micro_args, outputs)
      with applying(None if statistics is None else statistics[point], weight, reduction):
        if point == LEVELS and with_grads:
          loss, aux, grads = _with_gradients(at, micro_args[2 + point], required=True)
        else:
          loss, aux = at(micro_args[2 + point])
      losses.append(bm.as_jax(loss).astype(jnp.float32))
      auxs.append(aux)
    if grads is None:
      return MicroResult(None, jnp.stack(losses), auxs, weight)
    return MicroResult(split(grads, False), jnp.stack(losses), auxs, weight,
                       [scaled(weight, g) for g in split(grads, True)])

  return micro_fn


def _evidence(wholes: list, sums, cut: list, metric_plan, metrics, candidates: Tuple[list, list],
              reduction: str, extra=None) -> Evidence:
  """The :class:`Evidence` from the whole batch's values (``wholes``) and the micro-batches' ``sums``
  (``candidates``: the positions of the undecided scalars and of the stitched leaves of several rows), less
  ``extra`` at each point (``None``: nothing)."""
  undecided, orders = candidates
  finished = finish_metrics(sums.aux_sum, metrics.rules, sums.total_weight, sums.count, metrics.mean_by_weight)
  gaps = None
  if wholes[LEVELS][2] is not None:
    summed, stitched = iter(sums.grad_sum), iter(sums.samples)
    combined_grads = [next(stitched) if c else next(summed) for c in cut]
    gaps = _gaps(wholes[LEVELS][2], finish_values(combined_grads, sums.total_weight, reduction))
  compared = [i for i, rule in enumerate(metric_plan.rules) if rule.axis is None and i not in undecided]
  stitched = [i for i, rule in enumerate(metric_plan.rules) if rule.axis is not None]
  whole_metrics = [jax.tree_util.tree_leaves(aux) for _, aux, _ in wholes]
  put_together = lambda aux, copies: [copies[orders.index(i)] if i in orders else [jax.tree_util.tree_leaves(aux)[i]]
                                      for i in stitched]
  return Evidence(whole=jnp.stack([bm.as_jax(loss).astype(jnp.float32) for loss, _, _ in wholes]),
                  combined=finish_values(sums.loss_sum if extra is None else sums.loss_sum - extra,
                                         sums.total_weight, reduction),
                  magnitude=jnp.stack([point[-1] for point in finished]),
                  gaps=gaps,
                  metrics=([whole_metrics[0][i] for i in compared],
                           [jax.tree_util.tree_leaves(finished[0][0])[i] for i in compared]),
                  undecided=[([values[i] for i in undecided], copies)
                             for values, (_, copies, _, _) in zip(whole_metrics, finished)],
                  stitched=[([values[i] for i in stitched], put_together(aux, copies))
                            for values, (aux, _, copies, _) in zip(whole_metrics, finished)])


def _floating_leaves(outputs) -> List[int]:
  return [i for i, x in enumerate(jax.tree_util.tree_leaves(outputs)) if jnp.issubdtype(x.dtype, jnp.floating)]


def _floating_paths(outputs) -> List[str]:
  """The paths of the floating leaves of ``outputs`` as ``loss_fun`` receives them (``predicts[1]['V']``)."""
  paths = jax.tree_util.tree_flatten_with_path(outputs)[0]
  return [f'predicts{jax.tree_util.keystr(paths[i][0])}' for i in _floating_leaves(outputs)]


def _with_gradients(value_of: Callable, outputs, required: bool = False):
  """``(loss, rest, grads)`` of ``value_of(outputs) -> (loss, rest)``: ``grads`` with respect to the floating leaves
  of ``outputs`` (a list), or ``None`` where JAX cannot take them (a host callback without a derivative, a loss
  that is not a scalar): then only the value, and the check compares values alone (``required``: raise)."""
  leaves, treedef = jax.tree_util.tree_flatten(outputs)
  floating = _floating_leaves(outputs)

  def of(chosen):
    full = list(leaves)
    for i, x in zip(floating, chosen):
      full[i] = x
    loss, rest = value_of(treedef.unflatten(full))
    loss = bm.as_jax(loss).astype(jnp.float32)
    return loss, (loss, rest)

  try:  # brainstate's grad: a loss that writes a Variable or draws random numbers is differentiated as it is
    grads, (loss, rest) = brainstate.transform.grad(of, argnums=0, has_aux=True)([leaves[i] for i in floating])
  except Exception:
    if required:
      raise
    loss, rest = value_of(outputs)
    return loss, rest, None
  return loss, rest, grads


def _gaps(whole, combined):
  """``(leaves, 2)``: for each pair of gradients, the largest difference of their entries and the largest entry
  of either, over the entries where both are finite."""
  rows = []
  for a, b in zip(whole, combined):
    a, b = bm.as_jax(a).astype(jnp.float32), bm.as_jax(b).astype(jnp.float32)
    finite = jnp.isfinite(a) & jnp.isfinite(b)
    difference = jnp.max(jnp.where(finite, jnp.abs(a - b), 0.), initial=0.)
    scale = jnp.max(jnp.where(finite, jnp.maximum(jnp.abs(a), jnp.abs(b)), 0.), initial=0.)
    rows.append(jnp.stack([difference, scale]))
  return jnp.stack(rows) if rows else jnp.zeros((0, 2), jnp.float32)


def _metrics_by_shapes(loss_of: Optional[Callable], args: tuple, axes, declared, reduction: str, batch_size: int, small,
                 large, sizes) -> Tuple[MetricPlan, list, list]:
  """The metrics' plan from the outputs' shapes ``small`` and ``large`` at the micro-batch ``sizes``, the paths
  of their leaves and their shapes at the two sizes: the loss alone is traced (brainstate's ``eval_shape``: a
  loss that draws random numbers or writes a Variable leaves them as they were, with or without jit), not the
  model; ``loss_of=None``: a loss without metrics."""
  if loss_of is None:
    return plan_from_shapes({}, {}, sizes, declared, reduction, batch_size), [], []
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)

  def metrics_at(outputs, n):
    micro_args = treedef.unflatten([x if a is None else samples_shape(x, a, n) for x, a in zip(leaves, axes)])
    return brainstate.transform.eval_shape(lambda o, t: loss_of(o, t)[1], outputs, micro_args[1])

  shapes, larger = metrics_at(small, sizes[0]), metrics_at(large, sizes[1])
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
  return (plan_from_shapes(shapes, larger, sizes, declared, reduction, batch_size), paths,
          [(a.shape, b.shape) for a, b in zip(jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(larger))])


class CheckNames:
  """Lists to fill while tracing, hashable by identity, so that ``jit`` can take them as a static argument:
  the declared scalar metrics ``(path, name, reduction)``, the undeclared ones ``(path, name)``, the stitched ones
  ``(path, small shape, large shape, sizes, rule)``, the paths of the floating outputs (``predicts[...]``) and the
  names of the batch statistics the loss marks."""

  def __init__(self):
    self.metrics, self.undecided, self.stitched, self.leaves, self.statistics = [], [], [], [], []


def found_reductions(undecided: Sequence, evidence: Sequence, plan: MicroBatchPlan, reduction: str
                     ) -> Dict[str, str]:
  """How each undeclared scalar metric combines, from the evidence at every point (``(whole values, candidates)``
  of :class:`Evidence`): the one of :data:`AUX_REDUCTIONS` that reproduces the whole batch's value from the
  micro-batches' values everywhere. Where none does, or several do (a metric constant at the random outputs,
  whose combination they cannot tell), it stays the loss's own combination and a warning names
  ``aux_reduction``. Returns the reductions that differ from that default, by the leaf's path."""
  default, found = default_reduction(reduction), {}
  for k, (path, name) in enumerate(undecided):
    whole = [np.asarray(values[k]) for values, _ in evidence]
    candidates = [[np.asarray(c) for c in copies[k]] for _, copies in evidence]
    fits = reductions_that_fit(whole, candidates)
    if len(fits) == 1 or (fits and _reads_the_whole_batch(whole)):  # (then every micro-batch gives its value)
      how = default if default in fits else ('mean' if 'mean' in fits else fits[0])
      if how != default:
        found[path] = how
      continue
    finite = [p for p, w in enumerate(whole) if np.all(np.isfinite(w.astype(np.float64)))] or [0]
    # shown where the combinations fail (the first point where none fits), not where they agree
    first = next((p for p in finite if not reductions_that_fit([whole[p]], [candidates[p]])), finite[0])
    shown = ', '.join(f'{how} {_show(c)}' for how, c in zip(AUX_REDUCTIONS, candidates[first]))
    if fits:
      why = (f'its {", ".join(fits)} over the {plan.describe_cuts()} micro-batches all equal its whole-batch value '
             f'{_show(whole[first])} at the random outputs checked, so these cannot tell how it combines')
    elif any(np.all(np.isfinite(w.astype(np.float64))) for w in whole):
      why = (f'it is {_show(whole[first])} on the whole first batch at random outputs ({POINTS[first]}), but no '
             f'combination of its values on the {plan.describe_cuts()} micro-batches gives that ({shown})')
    else:
      why = 'it is not finite at any random outputs checked, so how it combines cannot be told'
    warnings.warn(f'The metric metrics{path} of loss_fun: {why}. It is combined as a {default} (as the loss is), '
                  f'and its recorded history may differ from bp.BPTT\'s. Declare how it combines with '
                  f'aux_reduction={{{name!r}: ...}} (one of {AUX_REDUCTIONS}), make it a per-sample array '
                  f'(stitched exactly) or a mean over samples, or pass {WHOLE_BATCH_FIX} to compute the metrics '
                  f'on the whole batch.', UserWarning, stacklevel=3)
  return found


def _reads_the_whole_batch(whole: Sequence[np.ndarray]) -> bool:
  """Whether a metric that every micro-batch gives the same value (every reduction fits) changes from one point
  to the next: it reads the whole batch's outputs (a function of batch statistics), so any reduction is exact.
  (One constant at every point, e.g. of the parameters alone, could still differ at the model's outputs.)"""
  finite = [w.astype(np.float64) for w in whole if np.all(np.isfinite(w.astype(np.float64)))]
  return any(w.shape != finite[0].shape or not np.allclose(w, finite[0], rtol=1e-5, atol=1e-6) for w in finite[1:])


def warn_metrics(names: Sequence, whole: Sequence[np.ndarray], combined: Sequence[np.ndarray], plan: MicroBatchPlan,
                 rtol: float = 1e-5, atol: float = 1e-6) -> list:
  """Warn once for every declared scalar metric whose whole-batch value differs from its declared combination
  over the micro-batches.

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
                  f'per-sample array (stitched exactly) or a mean over samples, or pass {WHOLE_BATCH_FIX} to '
                  f'compute the metrics on the whole batch.', UserWarning, stacklevel=2)
  return warned


def _show(value: np.ndarray) -> str:
  text = np.array2string(value, precision=7, threshold=6) if value.ndim else f'{value.item():.7g}'
  return f'{text} ({value.dtype})'


def warn_coupled_loss(whole: float, combined: float, plan: MicroBatchPlan, grad_reduction: str, point: str,
                      rtol: float = 1e-5, atol: float = 1e-6, magnitude: float = 0.,
                      statistics: Sequence[str] = (), on: str = WHOLE) -> bool:
  """Warn if the loss of the whole batch differs from the combination of its micro-batch losses, both at the
  same random outputs (drawn as ``point`` says).

  A loss that is a weighted mean (``'sum'``: a sum) of per-sample terms agrees to float32 round-off at any
  outputs; one that couples the samples does not. Round-off is relative to the larger of the whole batch's loss
  and ``magnitude``, the same combination of the micro-batch losses' absolute values (they may cancel where the
  micro-batches lie at levels of their own). ``statistics``: the names of the batch statistics the loss marks
  (:func:`~brainpy_accum.batch_mean`), which each micro-batch's loss saw whole; ``on``: the samples checked,
  as the warning names them. Returns whether it warned.
  """
  if abs(whole - combined) <= atol + rtol * max(abs(whole), abs(magnitude)):
    return False
  how = 'sum' if grad_reduction == 'sum' else 'weighted mean'
  warn_coupled(f'its value on {on} is {whole:.7g}, but the {how} of its values on the '
                f'{plan.describe_cuts()} micro-batches is {combined:.7g} (difference {whole - combined:.3g})', point,
                statistics)
  return True


# where the check's cut is not the one that trains (num_micro_batch='auto' checks before it plans, in two)
CHECK_CUT = ('the check cuts the batch as its plan does, or in two where num_micro_batch=\'auto\' has not planned it '
             'yet; a finer cut moves such a loss further from the whole batch\'s')


def warn_coupled(what: str, point: str, statistics: Sequence[str] = ()) -> None:
  seen = f'random outputs ({point}) in place of the model\'s, {what} ({CHECK_CUT})'
  if statistics:
    warnings.warn(f'loss_fun couples the samples of a batch beyond its batch statistics '
                  f'({", ".join(statistics)}, which every micro-batch sees whole): with the data of the first batch '
                  f'cut into micro-batches and {seen}. A term that reads a batch statistic per sample (e.g. '
                  f'mean((x - batch_mean(x)) ** 2)), a '
                  f'statistic of a statistic, or another mean over the batch left unmarked is not exact over '
                  f'micro-batches: accumulating their gradients would train another objective. Write it as a function '
                  f'of batch statistics alone (e.g. batch_mean(x ** 2) - batch_mean(x) ** 2), or pass '
                  f'{WHOLE_BATCH_FIX} to train the whole-batch loss exactly.', UserWarning, stacklevel=4)
    return
  warnings.warn(f'loss_fun couples the samples of a batch: with the data of the first batch cut into micro-batches '
                f'and {seen}. Accumulating micro-batch gradients would train that other objective (e.g. a batch-wide '
                f'firing-rate regulariser, or a spike count summed over the batch, changes with the micro-batch\'s '
                f'size). Two ways train the '
                f'whole-batch loss exactly: where the coupling is a mean or a sum over the batch (a firing rate), '
                f'compute it with brainpy_accum.batch_mean(x, axis=...) or batch_sum (each micro-batch then sees the '
                f'whole batch\'s value, at one micro-batch\'s memory); for any loss, pass {WHOLE_BATCH_FIX} (it '
                f'keeps the whole batch\'s outputs); or make the loss a mean over samples.', UserWarning, stacklevel=4)
