"""The micro-batch loop as a function transform: ``micro_batched_grad`` is ``brainstate.transform.grad`` in pieces.

:func:`accumulate` is the engine: one ``scan`` over the micro-batches that returns weighted sums before any
division, so its callers (this module's wrapper, a trainer, devices adding their shares) decide when to divide.
"""

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ._batch import is_array, put_samples, take_samples
from ._combine import (add_scaled, check_grad_reduction, check_loss_weight_fn, finish_grads, finish_values,
                       micro_batch_weight, sum_values, wide_zeros_like)
from ._cut import MicroBatchPlan, as_int, check_cut, is_int, plan_micro_batches
from ._metrics import MetricPlan, join_metrics, split_metrics, stacked_partials, stitched_into
from ._mesh import auto_axes, batch_spec, check_divisible, check_mesh, mesh_size, per_device_random, sum_across_devices
from ._states import (declared_batch_axes, is_state, loss_catching_new_states, named_states, prepare_states,
                      refuse_batched_grads, states_put_back)
from ._written import WriteReport, Written, apart_across_devices, kept_last, restart, values_before, written_by

__all__ = ['MicroResult', 'Sums', 'accumulate', 'micro_batched_grad']


class MicroResult(NamedTuple):
  """What the per-micro-batch function returns; ``samples`` have the micro-batch on axis 0."""
  grads: Any
  loss: Any
  aux: Any
  weight: Any
  samples: Any = None


class Sums(NamedTuple):
  """Weighted sums over the micro-batches of one batch, before division; ``samples`` stitched to the batch.

  With a :class:`~brainpy_accum.core._metrics.MetricPlan`, ``aux_sum`` holds each metric's partial combination
  (stitched leaves whole) and ``count`` the samples, for means by sample count. ``written``: the states without
  a batch axis that the micro-batches wrote (:mod:`~brainpy_accum.core._written`), which every micro-batch
  started from their values in ``written.starts``.
  """
  grad_sum: Any
  total_weight: Any
  loss_sum: Any
  aux_sum: Any
  samples: Any
  count: Any = None
  written: Optional[Written] = None


def _axes_like(tree, axis):
  return jax.tree_util.tree_map(lambda _: axis, tree, is_leaf=is_array)


def _one_batch(micro_fn, args, plan: MicroBatchPlan, grads_like, metrics: Optional[MetricPlan], skip: set) -> Sums:
  with brainstate.StateTraceStack() as trace:  # which states without a batch axis it writes, and their starts
    out = micro_fn(args, plan.batch_size)
  wrote = written_by(trace, skip)
  written = Written(tuple(wrote), values_before(trace, wrote), (jnp.asarray(False),) * len(wrote))
  grad_sum = None if grads_like is None else add_scaled(wide_zeros_like(grads_like), out.weight, out.grads)
  if metrics is None:
    values = jax.tree_util.tree_map(lambda v: v[None], (out.loss, out.aux))
    return Sums(grad_sum, out.weight, *sum_values(values, out.weight[None], 'mean'), out.samples, written=written)
  (loss_sum,) = sum_values((out.loss[None],), out.weight[None], 'mean')
  reduced, stitched = split_metrics(out.aux, metrics.rules)
  partial = stacked_partials([v[None] for v in reduced], metrics.rules, out.weight[None],
                             jnp.full((1,), plan.batch_size, jnp.float32), metrics.mean_by_weight)
  aux = join_metrics(jax.tree_util.tree_structure(out.aux), metrics.rules, partial, stitched)
  return Sums(grad_sum, out.weight, loss_sum, aux, out.samples, jnp.asarray(plan.batch_size, jnp.float32), written)


def _cut(leaves, treedef, axes, start, size: int):
  """The micro-batch of ``size`` samples from ``start``; leaves without a batch axis come whole."""
  return treedef.unflatten([x if a is None else take_samples(x, a, start, size) for x, a in zip(leaves, axes)])


def _enter(states, axes, values, start, size: int) -> None:
  """Set every state to its samples ``start, start + 1, ...`` of the whole-batch ``values``."""
  for (state, _), value, axis in zip(states, values, axes):
    state.value = take_samples(value, axis, start, size)


