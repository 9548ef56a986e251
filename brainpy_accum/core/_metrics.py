"""How the metrics that a loss returns beside its value (``loss_has_aux``) combine over micro-batches and devices.

Every leaf of the metrics gets a :class:`MetricRule`, found once while the step is traced:

- a leaf that holds its samples' rows on one axis (its shape changes with the micro-batch size there, by the
  same whole number ``k`` of rows per sample at both sizes traced) is **stitched**: every micro-batch writes its
  rows into a whole-batch buffer, so the batch gets exactly the array the whole batch would give, whatever the
  cut. One row per sample: ``(B,)``, ``(B, T)``, ``(T, B, ...)``. ``k`` rows: a flattened ``(k * B, ...)``, in
  one of :data:`ORDERS` (:class:`MetricRule`), which the default mode's first-batch check tells from the values
  (:func:`orders_that_fit`). Any other leaf whose shape changes with the micro-batch is refused by name
  (:func:`unplaceable`) before the first step;
- any other leaf (a scalar, or an array of fixed shape) is **reduced** over the micro-batches: ``'mean'``
  (weighted like the loss: sample counts or ``loss_weight_fn``), ``'sum'`` (integer counts stay integers),
  ``'max'`` or ``'min'``. ``aux_reduction={'name': 'max'}`` declares one; an undeclared leaf takes the one that
  the default mode's first-batch check found (:func:`reductions_that_fit`: the one combination of the
  micro-batches' values that gives the whole batch's, at random outputs), else the loss's own combination
  (``'mean'``, or ``'sum'`` with ``grad_reduction='sum'``);
- ``'whole'``: the leaf is already the whole batch's (one micro-batch, or the two-pass mode), taken as it is.

The combination has two halves so that devices can meet in between: :func:`stacked_partials` turns the
micro-batches' values into partial sums (before any division), :func:`across_devices` adds (or maximises, or
gathers) them over a mesh axis, and :func:`finish_metrics` divides the means.
"""

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._combine import weighted_sum
from ._cut import MicroBatchPlan
from ._batch import second_sizes, traced_shapes

__all__ = ['AUX_REDUCTIONS', 'ORDERS', 'MetricsError', 'MetricRule', 'MetricPlan', 'across_devices',
           'check_aux_reduction', 'combine_on_host', 'default_reduction', 'finish_metrics', 'join_metrics',
           'found_orders', 'metric_rules', 'metric_name', 'orders_that_fit', 'reductions_that_fit', 'split_metrics',
           'stacked_partials', 'stitched_into', 'summed_leaves', 'metric_plan_of', 'plan_from_shapes',
           'undeclared_leaves', 'unplaceable', 'with_candidates', 'WHOLE_METRICS']

AUX_REDUCTIONS = ('mean', 'sum', 'max', 'min')
# How the k rows per sample of a flattened (k * B, ...) axis lie: 'time-major', row t * B + b (k blocks of the B
# samples: x.reshape(-1, ...) of a time-major (T, B, ...) array, BrainPy's layout); 'batch-major', row b * k + t.
ORDERS = ('time-major', 'batch-major')


class MetricsError(ValueError):
  """Metrics that cannot be combined as declared: the user's ``aux_reduction`` or metric shapes need a fix."""


class MetricRule(NamedTuple):
  """How one metric leaf combines: stitched on ``axis`` (an int), or reduced by ``reduction``.

  A stitched leaf holds ``rows`` rows per sample on ``axis``, laid out in ``order`` (one of :data:`ORDERS`; the
  same thing where ``rows`` is 1): ``rows=T`` of a ``(T * B, 3)`` array flattened from ``(T, B, 3)`` is
  ``MetricRule(0, 'stitch', T, 'time-major')``.
  """
  axis: Optional[int] = None
  reduction: str = 'mean'  # 'mean', 'sum', 'max', 'min', or 'whole' (already the batch's)
  rows: int = 1
  order: str = ORDERS[0]


