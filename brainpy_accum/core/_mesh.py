"""Data parallelism over a :class:`jax.sharding.Mesh`: which axis holds the batch, how leaves are split,
how the devices' partial sums are combined, and the step of
:mod:`~brainpy_accum.trainer._step` on a mesh (:func:`on_mesh`: its two functions inside ``shard_map``, with
one ``psum``; parameters and optimizer state replicated, model states and the window's rows split).

Each device runs the whole micro-batch loop on its own share of the batch and
keeps its gradient sums local; the shares are added with one ``psum`` per
train step (:func:`sum_across_devices`), never inside the micro-batch loop.
The partitioning itself is JAX's: :func:`brainstate.transform.shard_map`
(``jax.shard_map`` with BrainPy Variables as states) over the user's mesh.
"""

import contextlib
import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._batch import is_array
from ._states import batched_variables

__all__ = ['UnevenSplitError', 'check_mesh', 'auto_axes', 'mesh_size', 'check_divisible', 'batch_spec',
           'sum_across_devices', 'random_states', 'per_device_random', 'place', 'on_mesh', 'split_variables']


def check_mesh(mesh, mesh_axis) -> Optional[str]:
  """Return the mesh axis that splits the batch (``None`` without a mesh); raise naming the argument otherwise."""
  if mesh is None:
    if mesh_axis is not None:
      raise ValueError(f'{mesh_axis=} names an axis of a device mesh, but mesh=None. Pass '
                       f"mesh=jax.sharding.Mesh(jax.devices(), ('batch',)) or drop mesh_axis.")
    return None
  if not isinstance(mesh, Mesh):
    raise TypeError(f'mesh must be a jax.sharding.Mesh, e.g. jax.sharding.Mesh(jax.devices(), '
                    f"('batch',)); got a {type(mesh).__name__}.")
  names = tuple(mesh.axis_names)
  if mesh_axis is None:
    if len(names) != 1:
      raise ValueError(f'mesh has the axes {names}: say which one splits the batch with mesh_axis=..., '
                       f'e.g. mesh_axis={names[0]!r}.')
    return names[0]
  if mesh_axis not in names:
    raise ValueError(f'{mesh_axis=} is not an axis of the mesh, whose axes are {names}.')
  return mesh_axis


def auto_axes(mesh: Mesh) -> Mesh:
  """The same devices and axis names with every axis of type ``Auto``.

  ``jax.make_mesh`` makes ``Explicit`` axes, whose sharding-in-types would
  reject slicing a micro-batch out of a sharded array while the step is
  traced at the whole batch's shape. The step partitions the batch itself
  (``shard_map``) and replicates the rest, so it needs no explicit types.
  """
  types = getattr(mesh, 'axis_types', None)
  if types is None or all(t == AxisType.Auto for t in types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def mesh_size(mesh: Mesh, axis: str) -> int:
  """Number of devices along ``axis`` (the number of shares a batch is cut into)."""
  return int(mesh.shape[axis])


class UnevenSplitError(ValueError):
  """A batch whose samples do not split evenly over a mesh's devices."""


def check_divisible(batch_size: int, num_devices: int, axis: str) -> int:
  """Samples per device; raise an :class:`UnevenSplitError` (a ``ValueError``) with the fix if the batch does
  not split evenly."""
  if batch_size % num_devices:
    lower, upper = batch_size // num_devices * num_devices, -(-batch_size // num_devices) * num_devices
    raise UnevenSplitError(f'batch_size={batch_size} does not split evenly over the {num_devices} devices of mesh '
                           f'axis {axis!r}: every device must hold the same number of samples. Use batches whose size '
                           f'is a multiple of {num_devices} (e.g. {lower or num_devices} or {upper}), for instance by '
                           f'dropping or padding the last batch of an epoch.')
  return batch_size // num_devices


def batch_spec(batch_axis: int, mesh_axis: str) -> PartitionSpec:
  """The partition of an array whose samples lie along ``batch_axis``: split there, whole elsewhere."""
  return PartitionSpec(*([None] * batch_axis), mesh_axis)


def sum_across_devices(tree: Any, mesh_axis: str) -> Any:
  """Add a pytree of per-device partial sums over ``mesh_axis``: one all-reduce, its result on every device."""
  return jax.lax.psum(tree, mesh_axis)


def random_states(model) -> list:
  """BrainPy's global random state and any random state the model owns."""
  owned = [v for v in model.vars().unique().values() if isinstance(v, brainstate.random.RandomState)]
  default = brainstate.random.DEFAULT
  return [default] + [v for v in owned if v is not default]


@contextlib.contextmanager
def per_device_random(states, mesh_axis: str):
  """Inside a shard: give every device its own random stream, and leave one shared key behind.

  Each key is folded with the device's index on entry, so devices draw
  different random numbers for their different samples. On exit a key that
  was drawn from holds the first half of a split of the entry key, the same on
  every device (a replicated value, as the mesh expects of a state that is
  not sharded); a key that was not drawn from gets its entry value back, so a
  model without randomness inside the step leaves BrainPy's random state as
  a single device would.
  """
  keys = [state.value for state in states]
  index = jax.lax.axis_index(mesh_axis)
  folded = [jax.random.fold_in(key, index) for key in keys]
  for state, key in zip(states, folded):
    state.value = key
  try:
    yield
  finally:
    for state, key, mine in zip(states, keys, folded):
      state.value = key if state.value is mine else jax.random.split(key)[0]



def place(variables_and_specs, mesh: Mesh) -> None:
  """Put each Variable's value on ``mesh`` with its partition (a no-op for values already there).

  A jitted step is compiled for the placement of its inputs as well as their
  shapes: values that arrive once unplaced and later placed by the previous
  step would cost further compilations.
  """
  for var, spec in variables_and_specs:
    sharding = NamedSharding(mesh, spec)
    if getattr(var.value, 'sharding', None) != sharding:
      var.value = _to_sharding(var.value, sharding)


def _to_sharding(value, sharding: NamedSharding):
  """``value`` (the same in every process) as a global array with ``sharding``."""
  if jax.process_count() == 1:
    return jax.device_put(value, sharding)
  # Several processes: device_put cannot reach other hosts' devices; each process
  # contributes its own devices' pieces of the value, which every process holds whole.
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    data = _to_sharding(jax.random.key_data(value), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
  host = np.asarray(value)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


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