def _put(buffer, axes, start, values):
  """Write a micro-batch's ``values`` into the whole-batch ``buffer`` at ``start`` on each leaf's axis in the list
  ``axes``; a leaf without one (``None``) takes the latest value whole."""
  leaves, treedef = jax.tree_util.tree_flatten(buffer)
  new = [v.astype(x.dtype) if a is None else jax.lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), start, a)
         for x, a, v in zip(leaves, axes, jax.tree_util.tree_leaves(values))]
  return treedef.unflatten(new)


def _zeros(like):
  """Zeros of the shapes and dtypes of ``like``."""
  return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), like)


def _full_only(_, run_full, run_short, *operands):
  """The ``cond`` of an even batch: no short micro-batch, so no branch."""
  return run_full(*operands)


def accumulate(micro_fn: Callable, args: tuple, axes: Sequence[Optional[int]], plan: MicroBatchPlan,
               states: Sequence = (), grads_like: Any = None, samples_like: Any = None,
               sample_axes: Optional[Sequence[Optional[int]]] = None, metrics: Optional[MetricPlan] = None,
               report: Optional[WriteReport] = None, scan_one: bool = False) -> Sums:
  """Run ``micro_fn(micro_args, size) -> MicroResult`` on every micro-batch of ``plan``; return the weighted sums.

  ``axes``: the batch axis of each leaf of ``args`` (``None``: passed whole). ``states``: ``(State, axis)``
  pairs whose values hold the whole batch; each micro-batch starts from its samples and writes them back.
  ``grads_like``: the gradients' structure (``None``: ``micro_fn`` returns none). ``samples_like``:
  shapes that receive every micro-batch's ``samples``, the batch on axis 0 or, given ``sample_axes`` (a list,
  one entry per leaf), on those axes (``None``: the last micro-batch's value whole). One ``scan``; a short last
  micro-batch is a ``cond`` branch of it, so it shares the full micro-batches' working memory.
  ``metrics``: how each metric leaf combines (``None``: all as weighted means, like the loss); per-sample
  metrics are stitched into whole-batch buffers like ``samples``.

  Other states that ``micro_fn`` writes (random keys aside) start every micro-batch from their values at the
  call and end as the last micro-batch wrote them (:mod:`~brainpy_accum.core._written`); the returned
  ``written`` says which, and whether their writes differed between micro-batches, which ``report`` (a
  :class:`~brainpy_accum.core._written.WriteReport`), given, warns of.

  ``scan_one``: a plan of one micro-batch runs as a scan of one too, its arguments and states cut to the plan's
  size like any micro-batch's (else they are taken whole): inside ``shard_map``, whose first trace (the states'
  discovery) sees every device's samples while the plan is one device's share.
  """
  skip = {id(s) for s, _ in states}
  if plan.num_micro_batches == 1 and not scan_one:
    return _one_batch(micro_fn, args, plan, grads_like, metrics, skip)
  whole = [s.value for s, _ in states]
  sums = _scanned(micro_fn, args, axes, plan, states, whole, grads_like, samples_like, sample_axes, metrics)
  if report is not None:
    report.report(sums.written, f'what the last micro-batch (the last {plan.sizes[-1]} of {plan.batch_size} '
                                f'samples) wrote')
  return sums