class MetricPlan(NamedTuple):
  """The rules of every metric leaf (flattened order) and the whole-share shapes of the stitched ones.

  ``mean_by_weight``: ``'mean'`` uses the loss's weights (``grad_reduction='mean'``); otherwise sample counts.
  ``rules=None``: the metrics are already the whole batch's (:data:`WHOLE_METRICS`).
  """
  rules: Optional[List[MetricRule]]
  stitched_like: List[Any]
  mean_by_weight: bool = True


WHOLE_METRICS = MetricPlan(None, [])


def check_aux_reduction(aux_reduction) -> Dict[str, str]:
  """``None`` or a dict ``{metric name: one of AUX_REDUCTIONS}``; returned as a (new) dict."""
  if aux_reduction is None:
    return {}
  if not isinstance(aux_reduction, dict):
    raise TypeError(f'{aux_reduction=} must be a dict from metric names to one of {AUX_REDUCTIONS}, e.g. '
                    f"aux_reduction={{'max_rate': 'max', 'n_correct': 'sum'}}; got a {type(aux_reduction).__name__}.")
  for name, how in aux_reduction.items():
    if not isinstance(name, str):
      raise TypeError(f'aux_reduction key {name!r} must be the name (a str) of a metric that loss_fun returns.')
    if not isinstance(how, str) or how not in AUX_REDUCTIONS:
      raise MetricsError(f'aux_reduction[{name!r}]={how!r} is unknown: use one of {AUX_REDUCTIONS} '
                       f"('mean' for per-sample means, 'sum' for counts, 'max'/'min' for extremes).")
  return dict(aux_reduction)


def metric_name(path) -> str:
  """The metric's name as ``aux_reduction`` keys it: the top-level key of its path (``'acc'`` of ``['acc']``)."""
  if not path:
    return ''
  key = path[0]
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def metric_plan_of(metrics_of: Callable, args: tuple, axes, plan: MicroBatchPlan, states, declared: Dict[str, str],
                   grad_reduction: str, found: Optional[Dict[str, str]] = None) -> MetricPlan:
  """The :class:`MetricPlan` of ``metrics_of(micro_args, n)`` (the metrics of a micro-batch of ``n`` samples)
  over ``plan``'s micro-batches, from its shapes at two sizes (traced, not run)."""
  sizes = second_sizes(plan)
  small, large = traced_shapes(metrics_of, args, axes, states, sizes)
  return plan_from_shapes(small, large, sizes, declared, grad_reduction, plan.batch_size, found)


def default_reduction(grad_reduction: str) -> str:
  """How a scalar metric combines when nothing is declared or found: like the loss."""
  return 'sum' if grad_reduction == 'sum' else 'mean'


def plan_from_shapes(small, large, sizes, declared: Dict[str, str], grad_reduction: str,
                     batch_size: int, found: Optional[Dict[str, str]] = None) -> MetricPlan:
  """:func:`metric_rules` with the defaults of ``grad_reduction``: undeclared scalars that nothing was
  ``found`` for combine like the loss."""
  rules = metric_rules(small, large, sizes, declared, default_reduction(grad_reduction), batch_size, found)
  return rules._replace(mean_by_weight=grad_reduction == 'mean')


