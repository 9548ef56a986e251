"""Saving and restoring a trainer: parameters, model state, optimizer state, accumulation counters, random state.

Files are written with BrainPy's own :func:`brainpy.checkpoints.save_pytree`
(msgpack) to a temporary name beside the target and renamed into place, so a
crash never leaves a half-written checkpoint. Loading checks the whole file
against the trainer (format, counts, shapes, dtypes) before assigning
anything: a corrupt or mismatched file raises and leaves the trainer as it was.
Variables are matched by position in BrainPy's traversal order, not by their
auto-generated names, which differ between processes that build other
objects first; the ``accumulate_steps`` window's sums, kept in the sorted order
of their parameters' names, are matched through the parameter each belongs to.

With several processes (:func:`jax.distributed.initialize`) every process
takes part in gathering the values (some, like the ``accumulate_steps``
window, live on all processes' devices), process 0 alone writes the file, and
all wait until it is in place. Stale temporary files of processes that died
while writing are removed at the next save.

:meth:`fit` adds where the run stands (:class:`~brainpy_accum.checkpoint.Progress`) and its
metric history, so that ``fit(..., checkpoint=path)`` can resume.
"""

import glob
import os
from typing import Dict, Optional, Tuple

import brainpy as bp
import brainpy.math as bm
import jax
import numpy as np
from jax.experimental import multihost_utils

from ..core._combine import weakly_typed
from ._resume import Progress

__all__ = ['FORMAT', 'checkpoint_groups', 'save', 'load']

FORMAT = 'brainpy_accum.checkpoint.v1'


def checkpoint_groups(trainer, window) -> Dict[str, Dict[str, bm.Variable]]:
  """Every Variable a checkpoint holds, by group, in a stable order; ``window``: the trainer's
  ``accumulate_steps`` window (:class:`~brainpy_accum.trainer._window.GradWindow`), or ``None``."""
  params = dict(trainer.target.train_vars().unique())
  taken = {id(v) for v in params.values()}
  model_state = {k: v for k, v in trainer.target.vars().unique().items() if id(v) not in taken}
  taken |= {id(v) for v in model_state.values()}
  optimizer = {k: v for k, v in trainer.optimizer.vars().unique().items() if id(v) not in taken}
  counters = {'skipped_steps': trainer.skipped_steps}
  if window is not None:
    counters.update({f'window/{k}': v for k, v in window.variables().items()})
  return {'params': params, 'model_state': model_state, 'optimizer': optimizer, 'counters': counters,
          'random': {'default': bm.random.DEFAULT}}


def _key(i: int) -> str:
  return f'{i:05d}'


def _is_prng_key(value) -> bool:
  return jax.dtypes.issubdtype(getattr(value, 'dtype', None), jax.dtypes.prng_key)


def _to_host(value) -> np.ndarray:
  """A NumPy array of ``value``; typed PRNG keys as their raw key data."""
  value = bm.as_jax(value)
  value = jax.random.key_data(value) if _is_prng_key(value) else value
  if isinstance(value, jax.Array) and not value.is_fully_addressable:  # parts live in other processes
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(value)


def _from_host(stored, current):
  """``stored`` in the form of ``current``: typed PRNG keys re-wrapped; on this process's devices, with the
  same placement, commitment and weak type (so that the loaded values hit the compiled steps' caches instead of
  compiling them again). Values shared with other processes stay on the host until the next placement."""
  current = bm.as_jax(current)
  if _is_prng_key(current):
    return jax.random.wrap_key_data(np.asarray(stored), impl=jax.random.key_impl(current))
  stored = np.asarray(stored)
  if not isinstance(current, jax.Array) or not current.is_fully_addressable:
    return stored
  if getattr(current, 'weak_type', False):
    stored = weakly_typed(stored)
  committed = getattr(current, 'committed', getattr(current, '_committed', True))
  return jax.device_put(stored, current.sharding) if committed else jax.device_put(stored)


def save(trainer, path: str, window, run: Optional[Tuple[Progress, Dict[str, dict]]] = None) -> str:
  """Write the trainer's checkpoint (with its ``accumulate_steps`` ``window``, or ``None``) to ``path``
  atomically; return ``path``.

  ``run``: :meth:`fit`'s ``(progress, {phase: PhaseLog.state()})``, kept beside the Variables.
  """
  groups = checkpoint_groups(trainer, window)
  tree = {'format': FORMAT,
          'values': {g: {_key(i): _to_host(v.value) for i, v in enumerate(vs.values())} for g, vs in groups.items()},
          'names': {g: {_key(i): name for i, name in enumerate(vs)} for g, vs in groups.items()}}
  if run is not None:
    progress, history = run
    tree['progress'] = {k: int(v) for k, v in progress._asdict().items()}
    tree['history'] = history
  path = os.fspath(path)
  if jax.process_index() == 0:
    _write(tree, path)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'brainpy_accum checkpoint {path}')  # no process reads it before it exists
  return path