def _scanned(micro_fn, args, axes, plan: MicroBatchPlan, states, whole: list, grads_like, samples_like, sample_axes,
             metrics: Optional[MetricPlan]) -> Sums:
  """:func:`accumulate`'s scan, the ``states`` set from their ``whole`` values. The states without a batch axis
  that a micro-batch writes are found as the body is traced (``wrote``); each micro-batch starts from their
  values now, and the last keeps its writes (:func:`~brainpy_accum.core._written.kept_last`)."""
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)
  state_axes = [_axes_like(value, a) for value, (_, a) in zip(whole, states)]
  sample_axes = [0] * len(jax.tree_util.tree_leaves(samples_like)) if sample_axes is None else sample_axes
  size, num_full = plan.micro_batch_size, plan.num_full
  aux_def, wrote = [], []  # the metrics' structure and the states written without a batch axis, seen while tracing

  def run(start, n, buffers):
    _enter(states, state_axes, buffers[0], start, n)
    out = micro_fn(_cut(leaves, treedef, axes, start, n), n)
    values = put_samples(buffers[0], state_axes, start, [s.value for s, _ in states])
    aux, stitched = out.aux, buffers[2]
    aux_def[:] = [jax.tree_util.tree_structure(out.aux)]
    if metrics is not None:  # per-sample metrics into their buffers; the rest leave the scan stacked
      aux, pieces = split_metrics(out.aux, metrics.rules)
      stitched = stitched_into(stitched, metrics.rules, start, pieces)
    return out._replace(aux=aux, samples=None), (values, _put(buffers[1], sample_axes, start, out.samples), stitched)

  def run_full(index, buffers):
    return run(index * size, size, buffers)

  def run_short(index, buffers):
    out, buffers = run(num_full * size, plan.remainder, buffers)
    _enter(states, state_axes, buffers[0], 0, size)  # both branches leave the states at the micro-batch size
    return out, buffers

  def body(carry, index):
    grad_sum, buffers = carry
    with brainstate.StateTraceStack() as trace:
      branch = brainstate.transform.cond if plan.remainder else _full_only
      out, buffers = branch(index < num_full, run_full, run_short, index, buffers)
    wrote[:], prints = kept_last(trace, {id(s) for s, _ in states}, index == plan.num_micro_batches - 1)
    grad_sum = None if grad_sum is None else add_scaled(grad_sum, out.weight, out.grads)
    return (grad_sum, buffers), (out.loss, out.aux, out.weight, prints)

  buffers = (whole, _zeros(samples_like), _zeros([] if metrics is None else metrics.stitched_like))
  _enter(states, state_axes, whole, 0, size)  # the scan carries the states at the micro-batch size
  init = (None if grads_like is None else wide_zeros_like(grads_like), buffers)
  with brainstate.StateTraceStack() as trace:  # (the written states' values before the scan)
    (grad_sum, (values, samples, stitched)), (*stacked, prints) = brainstate.transform.scan(
      body, init, jnp.arange(plan.num_micro_batches))
  restart([s for s, _ in states], values)
  written = Written(tuple(wrote), values_before(trace, wrote), tuple(jnp.any(p != p[0]) for p in prints))
  return _summed(plan, grad_sum, samples, stitched, stacked, metrics, aux_def[0])._replace(written=written)


def _summed(plan: MicroBatchPlan, grad_sum, samples, stitched, stacked, metrics: Optional[MetricPlan], aux_def) -> Sums:
  """The :class:`Sums` of :func:`accumulate`'s scan: its gradient sum, its buffers (``samples``, the ``stitched``
  per-sample metrics) and its ``stacked`` per-micro-batch ``(losses, metrics, weights)``."""
  losses, auxs, weights = stacked
  if metrics is None:
    return Sums(grad_sum, weights.sum(), *sum_values((losses, auxs), weights, 'mean'), samples)
  (loss_sum,) = sum_values((losses,), weights, 'mean')
  partial = stacked_partials(auxs, metrics.rules, weights, jnp.asarray(plan.sizes, jnp.float32), metrics.mean_by_weight)
  aux = join_metrics(aux_def, metrics.rules, partial, stitched)
  return Sums(grad_sum, weights.sum(), loss_sum, aux, samples, jnp.asarray(plan.batch_size, jnp.float32))


def _check_options(loss_fn, grad_states, num_micro_batch, micro_batch_size, grad_reduction, flags,
                   loss_weight_fn) -> None:
  if not callable(loss_fn):
    raise TypeError(f'{loss_fn=} must be callable as loss_fn(*args) -> loss.')
  leaves = jax.tree_util.tree_leaves(grad_states, is_leaf=is_state)
  if not leaves or not all(map(is_state, leaves)):
    raise TypeError(f'grad_states={grad_states!r:.60} must be a State or a dict/list of States, e.g. '
                    f'model.states(brainstate.ParamState) or model.train_vars().unique().')
  check_cut(num_micro_batch, micro_batch_size)
  check_grad_reduction(grad_reduction)
  for name, flag in flags.items():
    if not isinstance(flag, bool):
      raise TypeError(f'{name}={flag!r} must be True or False.')
  check_loss_weight_fn(loss_weight_fn, grad_reduction, 'loss_weight_fn(*args)')


