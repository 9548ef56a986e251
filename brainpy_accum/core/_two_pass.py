"""Exact gradients of a loss of the whole batch's outputs, one micro-batch's activations at a time.

A loss that couples the samples of a batch (a firing-rate regulariser over the batch, a batch maximum, a
contrastive loss) is not the weighted mean of its micro-batch values, so the default accumulation trains
another objective. Two passes inside one compiled step make it exact, in the manner of the gradient cache
for contrastive losses (Gao et al. 2021, arXiv:2101.06983):

1. :func:`forward_outputs` runs every micro-batch forward, without a backward pass, keeping only its
   outputs (what the loss receives), written into whole-batch buffers;
2. the loss of the whole batch's outputs and its gradient with respect to them, and to the parameters it
   reads itself (a weight regulariser: that part reaches them through no output, and is added once);
3. :func:`pull_back` runs every micro-batch again, forward and backward, from the same initial state (the
   caller restores states and random keys), pulling back its slice of that gradient; the sum over
   micro-batches is the whole batch's gradient.

Memory: the whole batch's outputs plus one micro-batch's activations; compute: one extra forward pass.
Outputs that do not carry the batch (e.g. a monitored parameter) are taken from the last micro-batch, and
their gradient is pulled back through that micro-batch, so a loss term on a monitored parameter trains as
in the whole-batch run.
"""

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp

from ._accumulate import MicroResult, Sums, accumulate
from ._cut import MicroBatchPlan
from ._metrics import MetricPlan
from ._batch import second_sizes, traced_shapes
from ._states import restore_values, values_of
from ._written import WriteReport, is_trainable, restart

__all__ = ['Devices', 'forward_outputs', 'forward_pass', 'loss_and_cotangents', 'output_axes', 'pull_back',
           'second_sizes', 'traced_shapes', 'two_pass_sums', 'whole_batch_like']


def output_axes(small, large) -> List[Optional[int]]:
  """The batch axis of every output leaf, from its shapes at two micro-batch sizes (``None``: no batch axis).

  Raises ``ValueError`` for a leaf whose shape changes with the batch size on more than one axis.
  """
  axes = []
  for path_a, b in zip(jax.tree_util.tree_flatten_with_path(small)[0], jax.tree_util.tree_leaves(large)):
    path, a = path_a
    moved = [i for i, (n, m) in enumerate(zip(a.shape, b.shape)) if n != m]
    if len(moved) > 1 or len(a.shape) != len(b.shape):
      raise ValueError(f'The model output predicts{jax.tree_util.keystr(path)} has shape {a.shape} for one '
                       f'micro-batch and {b.shape} for another: its batch must lie on one axis for '
                       f'whole_batch_loss=True to stitch the micro-batches together.')
    axes.append(moved[0] if moved else None)
  return axes


def whole_batch_like(shapes, axes: Sequence[Optional[int]], batch_size: int):
  """``shapes`` (one micro-batch's outputs) with ``batch_size`` samples on each leaf's batch axis."""
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  whole = [x if a is None else jax.ShapeDtypeStruct(x.shape[:a] + (batch_size,) + x.shape[a + 1:], x.dtype)
           for x, a in zip(leaves, axes)]
  return treedef.unflatten(whole)


