"""Combining the gradients, losses and metrics of micro-batches into the whole-batch ones.

With ``grad_reduction='mean'`` each micro-batch enters with its weight
``w_i`` (its sample count) and the result is ``sum_i w_i * g_i / sum_i w_i``:
the whole-batch gradient of a loss that is a mean over samples. With
``'sum'`` the weights are 1 and nothing is divided: the whole-batch gradient
of a loss that is a sum over samples. Losses and auxiliary metrics are
combined the same way, so what is reported matches what is differentiated.
Gradients are summed in at least float32, whatever the parameters' dtype.
"""

import jax
import jax.numpy as jnp

__all__ = ['GRAD_REDUCTIONS', 'wide_zeros_like', 'add_scaled', 'finish_grads', 'combine_values', 'concat_stacked']

GRAD_REDUCTIONS = ('mean', 'sum')


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


def add_scaled(total, weight, tree):
  """``total + weight * tree``, leaf by leaf, in the (wide) dtype of ``total``."""
  return jax.tree_util.tree_map(lambda t, x: t + weight * _wide(x), total, tree)


def finish_grads(grad_sum, total_weight, reduction: str, params):
  """Divide the summed gradients by the total weight for ``'mean'`` and cast them to the parameters' dtypes."""
  def finish(g, p):
    g = g / total_weight if reduction == 'mean' else g
    return g if g.dtype == jnp.result_type(p) else g.astype(jnp.result_type(p))
  return jax.tree_util.tree_map(finish, grad_sum, params)


def combine_values(values, weights, reduction: str):
  """Weighted mean (``'mean'``) or plain sum (``'sum'``) over the leading micro-batch axis of ``values``.

  ``values`` is a pytree whose leaves stack one entry per micro-batch;
  ``weights`` is the vector of micro-batch weights.
  """
  weights = jnp.asarray(weights, jnp.float32)
  if reduction == 'sum':
    return jax.tree_util.tree_map(lambda v: _wide(v).sum(0), values)
  return jax.tree_util.tree_map(lambda v: jnp.tensordot(weights, _wide(v), axes=1) / weights.sum(), values)


def concat_stacked(first, second):
  """Join two pytrees of per-micro-batch values along their leading (micro-batch) axis."""
  return jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), first, second)
