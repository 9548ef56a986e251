"""One batch of :class:`AccumBPTT`'s train and evaluation steps, built on the core's
:func:`~brainpy_accum.core.accumulate`.

Every step, local or on a mesh, with or without an ``accumulate_steps`` window, in the default or the
two-pass mode, is the same two functions:

1. :func:`batch_sums`: the weighted sums of this device's share of the batch (the whole batch without a
   mesh), from the core's micro-batch loop;
2. :func:`settle`: the one place that adds the devices' sums (``across``: one ``psum`` on a mesh, nothing
   locally) and either finishes the batch (divides), or adds it to the window and, at an update, closes
   the window.

A mesh only wraps the pair in ``shard_map`` (:func:`~brainpy_accum.core._mesh.on_mesh`). What :func:`settle` returns is applied by
the trainer outside, once per optimizer update: :func:`clip_by_global_norm`, then :func:`guarded_update` (the
non-finite guard).
"""

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

import brainpy.math as bm
import jax
import jax.numpy as jnp

from ..core._accumulate import MicroResult, Sums, accumulate
from ..core._combine import finish_grads, finish_values, same_type
from ..core._cut import MicroBatchPlan
from ..core._metrics import MetricPlan, across_devices, finish_metrics, summed_leaves
from ..core._written import WriteReport, Written, apart_across_devices

__all__ = ['WINDOW_HOLDS', 'Settled', 'all_finite', 'batch_sums', 'clip_by_global_norm', 'guarded_update', 'micro_step',
           'same', 'settle', 'settle_writes']


# what a Variable without a batch axis holds after a step where its writes differed, when batches (accumulate_steps,
# streamed chunks) or devices share an update: the batches before the last put it back (settle_writes)
WINDOW_HOLDS = ("what the last micro-batch of the batch that closes each update wrote (on a mesh, of one device's "
                "share)")


class Settled(NamedTuple):
  """What one batch leaves for the trainer to apply.

  ``grads``: the gradient of the update (accumulator precision), ``None`` when the step only collects or
  evaluates; ``apply``: the non-finite guard of that update (``None``: always apply); ``finite``: whether
  this batch's gradient was finite, for the skip counter (``None``: not checked); ``loss``, ``aux``: the
  batch's loss and metrics.
  """
  grads: Any
  apply: Any
  finite: Any
  loss: Any
  aux: Any


def same(tree):
  """``across`` without a mesh: one device holds every sum already."""
  return tree


def micro_step(loss_and_aux: Callable, shared_args, params: Optional[dict], weigh: Callable) -> Callable:
  """The core's ``micro_fn`` for ``loss_and_aux(shared_args, inputs, targets) -> (loss, aux)``: its gradient
  with respect to the Variables ``params`` (``None``: no gradient) and the weight ``weigh(micro_args, size)``.

  ``shared_args`` enter the gradient as an argument, as in ``bp.BPTT``'s ``f_grad``: brainpy traces them
  there, so a model that reads them (``share.load('fit')``) sees what it sees under ``bp.BPTT``.
  """

  def micro_fn(micro_args, size: int) -> MicroResult:
    weight = weigh(micro_args, size)
    if params is None:
      return MicroResult(None, *loss_and_aux(shared_args, *micro_args), weight)
    grad_fn = bm.grad(loss_and_aux, grad_vars=params, return_value=True, has_aux=True)
    grads, loss, aux = grad_fn(shared_args, *micro_args)
    return MicroResult({k: bm.as_jax(g) for k, g in grads.items()}, loss, aux, weight)

  return micro_fn


def batch_sums(micro_fn: Callable, args: tuple, axes: Sequence[int], plan: MicroBatchPlan, states: Sequence,
               params: Optional[dict], alone: bool, two_passes: Optional[Callable] = None,
               metrics: Optional[MetricPlan] = None, report: Optional[WriteReport] = None,
               statistics: Optional[Callable] = None) -> Sums:
  """The weighted sums of ``plan``'s micro-batches of ``args`` (this device's share), from the core.

  ``alone``: nothing else is added to this batch (no mesh, no window), so a batch in one piece is its own
  mean, weight ``1``: :class:`brainpy.BPTT`'s step, bit for bit (but for a streamed chunk's evaluation, whose
  ``statistics`` are its batch's). ``two_passes(args, axes, plan, states)``,
  given, runs a batch of several micro-batches instead (``whole_batch_loss=True``; also weight ``1``).
  ``metrics``: how the metrics combine (:mod:`~brainpy_accum.core._metrics`); a batch in one piece and the two
  passes give the whole batch's metrics as they are. ``statistics(micro_fn, args, axes, plan, states)``, given
  (a loss that marks batch statistics, :mod:`~brainpy_accum.core._batch_stats`), runs their pass over the
  micro-batches and returns ``micro_fn`` seeing them, and what the loss sum holds too much (``'sum'``: the
  statistics' term once per micro-batch but one; else ``None``).
  """
  if plan.num_micro_batches == 1 and alone and statistics is None:
    out = micro_fn(args, plan.batch_size)
    return Sums(out.grads, 1., out.loss, out.aux, None, 1.)
  if two_passes is not None and (plan.num_micro_batches > 1 or not alone):
    return two_passes(args, axes, plan, states)
  grads_like = None if params is None else {k: v.value for k, v in params.items()}
  extra = None
  if statistics is not None:
    micro_fn, extra = statistics(micro_fn, args, axes, plan, states)
  sums = accumulate(micro_fn, args, axes, plan, states, grads_like, metrics=metrics, report=report)
  return sums if extra is None else sums._replace(loss_sum=sums.loss_sum - extra)