def forward_outputs(forward: Callable, args: tuple, axes, plan: MicroBatchPlan, states, outputs_like,
                    out_axes, micro_loss: Optional[Callable] = None, weigh: Optional[Callable] = None,
                    metrics: Optional[MetricPlan] = None, report: Optional[WriteReport] = None,
                    scan_one: bool = False):
  """Pass 1: every micro-batch forward, without gradients; returns the core's ``Sums`` whose ``samples`` are
  the whole batch's outputs. With ``micro_loss(outputs, micro_args) -> (loss, aux)`` and ``weigh`` (the
  default mode's check, which holds the whole outputs already), the sums hold each micro-batch's own loss and
  metrics instead (weighted; ``metrics``: each by its rule), and no outputs. ``report``, ``scan_one``: as for
  :func:`~brainpy_accum.core.accumulate`."""

  def micro_fn(micro_args, size):
    outputs = jax.lax.stop_gradient(forward(micro_args, size))
    if micro_loss is None:
      return MicroResult(None, jnp.zeros((), jnp.float32), {}, jnp.asarray(size, jnp.float32), outputs)
    loss, aux = micro_loss(outputs, micro_args)
    return MicroResult(None, loss, aux, weigh(micro_args, size), None)

  if micro_loss is not None:
    outputs_like = out_axes = None
  return accumulate(micro_fn, args, axes, plan, states, None, outputs_like, out_axes, metrics, report, scan_one)


def loss_and_cotangents(loss_of: Callable, outputs, params: Optional[dict] = None) -> Tuple[Any, Any, Any, Any]:
  """``(loss, aux, d loss / d outputs, d loss / d params)`` of ``loss_of(outputs) -> (loss, aux)`` on the whole
  batch. The last is the gradient of the terms that read the Variables ``params`` themselves (a weight
  regulariser), the outputs held fixed: the rest of the gradient comes through the outputs (pass 2); ``None``
  without ``params``.

  Examples
  --------
  >>> import brainpy.math as bm, jax.numpy as jnp
  >>> w = bm.TrainVar(jnp.full(2, 3.))
  >>> loss_of = lambda outputs: (jnp.sum(outputs * w.value) + jnp.sum(w.value ** 2), {})
  >>> loss, aux, cotangents, direct = loss_and_cotangents(loss_of, jnp.ones(2), {'w': w})
  >>> float(loss), cotangents.tolist(), direct['w'].tolist()  # d/dw of the terms that read w: outputs + 2 w
  (24.0, [3.0, 3.0], [7.0, 7.0])
  """
  if params is None:
    loss, pull, aux = jax.vjp(loss_of, outputs, has_aux=True)
    (cotangents,) = pull(jnp.ones_like(loss))
    return loss, aux, cotangents, None
  direct_of = bm.grad(loss_of, grad_vars=params, argnums=0, has_aux=True, return_value=True, allow_int=True)
  (direct, cotangents), loss, aux = direct_of(outputs)
  return loss, aux, cotangents, {k: bm.as_jax(g) for k, g in direct.items()}


def pull_back(forward: Callable, grad: Callable, args: tuple, axes, plan: MicroBatchPlan, states, cotangents,
              out_axes, grads_like, whole_share: float = 1., report: Optional[WriteReport] = None,
              scan_one: bool = False):
  """Pass 2: every micro-batch forward and backward, pulling back its slice of ``cotangents``.

  ``grad(fn)(micro_args) -> grads`` differentiates the scalar ``fn(micro_args)`` with respect to the
  parameters. Outputs without a batch axis (a monitored parameter, ...) are the last micro-batch's in pass 1,
  so their cotangent is pulled back through the last micro-batch only (times ``whole_share``: ``1 / D`` when
  each of D devices pulls it back). Returns the summed gradient (accumulator precision), the whole batch's, and
  the states the micro-batches wrote (:class:`~brainpy_accum.core._written.Written`). ``scan_one``: as for
  :func:`~brainpy_accum.core.accumulate`.
  """
  cot_leaves, cot_def = jax.tree_util.tree_flatten(cotangents)
  whole = [a is None for a in out_axes]
  last = jnp.zeros((plan.batch_size,), jnp.float32).at[-1].set(1.)  # marks the last micro-batch's samples

  def pulled(micro_args, size):
    *model_args, micro_cot, marks = micro_args
    outputs = jax.tree_util.tree_leaves(forward(tuple(model_args), size))
    scale = whole_share * marks.sum()  # 1 in the last micro-batch, 0 before it
    # a product and a sum, not jnp.vdot: its gradient is the cotangent itself, where a matmul's would be
    # rounded to bfloat16 on a TPU at the default precision (bp.BPTT's cotangents are not)
    return sum(jnp.sum(jnp.conj(o) * (c * scale if w else c).astype(o.dtype)).real
               for o, c, w in zip(outputs, jax.tree_util.tree_leaves(micro_cot), whole)
               if jnp.issubdtype(jnp.asarray(o).dtype, jnp.inexact)) + jnp.zeros((), jnp.float32)

  def micro_fn(micro_args, size):
    grads = grad(lambda *a: pulled(a, size))(*micro_args)
    one = jnp.ones((), jnp.float32)
    return MicroResult(grads, jnp.zeros((), jnp.float32), {}, one)

  sums = accumulate(micro_fn, tuple(args) + (cot_def.unflatten(cot_leaves), last), list(axes) + list(out_axes) + [0],
                    plan, states, grads_like, report=report, scan_one=scan_one)
  return sums.grad_sum, sums.written