def metric_rules(small, large, sizes, declared: Dict[str, str], default: str, batch_size: int,
                 found: Optional[Dict[str, str]] = None) -> MetricPlan:
  """The :class:`MetricPlan` of metrics shaped ``small`` and ``large`` at the micro-batch ``sizes`` (two).

  ``declared``: ``aux_reduction`` (by metric name); ``found``: what the first-batch check found for undeclared
  leaves, by the leaf's path (``jax.tree_util.keystr``): a scalar's reduction, or the order (:data:`ORDERS`) of a
  stitched leaf of several rows per sample (else the first); ``default``: the reduction of the other leaves;
  ``batch_size``: the samples a stitched leaf holds in the end (this device's share). Raises ``ValueError`` for
  a metric whose shape changes with the micro-batch other than by a whole number of rows per sample on one axis
  (:func:`unplaceable`), a declared reduction of a per-sample metric, and a declared name that ``loss_fun`` does
  not return.
  """
  found = found or {}
  rules, stitched = [], []
  paths = jax.tree_util.tree_flatten_with_path(small)[0]
  names = {metric_name(path) for path, _ in paths}
  unknown = sorted(set(declared) - names)
  if unknown:
    raise MetricsError(f'aux_reduction names {unknown}, which loss_fun does not return; its metrics are '
                     f'{sorted(names)}. Give the names of the metrics dict that loss_fun returns.')
  for (path, a), b in zip(paths, jax.tree_util.tree_leaves(large)):
    name, key = f'metrics{jax.tree_util.keystr(path)}', jax.tree_util.keystr(path)
    rule = _placed(name, a.shape, b.shape, sizes, found.get(key))
    if rule is None:
      how = declared.get(metric_name(path)) or found.get(key)
      rules.append(MetricRule(None, how if how in AUX_REDUCTIONS else default))
      continue
    if metric_name(path) in declared:
      rows = 'one value' if rule.rows == 1 else f'{rule.rows} rows'
      raise MetricsError(f'aux_reduction declares {declared[metric_name(path)]!r} for {name}, but it holds {rows} '
                         f'per sample (shape {a.shape} for {sizes[0]} samples, batch on axis {rule.axis}); per-sample '
                         f'metrics are stitched into the whole batch\'s array, as bp.BPTT records them. Drop '
                         f'{metric_name(path)!r} from aux_reduction, or reduce it inside loss_fun.')
    rules.append(rule)
    stitched.append(jax.ShapeDtypeStruct(a.shape[:rule.axis] + (rule.rows * batch_size,) + a.shape[rule.axis + 1:],
                                         a.dtype))
  return MetricPlan(rules, stitched)


def _placed(name: str, small: tuple, large: tuple, sizes, order: Optional[str]) -> Optional[MetricRule]:
  """The rule of a leaf shaped ``small`` and ``large`` at the micro-batch ``sizes`` that holds its samples' rows
  on one axis, in ``order`` (where it holds several per sample); ``None`` where its shape does not change."""
  moved = [i for i, (n, m) in enumerate(zip(small, large)) if n != m]
  if len(small) != len(large):
    raise unplaceable(name, small, large, sizes, 'its number of axes changes with the micro-batch')
  if not moved:
    return None
  if len(moved) > 1:
    raise unplaceable(name, small, large, sizes, f'it changes on axes {moved}, so its samples do not lie on one '
                                                 f'axis (a (B, B) matrix pairs the samples of a batch)')
  axis = moved[0]
  rows = small[axis] // sizes[0]
  if rows < 1 or (small[axis], large[axis]) != (rows * sizes[0], rows * sizes[1]):
    raise unplaceable(name, small, large, sizes, f'its axis {axis} holds {small[axis]} rows for {sizes[0]} samples '
                                                 f'and {large[axis]} for {sizes[1]}, not the same whole number of '
                                                 f'rows per sample')
  return MetricRule(axis, 'stitch', rows, order if rows > 1 and order in ORDERS else ORDERS[0])


PER_SAMPLE = ('return this metric per sample (each row from its own sample alone, the batch on one axis: (B, ...), '
              '(T, B, ...), or flattened (T * B, ...)) or as a scalar')


def unplaceable(name: str, small: tuple, large: tuple, sizes, why: str, fix: str = PER_SAMPLE) -> MetricsError:
  """The error that refuses the metric ``name``, shaped ``small`` and ``large`` at the micro-batch ``sizes``,
  because its micro-batches' rows cannot be placed in the whole batch's array (``why``), and says the ``fix``
  besides ``whole_batch_loss=True``."""
  return MetricsError(f'The metric {name} has shape {tuple(small)} for a micro-batch of {sizes[0]} samples and '
                      f'{tuple(large)} for one of {sizes[1]}: {why}. Its micro-batches\' values cannot be put '
                      f'together into the array bp.BPTT records for the whole batch. Pass whole_batch_loss=True to '
                      f'compute the metrics on the whole batch, or {fix}.')