def _leaf_axes(args: tuple, batch_axis):
  """The batch axis of every leaf of ``args`` (``None``: not cut) and the batch size they share."""
  prefixes = batch_axis if isinstance(batch_axis, (tuple, list)) else (batch_axis,) * len(args)
  if len(prefixes) != len(args):
    raise ValueError(f'{batch_axis=} has {len(prefixes)} entries for {len(args)} arguments: give one int, or one '
                     f'entry per argument (an int, None for an argument that is not cut, or a pytree of them).')
  axes, sizes = [], {}
  for i, (arg, prefix) in enumerate(zip(args, prefixes)):
    prefix_def = jax.tree_util.tree_structure(prefix, is_leaf=lambda x: x is None)
    try:
      parts = prefix_def.flatten_up_to(arg)
    except (ValueError, TypeError) as error:
      raise ValueError(f'batch_axis entry {prefix!r} does not match the structure of args[{i}]: {error}') from None
    leaf_axes = [a for a, part in zip(prefix_def.flatten_up_to(prefix), parts)
                 for _ in jax.tree_util.tree_leaves(part, is_leaf=is_array)]
    for (path, leaf), axis in zip(jax.tree_util.tree_flatten_with_path(arg, is_leaf=is_array)[0], leaf_axes):
      name, ndim = f'args[{i}]{jax.tree_util.keystr(path)}', np.ndim(leaf)
      if axis is not None and (not is_int(axis) or not -ndim <= axis < ndim):
        raise ValueError(f'{name} has shape {np.shape(leaf)}, which has no batch_axis {axis!r}. Set batch_axis to '
                         f'an axis it has, or to None for an argument that is not cut into micro-batches.')
      axes.append(None if axis is None else int(axis) % ndim)
      if axis is not None:
        sizes[name] = np.shape(leaf)[axis]
  if len(set(sizes.values())) != 1:
    raise ValueError(f'The batched arguments must hold the same samples along their batch_axis; got sizes '
                     f'{sizes or "of no arrays"}.')
  return axes, next(iter(sizes.values()))


def _micro_fn(loss_and_new, grad_states, weigh, keep):
  """The per-micro-batch function: brainstate's gradient, the weight, and the new states in ``keep``."""

  def micro_fn(micro_args, size):
    weight = weigh(micro_args, size)
    grads, loss, (aux, new) = brainstate.transform.grad(
      loss_and_new, grad_states, has_aux=True, return_value=True)(*micro_args)
    return MicroResult(grads, loss, aux, weight, new if keep is None else [new[i] for i in keep])

  return micro_fn


def _aux_checked(micro_fn, aux_like, batch: int):
  """``micro_fn``, refusing by name (as it is traced) an ``aux`` leaf whose shape in a micro-batch is not its shape
  in the whole batch of ``batch`` samples (``aux_like``): a per-sample leaf, which a weighted mean over
  micro-batches would turn into another array (the average of the micro-batches' rows)."""

  def checked(micro_args, size):
    out = micro_fn(micro_args, size)
    whole = jax.tree_util.tree_flatten_with_path(aux_like)[0]
    for (path, like), leaf in zip(whole, jax.tree_util.tree_leaves(out.aux)):
      if np.shape(leaf) != tuple(like.shape):
        raise ValueError(f'micro_batched_grad combines aux as weighted means over the micro-batches, so each aux '
                         f'leaf must keep its shape whatever the batch size (a mean over the samples, a per-feature '
                         f'mean; a count or a maximum is averaged too); aux'
                         f'{jax.tree_util.keystr(path)} has shape {np.shape(leaf)} in a micro-batch of {size} samples '
                         f'and {tuple(like.shape)} in the batch of {batch}. Reduce it over the samples inside loss_fn '
                         f'(its mean, say), or train with AccumBPTT(loss_has_aux=True), which puts per-sample '
                         f'metrics together.')
    return out

  return checked


