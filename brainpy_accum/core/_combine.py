"""Combining the gradients, losses and metrics of micro-batches into the whole-batch ones.

With ``grad_reduction='mean'`` each micro-batch enters with its weight
``w_i`` (its sample count, or what ``loss_weight_fn`` says) and the result is ``sum_i w_i * g_i / sum_i w_i``:
the whole-batch gradient of a loss that is a mean over samples. With
``'sum'`` the weights are 1 and nothing is divided: the whole-batch gradient
of a loss that is a sum over samples. Losses and auxiliary metrics are
combined the same way, so what is reported matches what is differentiated.
Gradients are summed in at least float32, whatever the parameters' dtype, and every weighted sum is a product
and a sum, never a matmul: at their default precision accelerators round a float32 matmul's operands to
bfloat16 (a TPU) or TensorFloat-32 (a GPU), which would put an error of 2e-3 into the combined losses.

A micro-batch of weight 0 adds exactly nothing, whatever its values: a batch padded with samples that
``loss_weight_fn`` weighs 0 can leave a micro-batch of padding alone, whose masked mean is ``0 / 0``. The whole
batch's loss (what ``bp.BPTT`` trains) holds no such term, so ``0 * nan`` must not enter the sums.
"""

import brainpy.math as bm
import jax
import jax.numpy as jnp

__all__ = ['GRAD_REDUCTIONS', 'add_scaled', 'check_grad_reduction', 'check_loss_weight_fn', 'combine_values',
           'finish_grads', 'finish_values', 'micro_batch_weight', 'same_type', 'scaled', 'sum_values', 'weakly_typed',
           'weighted_sum', 'wide_zeros_like']

GRAD_REDUCTIONS = ('mean', 'sum')


def check_grad_reduction(grad_reduction) -> None:
  """``'mean'`` or ``'sum'``, else an error that says which to choose."""
  if not isinstance(grad_reduction, str):
    raise TypeError(f'{grad_reduction=} must be one of {GRAD_REDUCTIONS}.')
  if grad_reduction not in GRAD_REDUCTIONS:
    raise ValueError(f"{grad_reduction=} is unknown: use 'mean' (losses that average over samples, "
                     f"reproduces whole-batch training) or 'sum' (losses that sum over samples).")


def check_loss_weight_fn(loss_weight_fn, grad_reduction, call: str) -> None:
  """``None``, or a callable (``call`` shows how it is called) that weights a ``'mean'``."""
  if loss_weight_fn is None:
    return
  if not callable(loss_weight_fn):
    raise TypeError(f'{loss_weight_fn=} must be callable as {call} -> weight.')
  if grad_reduction != 'mean':
    raise ValueError(f"loss_weight_fn weights a mean; it does nothing with {grad_reduction=}. "
                     f"Use grad_reduction='mean' or drop loss_weight_fn.")

def micro_batch_weight(grad_reduction: str, loss_weight_fn, micro_args, size: int):
  """A micro-batch's weight, float32: its sample count (``'mean'``), ``loss_weight_fn(*micro_args)``, or 1
  (``'sum'``); a weight that is not one number raises a ``ValueError`` as the step is traced."""
  if grad_reduction == 'sum' or loss_weight_fn is None:
    return jnp.asarray(1 if grad_reduction == 'sum' else size, jnp.float32)
  weight = jnp.asarray(bm.as_jax(loss_weight_fn(*micro_args)), jnp.float32)
  if weight.shape != ():
    raise ValueError(f"loss_weight_fn must return one number per (micro-)batch, the weight of its mean, such as "
                     f"its count of valid samples or time steps (targets['mask'].sum()); it returned an array of "
                     f"shape {weight.shape}.")
  return weight


try:  # keeps JAX's weak type, which a public astype() drops
  from jax._src.lax.lax import _convert_element_type
except ImportError:  # pragma: no cover - older or newer JAX without the private helper
  _convert_element_type = None


def weakly_typed(value):
  """``value`` as a weakly typed JAX array, like values made from Python scalars (no public API for this);
  ``value`` unchanged with a JAX that lacks the helper or refuses it (a strong type costs one more compilation)."""
  if _convert_element_type is None:
    return value
  try:
    return _convert_element_type(value, value.dtype, weak_type=True)
  except (TypeError, AssertionError):
    return value