def found_orders(leaves: Sequence, evidence: Sequence, cuts: str) -> Dict[str, str]:
  """Where each stitched metric's rows lie, from the default mode's first-batch check.

  ``leaves``: ``(path, small shape, large shape, sizes, rule)`` of each stitched leaf (as :func:`metric_rules`
  saw it); ``evidence``: at every point, ``(whole values, candidates)``: each leaf's value on the whole batch,
  and its micro-batches' values (``cuts``: the micro-batches, in words) put together by each candidate (its own
  rule where it holds one row per sample, each of :data:`ORDERS` where several). Returns the orders found that
  differ from the first, by path. Raises :class:`MetricsError` for a leaf that no candidate reproduces (a row
  depends on other samples of the batch) and for one of several rows per sample that both orders reproduce (its
  values cannot tell which order later batches follow).
  """
  found = {}
  for k, (path, small, large, sizes, rule) in enumerate(leaves):
    fits = orders_that_fit([values[k] for values, _ in evidence], [candidates[k] for _, candidates in evidence])
    if len(fits) == 1:
      if rule.rows > 1 and fits[0]:
        found[path] = ORDERS[fits[0]]
      continue
    rows = (f'one row per sample on axis {rule.axis}' if rule.rows == 1 else
            f'{rule.rows} rows per sample on axis {rule.axis}, {ORDERS[0]} (row t * B + b) or {ORDERS[1]} (row '
            f'b * {rule.rows} + t)')
    where = f'on the whole first batch, at the random outputs of the first-batch check ({cuts} micro-batches)'
    if not fits:
      raise unplaceable(f'metrics{path}', small, large, sizes, f'{rows}, but {where}, its rows are not its '
                        f'micro-batches\' rows put together{" in either order" if rule.rows > 1 else ""}: they '
                        f'depend on other samples of the batch (a gather or sort across samples, a cumulative sum, '
                        f'a normalisation by a batch-wide value)')
    raise unplaceable(f'metrics{path}', small, large, sizes, f'{rows}, and {where}, both orders give its value '
                      f'(its rows there are alike, e.g. they do not read the outputs), so the order of later '
                      f'batches cannot be told', fix='return it unflattened, the batch on an axis of its own '
                      '((T, B, ...): stitched exactly)')
  return found


def undeclared_leaves(paths: Sequence, rules: Sequence[MetricRule], declared: Dict[str, str]) -> List[int]:
  """The flattened indices of the reduced leaves (scalars, fixed shapes) whose metric ``aux_reduction`` does not
  name: those whose reduction the first-batch check finds. ``paths``: every leaf's path, in order."""
  return [i for i, (path, rule) in enumerate(zip(paths, rules))
          if rule.axis is None and metric_name(path) not in declared]


def with_candidates(plan: MetricPlan, leaves: Sequence[int], extra: Sequence[str] = (),
                    orders: Sequence[int] = ()) -> MetricPlan:
  """``plan`` for metrics followed by every candidate combination of the leaves ``leaves`` and every candidate
  order of the stitched leaves ``orders``: the metrics tree ``(aux, [[leaf] * len(AUX_REDUCTIONS) for each of
  leaves], [[leaf] * len(ORDERS) for each of orders], *extra leaves)`` combines each copy by one of
  :data:`AUX_REDUCTIONS` (stitches it in one of :data:`ORDERS`) in turn, and each ``extra`` leaf by the reduction
  given for it. The engine then combines every candidate exactly as a train step with that rule would (integer
  sums stay integers)."""
  candidates = [MetricRule(None, how) for _ in leaves for how in AUX_REDUCTIONS]
  like = dict(zip([i for i, rule in enumerate(plan.rules) if rule.axis is not None], plan.stitched_like))
  return plan._replace(rules=list(plan.rules) + candidates + [plan.rules[i]._replace(order=order)
                                                              for i in orders for order in ORDERS]
                       + [MetricRule(None, how) for how in extra],
                       stitched_like=list(plan.stitched_like) + [like[i] for i in orders for _ in ORDERS])