def _recording(loss_and_new, touched: list):
  """``loss_and_new`` that also lists in ``touched`` the States it reads or writes while it is traced."""

  def recorded(*args):
    with brainstate.StateTraceStack() as trace:  # the enclosing traces still see every access: stacks nest
      out = loss_and_new(*args)
    touched.extend(trace.states)
    return out

  return recorded


def _check_mesh_option(mesh, mesh_axis) -> Optional[str]:
  if mesh is not None and not isinstance(mesh, Mesh):
    raise TypeError(f'mesh={mesh!r:.60} must be a jax.sharding.Mesh (or None), e.g. '
                    f"mesh=jax.sharding.Mesh(jax.devices(), ('batch',)); got a {type(mesh).__name__}.")
  if mesh_axis is not None and not isinstance(mesh_axis, str):
    raise TypeError(f'{mesh_axis=} must be the name (a str) of an axis of the mesh.')
  return check_mesh(mesh, mesh_axis)


def _on_mesh(mesh: Mesh, mesh_axis: str, micro_fn, args, axes, plan: MicroBatchPlan, batched, tree, samples_like,
             randoms, report: WriteReport) -> Sums:
  """:func:`accumulate` on each device's share of the batch (``plan``: one share's micro-batches; ``micro_fn`` as
  ``make(args, axes, plan, states) -> (micro_fn, extra)``, built inside the share: :func:`_accumulated`), then the
  devices' sums added by one all-reduce. Batched states are split like the arguments; others are replicated
  (states written without a batch axis: ``report`` hears where the devices wrote different values)."""
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)
  # Arrays enter the shards (split or replicated); Python numbers passed whole reach the loss as they are.
  static = [a is None and not hasattr(x, 'shape') for x, a in zip(leaves, axes)]
  specs = {state: batch_spec(axis, mesh_axis) for state, axis in batched}
  share_like = [jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((plan.batch_size,) + tuple(x.shape[1:]),
                                                                      x.dtype), like) for like in samples_like]

  def local(*mapped):
    mapped = iter(mapped)
    local_args = treedef.unflatten([x if s else next(mapped) for x, s in zip(leaves, static)])
    params = jax.tree_util.tree_map(lambda s: s.value, tree, is_leaf=is_state)
    with per_device_random(randoms, mesh_axis):
      sums = _accumulated(micro_fn, local_args, axes, plan, batched, params, share_like, report)
    if sums.written.states:
      report.report(sums.written._replace(apart=apart_across_devices(sums.written, mesh_axis)),
                    "what one device's last micro-batch wrote")
    return sum_across_devices(tuple(sums[:4]), mesh_axis), sums.samples  # the one all-reduce of the call

  run = brainstate.transform.shard_map(
    local, mesh, in_specs=tuple(PartitionSpec() if a is None else batch_spec(a, mesh_axis)
                                for a, s in zip(axes, static) if not s),
    out_specs=(PartitionSpec(), [batch_spec(0, mesh_axis)] * len(share_like)),
    state_in_specs=specs, state_out_specs=specs, check_vma=False)
  (grad_sum, total, loss_sum, aux_sum), samples = run(*[bm.as_jax(x) for x, s in zip(leaves, static) if not s])
  return Sums(grad_sum, total, loss_sum, aux_sum, samples)