def same_type(x, like):
  """``x`` with the dtype and weak type of ``like``.

  Parameters created from Python zeros are weakly typed; an update that
  returned them strongly typed would change the step's abstract inputs and
  cost a second XLA compilation.
  """
  x, like = jnp.asarray(x), jnp.asarray(like)
  weak = like.weak_type
  if x.dtype == like.dtype and x.weak_type == weak:
    return x
  if _convert_element_type is None:
    return x.astype(like.dtype)
  return _convert_element_type(x, like.dtype, weak_type=weak)


def _wide_dtype(x):
  return jnp.promote_types(jnp.result_type(x), jnp.float32)


def _wide(x):
  # Convert only when needed: an ``astype`` would drop JAX's weak type, change the
  # parameters' abstract type after the first update and cost a second compilation.
  x = jnp.asarray(x)
  return x if x.dtype == _wide_dtype(x) else x.astype(_wide_dtype(x))


def wide_zeros_like(tree):
  """Zeros shaped like ``tree``, in float32 or wider (keeping weak types)."""
  return jax.tree_util.tree_map(lambda x: jnp.zeros_like(_wide(x)), tree)


def scaled(weight, x):
  """``weight * x``, exactly 0 where ``weight`` is 0 (also where ``x`` is not finite there).

  Examples
  --------
  >>> import jax.numpy as jnp
  >>> scaled(jnp.float32(0.), jnp.array([jnp.nan, 1.])), scaled(jnp.float32(2.), jnp.array([3., 1.]))
  (Array([0., 0.], dtype=float32), Array([6., 2.], dtype=float32))
  """
  return weight * jnp.where(weight != 0, x, jnp.zeros_like(x))


def add_scaled(total, weight, tree):
  """``total + weight * tree``, leaf by leaf, in the (wide) dtype of ``total``; nothing where ``weight`` is 0."""
  return jax.tree_util.tree_map(lambda t, x: t + scaled(weight, _wide(x)), total, tree)


def finish_grads(grad_sum, total_weight, reduction: str, params=None):
  """Divide the summed gradients by the total weight for ``'mean'``; cast them to the parameters' types if given.

  Without ``params`` they stay in the accumulator's (float32 or wider) precision,
  for callers that keep accumulating, such as a window across batches.
  """
  grads = jax.tree_util.tree_map(lambda g: g / total_weight if reduction == 'mean' else g, grad_sum)
  return grads if params is None else jax.tree_util.tree_map(same_type, grads, params)


def weighted_sum(weights, v):
  """``sum_i weights[i] * v[i]`` over the leading axis of ``v``, in float32 whatever the matmul precision; a
  ``v[i]`` of weight 0 adds nothing (:func:`scaled`).

  Examples
  --------
  >>> import jax.numpy as jnp
  >>> from brainpy_accum.core._combine import weighted_sum
  >>> weighted_sum(jnp.array([3., 1.]), jnp.array([[1., 2.], [5., 6.]]))
  Array([ 8., 12.], dtype=float32)
  """
  v = _wide(v)
  return jnp.sum(scaled(jnp.reshape(weights, weights.shape + (1,) * (v.ndim - 1)), v), axis=0)


def sum_values(values, weights, reduction: str):
  """Weighted sum (``'mean'``) or plain sum (``'sum'``) over the leading micro-batch axis of ``values``.

  ``values`` is a pytree whose leaves stack one entry per micro-batch;
  ``weights`` is the vector of micro-batch weights. Sums from several devices
  add up to the sum over all their micro-batches.
  """
  weights = jnp.asarray(weights, jnp.float32)
  if reduction == 'sum':
    return jax.tree_util.tree_map(lambda v: _wide(v).sum(0), values)
  return jax.tree_util.tree_map(lambda v: weighted_sum(weights, v), values)


def finish_values(sums, total_weight, reduction: str):
  """Turn :func:`sum_values` sums into the weighted mean (``'mean'``); ``'sum'`` keeps them."""
  if reduction == 'sum':
    return sums
  return jax.tree_util.tree_map(lambda v: v / total_weight, sums)


def combine_values(values, weights, reduction: str):
  """Weighted mean (``'mean'``) or plain sum (``'sum'``) over the leading micro-batch axis of ``values``."""
  weights = jnp.asarray(weights, jnp.float32)
  return finish_values(sum_values(values, weights, reduction), weights.sum(), reduction)
