"""The step of :mod:`~brainpy_accum.trainer._step` on a mesh: the same two functions, inside ``shard_map``,
with one ``psum``.

Every device runs :func:`~brainpy_accum.trainer._step.batch_sums` on its share of the batch with its own
random stream, then :func:`~brainpy_accum.trainer._step.settle` with ``across`` the sum over the mesh axis:
the devices' partial sums meet once per train step, never inside the micro-batch loop. Parameters and
optimizer state are replicated; model states and the window rows are split as ``state_specs`` says.
"""

import functools
from typing import Callable, List, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
from jax.sharding import Mesh, PartitionSpec

from ._batch import is_array
from ._mesh import batch_spec, per_device_random, sum_across_devices
from ._states import batched_variables

__all__ = ['on_mesh', 'split_variables']


def on_mesh(sums_of: Callable, settle: Callable, mesh: Mesh, axis: str, args: tuple, arg_axes: Sequence[int],
            state_specs: dict, random: list):
  """``settle(sums_of(share), across)`` on every device's share of ``args``; the result is replicated.

  ``arg_axes``: the batch axis of each leaf of ``args``; ``state_specs``: ``{Variable: PartitionSpec}`` of
  the Variables split over the mesh (others are replicated); ``random``: the random states each device
  folds with its index while it computes its sums (:func:`~brainpy_accum.core._mesh.per_device_random`).
  """
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)
  across = functools.partial(sum_across_devices, mesh_axis=axis)

  def local(*local_leaves):
    with per_device_random(random, axis):
      sums = sums_of(jax.tree_util.tree_unflatten(treedef, local_leaves))
    return settle(sums, across, axis)

  run = brainstate.transform.shard_map(
    local, mesh, in_specs=tuple(batch_spec(a, axis) for a in arg_axes), out_specs=PartitionSpec(),
    state_in_specs=state_specs, state_out_specs=state_specs, check_vma=False)
  return run(*[bm.as_jax(x) for x in leaves])


def split_variables(model, window, mesh_axis: str, batch_size: Optional[int] = None) -> List[Tuple[bm.Variable, PartitionSpec]]:
  """``(Variable, partition)`` of every Variable split over the mesh: ``model``'s states along their batch axis
  and the rows of ``window`` (the ``accumulate_steps`` window, or ``None``) one per device. All others are
  replicated."""
  split = [(var, batch_spec(state_axis, mesh_axis)) for var, state_axis in batched_variables(model, batch_size).values()]
  if window is not None:
    split += [(var, batch_spec(0, mesh_axis)) for var in window.variables().values()]
  return split