def _finite(x: np.ndarray) -> bool:
  return not np.issubdtype(x.dtype, np.inexact) or bool(np.all(np.isfinite(x)))


def reductions_that_fit(whole: Sequence[np.ndarray], candidates: Sequence[Sequence[np.ndarray]],
                        rtol: float = 1e-5, atol: float = 1e-6) -> List[str]:
  """The reductions of :data:`AUX_REDUCTIONS` that reproduce a metric's whole-batch value from its micro-batch
  values at every point of evidence where that value is finite (none if it is finite at none).

  ``whole[p]``: the whole batch's value at point ``p``; ``candidates[p][k]``: the combination of the
  micro-batches' values there by ``AUX_REDUCTIONS[k]``. A candidate fits where it has the whole value's shape
  and dtype (a mean of a count is a float: it does not fit an int32 count) and equals it to float32 round-off.

  >>> import numpy as np
  >>> whole = [np.float32(0.9), np.float32(0.7)]              # a batch maximum at two points
  >>> micro = [[np.float32(.8), np.float32(1.6), np.float32(.9), np.float32(.7)],  # mean, sum, max, min
  ...          [np.float32(.6), np.float32(1.2), np.float32(.7), np.float32(.5)]]
  >>> reductions_that_fit(whole, micro)
  ['max']
  """
  usable = [p for p, w in enumerate(whole) if _finite(np.asarray(w))]
  if not usable:
    return []

  def same(w, c) -> bool:
    w, c = np.asarray(w), np.asarray(c)
    return (w.shape == c.shape and w.dtype == c.dtype
            and np.allclose(w.astype(np.float64), c.astype(np.float64), rtol=rtol, atol=atol))

  return [how for k, how in enumerate(AUX_REDUCTIONS) if all(same(whole[p], candidates[p][k]) for p in usable)]


def orders_that_fit(whole: Sequence[np.ndarray], candidates: Sequence[Sequence[np.ndarray]],
                    rtol: float = 1e-5, atol: float = 1e-6) -> List[int]:
  """The candidates that reproduce a stitched metric's whole-batch value at every point of evidence.

  ``whole[p]``: the whole batch's value at point ``p``; ``candidates[p][k]``: the micro-batches' values put
  together by the ``k``-th candidate (a layout of :data:`ORDERS`). A candidate fits where it has the whole value's
  shape and every entry equals it (NaN where it is NaN), to float32 round-off of the leaf's largest finite entry.

  >>> import numpy as np
  >>> whole = [np.array([0., 1., 2., 3.])]   # (2, B=2) time-major rows of samples 0 and 1: 0 1 | 2 3
  >>> orders_that_fit(whole, [[np.array([0., 1., 2., 3.]), np.array([0., 2., 1., 3.])]])
  [0]
  """
  return [k for k in range(len(candidates[0]))
          if all(_same_rows(w, c[k], rtol, atol) for w, c in zip(whole, candidates))]


def _same_rows(whole, combined, rtol: float, atol: float) -> bool:
  w, c = np.asarray(whole), np.asarray(combined)
  if w.shape != c.shape:
    return False
  if not np.issubdtype(w.dtype, np.inexact) or not np.issubdtype(c.dtype, np.inexact):
    return bool(np.array_equal(w, c))
  w, c = w.astype(np.float64), c.astype(np.float64)
  finite = np.isfinite(w) & np.isfinite(c)
  scale = np.max(np.abs(w[np.isfinite(w)]), initial=0.)
  close = finite & (np.abs(np.where(finite, w - c, 0.)) <= atol + rtol * scale)
  return bool(np.all(close | (w == c) | (np.isnan(w) & np.isnan(c))))