def _write(tree: dict, path: str) -> None:
  """``tree`` to ``path`` through a temporary file renamed into place (never a partial file at ``path``)."""
  _remove_stale_temporaries(path)
  temporary = f'{path}.tmp-{os.getpid()}'
  try:
    bp.checkpoints.save_pytree(temporary, tree, overwrite=True, verbose=False)
    os.replace(temporary, path)
  finally:
    if os.path.exists(temporary):
      os.remove(temporary)


def _remove_stale_temporaries(path: str) -> None:
  """Remove ``path.tmp-<pid>`` files left by writers that were killed mid-write (their pid is gone)."""
  for temporary in glob.glob(glob.escape(path) + '.tmp-*'):
    pid = temporary.rsplit('-', 1)[-1]
    if pid.isdigit() and not _alive(int(pid)):
      try:
        os.remove(temporary)
      except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _read(path: str) -> dict:
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No checkpoint at path={path!r}: save one with trainer.save_checkpoint(path).')
  try:
    tree = bp.checkpoints.load_pytree(path)
  except Exception as error:
    raise ValueError(f'path={path!r} is not a readable checkpoint ({error}). Nothing was loaded.') from error
  if not isinstance(tree, dict) or tree.get('format') != FORMAT:
    raise ValueError(f'path={path!r} is not a {FORMAT} checkpoint written by AccumBPTT.save_checkpoint. '
                     f'Nothing was loaded.')
  return tree


def _stored_keys(tree: dict, group: str, variables: Dict[str, bm.Variable], params: Dict[str, bm.Variable]) -> list:
  """The stored key of each of ``variables`` (a group of this trainer, by name): the same position, but for the
  ``accumulate_steps`` window's sums, which are named after the parameters (``window/grads/<name>``) and kept
  in the order of those names (JAX sorts a dict's keys: ``Dense10`` before ``Dense9``): each is the stored sum
  of the parameter at its parameter's position, whatever the names were in the process that saved it."""
  keys = [_key(i) for i in range(len(variables))]
  names = tree.get('names', {})
  if group != 'counters' or 'params' not in names or group not in names:
    return keys
  saved_param = {current: names['params'].get(_key(i)) for i, current in enumerate(params)}
  stored_at = {name: key for key, name in names[group].items()}
  for i, name in enumerate(variables):
    if name.startswith('window/grads/'):
      saved = f"window/grads/{saved_param.get(name[len('window/grads/'):])}"
      keys[i] = stored_at.get(saved, keys[i])
  return keys


def _check_group(path, group, variables, stored, keys) -> None:
  if len(stored) != len(variables):
    raise ValueError(f'Checkpoint path={path!r} holds {len(stored)} {group} variables, this trainer has '
                     f'{len(variables)}: it was saved from another model or configuration. Nothing was loaded.')
  for key, (name, var) in zip(keys, variables.items()):
    value, current = np.asarray(stored[key]), _to_host(var.value)
    axis = getattr(var, 'batch_axis', None)
    shape, expected = list(value.shape), list(current.shape)
    if axis is not None and len(shape) == len(expected):
      shape[axis] = expected[axis] = None  # the model state may be saved at another batch size
    if shape != expected or value.dtype != current.dtype:
      raise ValueError(f'Checkpoint path={path!r} does not fit {group} variable {name}: stored '
                       f'{value.dtype}{list(value.shape)}, expected {current.dtype}{list(current.shape)}. '
                       f'Nothing was loaded.')


def load(trainer, path: str, window) -> Optional[Tuple[Progress, Dict[str, dict]]]:
  """Restore ``trainer`` (and its ``accumulate_steps`` ``window``, or ``None``) from ``path``; raises before
  assigning anything if the file does not fit.

  Returns the ``(progress, history)`` that :meth:`fit` saved with it (``None`` for a checkpoint saved by hand).
  """
  path = os.fspath(path)
  tree = _read(path)
  groups = checkpoint_groups(trainer, window)
  keys = {group: _stored_keys(tree, group, variables, groups['params']) for group, variables in groups.items()}
  for group, variables in groups.items():
    if group not in tree['values']:
      raise ValueError(f'Checkpoint path={path!r} lacks the {group} group. Nothing was loaded.')
    _check_group(path, group, variables, tree['values'][group], keys[group])
  for group, variables in groups.items():
    for key, var in zip(keys[group], variables.values()):
      var.value = _from_host(tree['values'][group][key], var.value)
  return _run_of(tree)


def _run_of(tree: dict) -> Optional[Tuple[Progress, Dict[str, dict]]]:
  if 'progress' not in tree:
    return None
  progress = Progress(**{k: int(v) for k, v in tree['progress'].items()})
  return progress._replace(trained_all=bool(progress.trained_all)), tree.get('history', {})