def forward_pass(forward: Callable, args: tuple, axes, plan: MicroBatchPlan, states,
                 micro_loss: Optional[Callable] = None, weigh: Optional[Callable] = None,
                 metrics_of: Optional[Callable] = None, report: Optional[WriteReport] = None, scan_one: bool = False):
  """Pass 1 from the ``states``' whole-batch values, the outputs' batch axes traced first.

  Returns :func:`forward_outputs`' sums (``samples``: the whole batch's outputs, without ``micro_loss``) and the
  outputs' batch axes;
  with ``metrics_of(small, large, sizes) -> MetricPlan`` (the outputs' shapes at two micro-batch sizes), also
  the metrics' plan, which the sums follow.
  """
  sizes = second_sizes(plan)
  small, large = traced_shapes(forward, args, axes, states, sizes)
  out_axes = output_axes(small, large)
  outputs_like = whole_batch_like(small, out_axes, plan.batch_size)
  metrics = None if metrics_of is None else metrics_of(small, large, sizes)
  sums = forward_outputs(forward, args, axes, plan, states, outputs_like, out_axes, micro_loss, weigh, metrics,
                         report, scan_one)
  return (sums, out_axes) if metrics_of is None else (sums, out_axes, metrics)


class Devices(NamedTuple):
  """Inside ``shard_map``: the mesh axis the batch is split over, and its number of devices."""
  axis: str
  count: int


def gather_outputs(outputs, out_axes, devices: Devices):
  """Every device's share of the outputs, joined on their batch axes into the whole batch's (one all-gather)."""
  leaves, treedef = jax.tree_util.tree_flatten(outputs)
  return treedef.unflatten([x if a is None else jax.lax.all_gather(x, devices.axis, axis=a, tiled=True)
                            for x, a in zip(leaves, out_axes)])


def own_share(cotangents, out_axes, share: int, devices: Devices):
  """This device's samples of the whole batch's ``cotangents``."""
  start = jax.lax.axis_index(devices.axis) * share
  leaves, treedef = jax.tree_util.tree_flatten(cotangents)
  return treedef.unflatten([c if a is None else jax.lax.dynamic_slice_in_dim(c, start, share, axis=a)
                            for c, a in zip(leaves, out_axes)])