def split_metrics(aux, rules: Sequence[MetricRule]):
  """``(reduced leaves, stitched leaves)`` of ``aux`` in flattened order."""
  leaves = jax.tree_util.tree_leaves(aux)
  return ([x for x, r in zip(leaves, rules) if r.axis is None],
          [x for x, r in zip(leaves, rules) if r.axis is not None])


def join_metrics(treedef, rules: Sequence[MetricRule], reduced, stitched):
  """The metrics tree (structure ``treedef``) from :func:`split_metrics`' two lists."""
  reduced, stitched = iter(reduced), iter(stitched)
  return treedef.unflatten([next(stitched) if r.axis is not None else next(reduced) for r in rules])


def _by_sample(x, rule: MetricRule):
  """``x`` (a stitched leaf's value, NumPy or JAX) with its rows axis split so that each sample's rows lie
  together on one axis, and that axis: ``(k, n)`` time-major (axis + 1), ``(n, k)`` batch-major (axis)."""
  k, axis = rule.rows, rule.axis
  if k == 1:
    return x, axis
  n = x.shape[axis] // k
  time_major = rule.order == ORDERS[0]
  return x.reshape(x.shape[:axis] + ((k, n) if time_major else (n, k)) + x.shape[axis + 1:]), axis + time_major


def _flat(x, rule: MetricRule):
  """:func:`_by_sample`'s ``x`` with its two axes flattened back into one."""
  if rule.rows == 1:
    return x
  a = rule.axis
  return x.reshape(x.shape[:a] + (x.shape[a] * x.shape[a + 1],) + x.shape[a + 2:])


def stitched_into(buffers: Sequence, rules: Sequence[MetricRule], start, values: Sequence) -> list:
  """The whole-batch ``buffers`` of the stitched leaves with a micro-batch's ``values`` (its samples from
  ``start``, traced) written in place, each by its rule (``rules``: every leaf's): a flattened ``(k * B, ...)``
  time-major leaf takes its ``k`` blocks of rows at ``start`` of each of the ``k`` blocks of the batch."""
  out = []
  for buffer, rule, value in zip(buffers, [r for r in rules if r.axis is not None], values):
    whole, axis = _by_sample(buffer, rule)
    rows, _ = _by_sample(jnp.asarray(value).astype(buffer.dtype), rule)
    out.append(_flat(jax.lax.dynamic_update_slice_in_dim(whole, rows, start, axis), rule))
  return out


def _wide(x):
  x = jnp.asarray(x)
  wide = jnp.promote_types(x.dtype, jnp.float32)
  return x if x.dtype == wide else x.astype(wide)


def _summed(v):
  """A sum over micro-batches that keeps integer (and bool: as int32) counts exact and integral."""
  v = jnp.asarray(v)
  if jnp.issubdtype(v.dtype, jnp.integer) or v.dtype == jnp.bool_:
    return v.sum(0, dtype=jnp.int32 if v.dtype == jnp.bool_ else v.dtype)
  return _wide(v).sum(0)


def stacked_partials(stacked: Sequence, rules: Sequence[MetricRule], weights, counts, mean_by_weight: bool) -> list:
  """The partial combination of reduced leaves stacked over micro-batches (leading axis), before division.

  ``weights``: the micro-batches' loss weights; ``counts``: their sample counts (the weights of a ``'mean'``
  when ``mean_by_weight`` is False).
  """
  reduced = [r for r in rules if r.axis is None]
  out = []
  for v, rule in zip(stacked, reduced):
    if rule.reduction == 'mean':
      w = jnp.asarray(weights if mean_by_weight else counts, jnp.float32)
      out.append(weighted_sum(w, v))  # not a matmul: see core/_combine.py
    elif rule.reduction == 'sum':
      out.append(_summed(v))
    elif rule.reduction == 'max':
      out.append(jnp.max(v, axis=0))
    elif rule.reduction == 'min':
      out.append(jnp.min(v, axis=0))
    else:  # 'whole': one micro-batch holds it
      out.append(v[-1])
  return out