def micro_batched_grad(loss_fn: Callable, grad_states: Any, *, num_micro_batch: Optional[int] = None,
                       micro_batch_size: Optional[int] = None, grad_reduction: str = 'mean', has_aux: bool = False,
                       return_value: bool = False, batch_axis: Any = 0, loss_weight_fn: Optional[Callable] = None,
                       states: Any = None, mesh: Optional[Mesh] = None, mesh_axis: Optional[str] = None) -> Callable:
  """``brainstate.transform.grad(loss_fn, grad_states)`` of a whole batch, computed over micro-batches.

  Pseudo-code (one compiled ``scan``; float32 sums)::

    for micro_args in micro_batches(args):            # 10 samples, N=4: 3 + 3 + 3 + 1
      w = len(micro_args)                              # or loss_weight_fn(*micro_args); 1 for 'sum'
      g, loss, aux = grad(loss_fn, grad_states)(*micro_args)
      grad_sum += w * g;  loss_sum += w * loss;  aux_sum += w * aux;  total += w
    return grad_sum / total, loss_sum / total, aux_sum / total   # 'sum': no division

  With ``mesh`` each of the D devices of ``mesh_axis`` runs this loop on its contiguous share of B / D samples
  (the micro-batch options describe one share) and the devices add their ``grad_sum, total, loss_sum, aux_sum``
  in one all-reduce before the division: one all-reduce per call, outside every loop.

  Parameters
  ----------
  loss_fn : callable
    ``loss_fn(*args) -> loss`` (``(loss, aux)`` with ``has_aux``) of whatever batch it is given: a mean
    over its samples for ``'mean'``, a sum for ``'sum'``.
  grad_states : State or dict/list/pytree of States
    As for ``brainstate.transform.grad``; brainpy Variables are States too.
  num_micro_batch, micro_batch_size : int
    Exactly one: at most N micro-batches of ``ceil(B / N)`` samples, or micro-batches of this many.
  grad_reduction : {'mean', 'sum'}
    ``'mean'`` weights micro-batches by sample count (or ``loss_weight_fn``); ``'sum'`` adds them.
  has_aux, return_value : bool
    As in ``brainstate.transform.grad``: ``grad_fn`` returns ``grads``, ``(grads, loss)``, ``(grads, aux)``
    or ``(grads, loss, aux)``; aux (scalars or per-batch means) is combined like the loss. Gradients have
    the parameters' dtypes, loss and aux float32 (or wider). One micro-batch is brainstate's result, bit for bit.
  batch_axis : int, None or tuple
    The batch axis of every argument leaf, or one entry per argument: an int, ``None`` (not cut), or a
    pytree prefix of the argument.
  loss_weight_fn : callable, optional
    ``loss_weight_fn(*micro_args) -> weight`` (one number) for ``'mean'``, e.g. the valid steps of a masked
    loss: the result is the gradient of ``sum(w_i * loss_i) / sum(w_i)``, where a micro-batch of weight 0 adds
    exactly nothing (padding alone, whose masked mean is ``0 / 0``).
  states : dict or list of States or of (State, axis) pairs, optional
    The states cut with the batch (a bare State: its ``batch_axis``, else 0). By default, found by tracing
    ``loss_fn`` once: brainpy Variables with a ``batch_axis``, and brainstate ShortTermStates (HiddenStates
    among them) that hold the batch on axis 0 after the loss. Random keys carry over; other states the loss
    writes restart every micro-batch (see Returns).
  mesh : jax.sharding.Mesh, optional
    Data parallelism over the devices of ``mesh_axis`` (D of them): every argument leaf with a batch axis, and
    every batched state, is split along its batch axis into D equal shares (the batch size must be a multiple
    of D; a ``ValueError`` says so before anything changes); ``grad_states`` and the other states are
    replicated. Each device runs the micro-batches of its share (``num_micro_batch=N``: N per device), then
    one all-reduce adds the devices' sums; the result equals the whole batch's, replicated. Random keys the
    loss draws from are folded with the device index, so devices draw different numbers, and end as one key
    shared by all. Other states the loss writes restart every micro-batch of every device (see Returns); where
    the devices wrote different values, a warning names the state. States the loss creates with the
    micro-batch on axis 0 are stitched from the devices' shares, as without a mesh. ``None`` (default): one
    device, no all-reduce.
  mesh_axis : str, optional
    The mesh axis that splits the batch; needed only when ``mesh`` has several axes (the others see the
    batch replicated).

  Returns
  -------
  callable
    ``grad_fn(*args)``. Batched states end as one whole-batch call leaves them (each micro-batch starts
    from its own samples), as do states the loss creates with the micro-batch on axis 0
    (``init_all_states(model, size)``); random keys advance per micro-batch. Every other state the loss writes
    (a parameter clipped or masked in the forward pass, a counter, a record) starts every micro-batch from its
    value at the call and ends as the last micro-batch wrote it: for a write that does not depend on the
    data, what the whole-batch call writes. Where the micro-batches wrote different values (a write that
    depends on the data), a warning names the state (``grad_states[...]`` where it is one of them). A loss
    that writes states needs ``brainstate.transform.jit`` or ``bm.jit`` (raw ``jax.jit`` refuses State
    writes, as for ``brainstate.transform.grad``).

  Raises
  ------
  TypeError
    When the transform is made, for an option of the wrong type (``mesh`` not a ``jax.sharding.Mesh``, ...).
  ValueError
    When the transform is made, for inconsistent options (``mesh_axis`` not an axis of ``mesh``, ...); when
    it is called, for arguments that do not fit them (a batch that ``mesh`` cannot split evenly, ...).

  Examples
  --------
  >>> import brainstate, jax.numpy as jnp
  >>> from brainpy_accum import micro_batched_grad
  >>> w = brainstate.ParamState(jnp.ones(3))
  >>> def loss_fn(x, y):
  ...   return jnp.mean((x @ w.value - y) ** 2)
  >>> x, y = jnp.arange(30.).reshape(10, 3) / 10, jnp.ones(10)
  >>> grads, loss = micro_batched_grad(loss_fn, {'w': w}, num_micro_batch=4, return_value=True)(x, y)
  >>> whole = brainstate.transform.grad(loss_fn, {'w': w})(x, y)
  >>> bool(jnp.allclose(grads['w'], whole['w'], rtol=1e-5)), bool(jnp.allclose(loss, loss_fn(x, y)))
  (True, True)

  The same over the devices of a mesh (one here; with D devices the batch must be a multiple of D):

  >>> import jax, numpy as np
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('batch',))
  >>> sharded = micro_batched_grad(loss_fn, {'w': w}, num_micro_batch=2, mesh=mesh)(x, y)
  >>> bool(jnp.allclose(sharded['w'], whole['w'], rtol=1e-5))
  True
  """
  num_micro_batch, micro_batch_size = as_int(num_micro_batch), as_int(micro_batch_size)
  _check_options(loss_fn, grad_states, num_micro_batch, micro_batch_size, grad_reduction,
                 {'has_aux': has_aux, 'return_value': return_value}, loss_weight_fn)
  mesh_axis = _check_mesh_option(mesh, mesh_axis)
  mesh = None if mesh is None else auto_axes(mesh)
  named = named_states(states)
  grad_ids = {id(s) for s in jax.tree_util.tree_leaves(grad_states, is_leaf=is_state)}
  tree = dict(grad_states) if isinstance(grad_states, dict) else grad_states  # as brainstate shapes the grads
  weigh = functools.partial(micro_batch_weight, grad_reduction, loss_weight_fn)
  report = WriteReport({id(s): f'grad_states{jax.tree_util.keystr(path)}' for path, s in
                        jax.tree_util.tree_flatten_with_path(grad_states, is_leaf=is_state)[0]})

  def grad_fn(*args):
    axes, batch = _leaf_axes(args, batch_axis)
    share = batch if mesh is None else check_divisible(batch, mesh_size(mesh, mesh_axis), mesh_axis)
    plan = plan_micro_batches(share, num_micro_batch=num_micro_batch, micro_batch_size=micro_batch_size)
    log = []
    loss_and_new = loss_catching_new_states(loss_fn, has_aux, log)
    params = jax.tree_util.tree_map(lambda s: s.value, tree, is_leaf=is_state)
    if mesh is None and plan.num_micro_batches == 1:  # brainstate's own result, bit for bit
      grads, loss, aux, _, samples = _micro_fn(loss_and_new, grad_states, weigh, None)(args, batch)
      created = log[-1]
    else:
      sums, keep = _sums(loss_and_new, grad_states, named, grad_ids, weigh, grad_reduction, args, axes, plan, batch,
                         params, tree, mesh, mesh_axis, report)
      grads = finish_grads(sums.grad_sum, sums.total_weight, grad_reduction, params)
      loss, aux = finish_values((sums.loss_sum, sums.aux_sum), sums.total_weight, grad_reduction)
      samples, created = sums.samples, [log[-1][i] for i in keep]
    for state, value in zip(created, samples):
      state.value = value  # the States the loss created last, which the model now holds
    if return_value:
      return (grads, loss, aux) if has_aux else (grads, loss)
    return (grads, aux) if has_aux else grads

  return grad_fn


