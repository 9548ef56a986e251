"""Applying the combined gradient: global-norm clipping and the non-finite guard, once per optimizer update."""

from typing import Dict, Optional

import brainpy.math as bm
import jax
import jax.numpy as jnp

from ..core._combine import same_type

__all__ = ['all_finite', 'clip_by_global_norm', 'guarded_update']

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