def two_pass_sums(forward: Callable, loss_of: Callable, params: Optional[dict], replayed: Sequence, args: tuple,
                  axes, plan: MicroBatchPlan, states, devices: Optional[Devices] = None,
                  report: Optional[WriteReport] = None, on_read: Optional[Callable[[list], None]] = None) -> Sums:
  """The whole step: pass 1, ``loss_of(outputs) -> (loss, aux)`` once, pass 2: the gradient with respect to
  the Variables ``params`` (``None``: no pass 2).

  ``replayed``: the states (model states, random keys) that pass 2 starts again from where pass 1 started.
  The result is already the whole batch's (weight ``1``): its gradient, loss and metrics. With ``devices``
  (inside ``shard_map``, ``args`` this device's share) the outputs are gathered, every device evaluates the
  loss of the whole batch, pulls back its own share of the loss gradient, and returns weight ``1 / D``, so
  that the one sum over devices that follows gives the whole batch's gradient and loss; the metrics are the
  whole batch's on every device, taken as they are. ``report``: as for :func:`~brainpy_accum.core.accumulate`.
  ``on_read(states)``, given, is called while the step is traced with the states of the model that the loss
  reads itself and pass 1 wrote (the batch's hidden states, states written without a batch axis), if any: the
  loss reads their whole-batch values but reaches them through no output, so no gradient flows back through
  them into the forward pass (the parameters it reads itself are differentiated: :func:`loss_and_cotangents`).
  What the loss writes (a random key it draws from, a Variable it sets) ends the step as the loss left it.
  """
  before = values_of(replayed)
  with brainstate.StateTraceStack() as forward_trace:
    sums, out_axes = forward_pass(forward, args, axes, plan, states, report=report, scan_one=devices is not None)
  outputs = sums.samples if devices is None else gather_outputs(sums.samples, out_axes, devices)
  loss, aux, cotangents, direct, last_word = _loss_of_the_whole_batch(loss_of, outputs, params,
                                                                      _written(forward_trace), on_read)
  weight = 1. if devices is None else 1. / devices.count
  loss = loss * weight if devices is not None else loss  # the metrics stay the whole batch's, equal on every device
  if params is None:
    return Sums(None, weight, loss, aux, None, written=sums.written)
  restore_values(replayed, before)  # pass 2 starts where pass 1 started: same states, same random keys,
  restart(sums.written.states, sums.written.starts)  # the same parameters (a write in the forward pass)
  if devices is not None:
    cotangents = own_share(cotangents, out_axes, plan.batch_size, devices)
  grad = lambda f: lambda *a: {k: bm.as_jax(g) for k, g in bm.grad(f, grad_vars=params)(*a).items()}
  grads, written = pull_back(forward, grad, args, axes, plan, states, cotangents, out_axes,
                             {k: v.value for k, v in params.items()}, 1. if devices is None else 1. / devices.count,
                             report, scan_one=devices is not None)
  # the terms that read the parameters themselves, once (each device's share: 1 / D of them)
  grads = {k: g + (direct[k] * weight).astype(g.dtype) for k, g in grads.items()}
  for state, value in last_word:  # the loss ran after the forward pass: what it wrote stands, as in bp.BPTT
    state.value = value
  return Sums(grads, weight, loss, aux, None, written=written)


def _written(trace) -> set:
  """The ids of the states ``trace`` (a ``brainstate.StateTraceStack``) saw written."""
  return {id(s) for s, wrote in zip(trace.states, trace.been_writen) if wrote}


def _loss_of_the_whole_batch(loss_of: Callable, outputs, params: Optional[dict], forward_wrote: set,
                             on_read: Optional[Callable[[list], None]]):
  """:func:`loss_and_cotangents` of the whole batch's ``outputs``, and ``last_word``: the states the loss wrote
  (a random key it drew from, a Variable it set) with their values then, for the step to end with (pass 2, which
  replays the forward pass from its start, rewinds them). ``on_read`` receives the model's states that the loss
  reads and the forward pass wrote (``forward_wrote``: their ids), parameters aside."""
  with brainstate.StateTraceStack() as trace:
    loss, aux, cotangents, direct = loss_and_cotangents(loss_of, outputs, params)
  read = [s for s in trace.states if id(s) in forward_wrote and not is_trainable(s)]
  if read and on_read is not None:
    on_read(read)
  wrote = _written(trace)
  last_word = [(s, s.value) for s in trace.states if id(s) in wrote]
  return loss, aux, cotangents, direct, last_word