def _sums(loss_and_new, grad_states, named, grad_ids: set, weigh, reduction: str, args, axes, plan: MicroBatchPlan,
          batch: int, params, tree, mesh: Optional[Mesh], mesh_axis: Optional[str], report: WriteReport
          ) -> Tuple[Sums, list]:
  """:func:`micro_batched_grad`'s sums of a batch of several micro-batches (on ``mesh``: of every device's share,
  added), and which of the States the loss creates hold the batch (``keep``)."""
  refuse_batched_grads(jax.tree_util.tree_leaves(grad_states, is_leaf=is_state), named, batch, report.name_of)
  touched = []
  batched, keep, samples_like, aux_like, before = prepare_states(named, _recording(loss_and_new, touched), args,
                                                                 batch, grad_ids, weigh)
  cut = {id(s) for s, _ in batched}
  others = list({id(s): s for s in touched if id(s) not in cut}.values())
  before += [(s, s.value) for s in others]
  randoms = [s for s in others if isinstance(s, brainstate.random.RandomState)]
  micro_fn = _aux_checked(_micro_fn(loss_and_new, grad_states, weigh, keep), aux_like, batch)
  with states_put_back(before, batched, batch, report.name_of), declared_batch_axes(batched):
    micro_fn = _seeing_statistics(micro_fn, loss_and_new, weigh, reduction, args, axes, plan, batched, randoms,
                                  mesh_axis, 1 if mesh is None else mesh_size(mesh, mesh_axis))
    if mesh is None:
      return _accumulated(micro_fn, args, axes, plan, batched, params, samples_like, report), keep
    return _on_mesh(mesh, mesh_axis, micro_fn, args, axes, plan, batched, tree, samples_like, randoms, report), keep