def _added(sums: Sums, across: Callable, metrics: Optional[MetricPlan], *more):
  """``more`` and the batch's loss and metric sums, added over the devices in ONE ``across`` (one all-reduce)."""
  if metrics is None:
    return across((*more, sums.loss_sum, sums.aux_sum, None)), []
  added = across((*more, sums.loss_sum, summed_leaves(sums.aux_sum, metrics.rules), sums.count))
  return added, added[-2]


def _metrics_of(sums: Sums, added, summed, total, mesh_axis: Optional[str], reduction: str,
                metrics: Optional[MetricPlan]):
  """The batch's loss and metrics, from :func:`_added`'s result (``metrics``: each leaf by its rule)."""
  loss_sum, aux_sum, count = added[-3:]
  if metrics is None:
    return finish_values((loss_sum, aux_sum), total, reduction)
  aux = across_devices(sums.aux_sum, metrics.rules, mesh_axis, summed)
  return finish_values(loss_sum, total, reduction), finish_metrics(aux, metrics.rules, total, count,
                                                                   metrics.mean_by_weight)


def settle(sums: Sums, across: Callable, mesh_axis: Optional[str] = None, *, reduction: str, skip_nonfinite: bool,
           window=None, update: bool = True, metrics: Optional[MetricPlan] = None,
           report: Optional[WriteReport] = None) -> Settled:
  """Add the devices' ``sums`` (``across``, over ``mesh_axis``) and finish the batch, or put it in the ``window``.

  Without a window the batch's gradient is its mean (``'sum'``: its sum). With one, each device adds its
  own sums to its row of the window, and the devices add their gradients only when ``update`` closes it:
  one gradient all-reduce per optimizer update; a non-finite batch (on any device) is left out. ``update``
  may also be a traced bool (a streamed chunk's): the window is emptied, and the update applied, only where
  it is True, so that the chunks that close the window and those that do not run one compiled step. States
  without a batch axis that the batch wrote: :func:`settle_writes`.
  """
  settle_writes(sums.written, window, update, mesh_axis, report)
  if window is None:
    added, summed = _added(sums, across, metrics, sums.grad_sum, sums.total_weight)
    grad_sum, total = added[:2]
    grads = finish_grads(grad_sum, total, reduction)
    finite = all_finite(grads) if skip_nonfinite else None
    return Settled(grads, finite, finite, *_metrics_of(sums, added, summed, total, mesh_axis, reduction, metrics))
  bad = (~all_finite(sums.grad_sum)).astype(jnp.int32) if skip_nonfinite else jnp.zeros((), jnp.int32)
  added, summed = _added(sums, across, metrics, sums.total_weight, bad)
  total, bad = added[:2]
  finite = (bad == 0) if skip_nonfinite else None
  window.add_sums(sums.grad_sum, sums.total_weight, keep=finite)
  loss, aux = _metrics_of(sums, added, summed, total, mesh_axis, reduction, metrics)
  if update is False:
    return Settled(None, None, finite, loss, aux)
  closes = None if update is True else update
  grad_sum, weight = across(window.take_sums(where=closes))
  grads = finish_grads(grad_sum, jnp.where(weight > 0, weight, 1.), reduction)
  apply = (weight > 0) if skip_nonfinite else None
  if closes is not None:
    apply = closes if apply is None else apply & closes
  return Settled(grads, apply, finite, loss, aux)


def settle_writes(written: Optional[Written], window, update, mesh_axis: Optional[str],
                  report: Optional[WriteReport]) -> None:
  """States without a batch axis that the batch's forward passes wrote (``written``; the core started every
  micro-batch from their values and kept the first one's writes).

  A step that does not update (``update`` False, or traced and False) puts them back: every batch of an
  ``accumulate_steps`` window and every chunk of a streamed batch starts where the window started, as one
  batch of them all would, and the batch that updates leaves its writes to the optimizer. ``report`` hears of
  writes that differ between the window's batches or between the devices of ``mesh_axis``.
  """
  if written is None or not written.states:
    return
  apart = [jnp.asarray(False)] * len(written.states)
  if mesh_axis is not None:
    apart = [a | b for a, b in zip(apart, apart_across_devices(written, mesh_axis))]
  if window is not None:
    apart = [a | b for a, b in zip(apart, window.writes_apart(written, update))]
  if report is not None and (mesh_axis is not None or window is not None):
    report.report(written._replace(apart=tuple(apart)), WINDOW_HOLDS)
  if update is not True:
    for state, start in zip(written.states, written.starts):
      state.value = jax.tree_util.tree_map(lambda new, old: jnp.where(update, new, same_type(old, new)),
                                           state.value, start)


def all_finite(tree) -> jax.Array:
  """``True`` when no leaf holds a NaN or an infinity."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def clip_by_global_norm(grads: Dict, max_norm: float) -> Dict:
  """Scale all gradients by ``max_norm / norm`` when their global L2 norm exceeds ``max_norm``."""
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values()))
  scale = jnp.where(norm > max_norm, max_norm / norm, 1.)
  return {k: same_type(g * scale, g) for k, g in grads.items()}


def guarded_update(optimizer, params: Dict[str, bm.Variable], grads: Dict, apply: Optional[jax.Array]) -> None:
  """``optimizer.update(grads)``; with ``apply`` given, every Variable it touches is kept as it was where ``apply`` is False.

  Parameters, optimizer moments and the learning-rate step counter all stay
  bit-for-bit unchanged on a skipped update.
  """
  if apply is None:
    optimizer.update(grads)
    return
  touched = dict(optimizer.vars().unique())
  touched.update(params)
  before = {k: v.value for k, v in touched.items()}
  optimizer.update({k: jnp.where(apply, g, jnp.zeros_like(g)) for k, g in grads.items()})
  for k, var in touched.items():
    var.value = same_type(jnp.where(apply, var.value, before[k]), before[k])