def summed_leaves(aux, rules: Sequence[MetricRule]) -> list:
  """The leaves that devices add (means and sums), to join the step's one all-reduce."""
  if rules is None:
    return []
  return [x for x, r in zip(jax.tree_util.tree_leaves(aux), rules) if r.axis is None and r.reduction in ('mean', 'sum')]


def across_devices(aux, rules: Sequence[MetricRule], mesh_axis: Optional[str], summed: Optional[list] = None):
  """Combine every device's partial metrics over ``mesh_axis`` (``None``: one device, unchanged).

  Means and sums are added (``summed``: :func:`summed_leaves` already added, e.g. in the step's one
  all-reduce), extremes maximised or minimised, stitched leaves gathered on their batch axis (the devices hold
  contiguous shares; each block of a time-major leaf gathered on its own), and ``'whole'`` leaves (equal on every
  device) kept.
  """
  if mesh_axis is None or rules is None:
    return aux
  leaves, treedef = jax.tree_util.tree_flatten(aux)
  added = iter(jax.lax.psum(summed_leaves(aux, rules), mesh_axis) if summed is None else summed)
  out = []
  for x, rule in zip(leaves, rules):
    if rule.axis is not None:  # each device's rows of each block after those of the devices before it
      rows, axis = _by_sample(x, rule)
      out.append(_flat(jax.lax.all_gather(rows, mesh_axis, axis=axis, tiled=True), rule))
    elif rule.reduction in ('mean', 'sum'):
      out.append(next(added))
    elif rule.reduction == 'max':
      out.append(jax.lax.pmax(x, mesh_axis))
    elif rule.reduction == 'min':
      out.append(jax.lax.pmin(x, mesh_axis))
    else:
      out.append(x)
  return treedef.unflatten(out)


def finish_metrics(aux, rules: Sequence[MetricRule], total_weight, total_count, mean_by_weight: bool):
  """Divide the ``'mean'`` leaves by the batch's total weight (or sample count); everything else is final."""
  if rules is None:
    return aux
  leaves, treedef = jax.tree_util.tree_flatten(aux)
  total = total_weight if mean_by_weight else total_count
  return treedef.unflatten([x / total if r.axis is None and r.reduction == 'mean' else x
                            for x, r in zip(leaves, rules)])


def combine_on_host(results: Sequence[dict], weights: Sequence[float], counts: Sequence[int],
                    rules: Sequence[MetricRule], mean_by_weight: bool) -> dict:
  """The batch's metrics from those of its chunks (each already combined over its micro-batches), on the host:
  stitched leaves concatenated on their batch axis (block by block where time-major), means weighted by
  ``weights`` (or ``counts``), the rest reduced."""
  if not results:
    return {}
  if rules is None:
    return results[-1]
  per_chunk = [jax.tree_util.tree_leaves(r) for r in results]
  out = []
  for i, rule in enumerate(rules):
    values = [np.asarray(leaves[i]) for leaves in per_chunk]
    dtype = values[0].dtype
    if rule.axis is not None:  # (a time-major leaf's chunks interleave: see stitched_into)
      rows = [_by_sample(v, rule) for v in values]
      out.append(_flat(np.concatenate([r for r, _ in rows], axis=rows[0][1]), rule))
    elif rule.reduction == 'mean':
      w = np.asarray(weights if mean_by_weight else counts, np.float64)
      out.append(np.asarray(sum(wi * v.astype(np.float64) for wi, v in zip(w, values) if wi != 0) / w.sum(), dtype))
    elif rule.reduction == 'sum':
      out.append(np.asarray(sum(v.astype(np.float64) if np.issubdtype(dtype, np.floating) else v for v in values),
                            dtype))
    elif rule.reduction == 'max':
      out.append(np.max(np.stack(values), axis=0))
    elif rule.reduction == 'min':
      out.append(np.min(np.stack(values), axis=0))
    else:
      out.append(values[-1])
  return jax.tree_util.tree_structure(results[0]).unflatten(out)