def _accumulated(make, args, axes, plan: MicroBatchPlan, states, params, samples_like, report):
  """:func:`accumulate` of ``make(args, axes, plan, states) -> (micro_fn, extra)``'s ``micro_fn``, less ``extra``
  (what the loss sum holds too much, :func:`~brainpy_accum.core._batch_stats.seeing_statistics`; ``None``: none)."""
  micro_fn, extra = make(args, axes, plan, states)
  sums = accumulate(micro_fn, args, axes, plan, states, params, samples_like, report=report)
  return sums if extra is None else sums._replace(loss_sum=sums.loss_sum - extra)


def _seeing_statistics(micro_fn, loss_and_new, weigh, reduction: str, args, axes, plan: MicroBatchPlan, batched,
                       randoms, mesh_axis: Optional[str], devices: int) -> Callable:
  """``micro_fn`` as ``make(args, axes, plan, states) -> (micro_fn, extra)``: where the loss marks batch
  statistics, :func:`~brainpy_accum.core._batch_stats.seeing_statistics` (their pass over the micro-batches
  first; on a mesh, inside each of the ``devices``' shares, added over them)."""
  from ._batch_stats import seeing_statistics, statistic_calls, statistic_term_of_args  # (built on this module)
  loss_of = lambda micro_args, n: loss_and_new(*micro_args)  # noqa: E731
  if not statistic_calls(loss_of, args, axes, batched, plan):
    return lambda *_: (micro_fn, None)
  across = None if mesh_axis is None else functools.partial(jax.lax.psum, axis_name=mesh_axis)
  replayed = [s for s, _ in batched] + list(randoms)

  def make(args, axes, plan, states):
    term_of = lambda found: statistic_term_of_args(lambda *a: loss_and_new(*a)[0], args, axes, states, found,  # noqa
                                                   replayed)
    return seeing_statistics(micro_fn, loss_of, weigh, reduction, args, axes, plan, states, replayed, across,
                             devices, term_of)

  return make
