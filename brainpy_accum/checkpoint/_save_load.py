"""Saving and restoring a trainer: parameters, model state, optimizer state, accumulation counters, random state.

The file (:mod:`~brainpy_accum.checkpoint._file`) keeps a SHA-256 of every
part of it, and loading verifies them all, then checks the file against the
trainer (counts, shapes, dtypes), before assigning anything: a damaged,
truncated, foreign or mismatched file raises and leaves the trainer as it was.
Saving writes a temporary file and renames it into place: a save that fails
(a full disk, a folder that disappeared) raises an ``OSError`` naming the path
and leaves the previous checkpoint intact; inside :meth:`fit` it warns and the
run goes on (:func:`save_or_warn`).

Variables are matched by position in BrainPy's traversal order, not by their
auto-generated names, which differ between processes that build other
objects first; the ``accumulate_steps`` window's sums, kept in the sorted order
of their parameters' names, are matched through the parameter each belongs to.

With several processes (:func:`jax.distributed.initialize`) every process
takes part in gathering the values (some, like the ``accumulate_steps``
window, live on all processes' devices), process 0 alone writes the file, and
all wait until it is in place (also when writing failed).

:meth:`fit` adds where the run stands (:class:`~brainpy_accum.checkpoint.Progress`) and its
metric history, so that ``fit(..., checkpoint=path)`` can resume.
"""

import os
import warnings
from typing import Dict, Optional, Tuple

import brainpy.math as bm
import jax
import numpy as np
from jax.experimental import multihost_utils

from ..core._combine import weakly_typed
from ._file import read_tree, write_tree
from ._resume import Progress

__all__ = ['RunFiles', 'checkpoint_groups', 'save', 'save_or_warn', 'load']


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
  atomically; return ``path``. Raises ``OSError`` naming ``path`` if it cannot be written (the previous file
  there is then unchanged).

  ``run``: :meth:`fit`'s ``(progress, {phase: PhaseLog.state()})``, kept beside the Variables.
  """
  groups = checkpoint_groups(trainer, window)
  tree = {'values': {g: {_key(i): _to_host(v.value) for i, v in enumerate(vs.values())} for g, vs in groups.items()},
          'names': {g: {_key(i): name for i, name in enumerate(vs)} for g, vs in groups.items()}}
  labels = {('values', g, _key(i)): f'{g} variable {name}' for g, vs in groups.items() for i, name in enumerate(vs)}
  if run is not None:
    progress, history = run
    tree['progress'] = {k: int(v) for k, v in progress._asdict().items()}
    tree['history'] = history
  path = os.fspath(path)
  failed = None
  if jax.process_index() == 0:
    try:
      write_tree(path, tree, labels)
    except OSError as error:
      failed = error
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'brainpy_accum checkpoint {path}')  # no process reads it before it exists
  if failed is not None:
    raise failed
  return path


def save_or_warn(trainer, path: str, window, run: Tuple[Progress, Dict[str, dict]]) -> bool:
  """:meth:`fit`'s checkpoints: :func:`save`, but a file that cannot be written (a full disk, a folder that
  disappeared) warns, once per failed checkpoint, and ``fit`` goes on; the file keeps the previous checkpoint
  and the next one tries again. Returns whether the file was written."""
  try:
    save(trainer, path, window, run)
  except OSError as error:
    progress = run[0]
    warnings.warn(f'{error.strerror or error} (epoch {progress.epoch}, update {progress.updates} of this fit call.) '
                  f'fit does not stop for this: its next checkpoint, if any, tries again. To stop instead, make '
                  f"this warning an error: warnings.filterwarnings('error', 'Could not write the checkpoint').",
                  UserWarning, stacklevel=3)
    return False
  return True


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


def _window_rows(name: str, value, expected: tuple) -> np.ndarray:
  """A sum of the ``accumulate_steps`` window (``window/...``) in the form this trainer keeps it, where it was
  saved with one row per device of a mesh and is loaded without one, or the reverse, or with another number of
  devices: the rows added (the window's sum is theirs), and where this trainer keeps rows, that sum in the first
  of rows of zeros. Other values, and sums of another form, as they are.

  Examples
  --------
  >>> saved = np.array([2., 3.], np.float32)  # a window's weight on a mesh of two devices
  >>> _window_rows('window/weight', saved, ()), _window_rows('window/weight', saved, (4,))
  (array(5., dtype=float32), array([5., 0., 0., 0.], dtype=float32))
  """
  value, expected = np.asarray(value), tuple(expected)
  if not name.startswith('window/') or value.shape == expected:
    return value
  if value.ndim == len(expected) + 1 and value.shape[1:] == expected:
    return np.asarray(value.sum(0, dtype=value.dtype))
  if value.ndim + 1 == len(expected) and value.shape == expected[1:]:
    total = value
  elif value.ndim == len(expected) and value.ndim and value.shape[1:] == expected[1:]:
    total = value.sum(0, dtype=value.dtype)
  else:
    return value
  rows = np.zeros(expected, value.dtype)
  rows[0] = total
  return rows


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
  assigning anything if the file is damaged or does not fit.

  Returns the ``(progress, history)`` that :meth:`fit` saved with it (``None`` for a checkpoint saved by hand).
  """
  path = os.fspath(path)
  tree = read_tree(path)
  if not isinstance(tree.get('values'), dict):
    raise ValueError(f'Checkpoint path={path!r} holds no Variables. Nothing was loaded.')
  groups = checkpoint_groups(trainer, window)
  emptied = _one_side_window(path, tree, groups)
  keys = {group: _stored_keys(tree, group, variables, groups['params']) for group, variables in groups.items()}
  _window_as_kept(tree, keys['counters'], groups['counters'])
  for group, variables in groups.items():
    if group not in tree['values']:
      raise ValueError(f'Checkpoint path={path!r} lacks the {group} group. Nothing was loaded.')
    _check_group(path, group, variables, tree['values'][group], keys[group])
  run = _run_of(path, tree)
  for group, variables in groups.items():
    for key, var in zip(keys[group], variables.values()):
      var.value = _from_host(tree['values'][group][key], var.value)
  for var in emptied:
    var.value = _from_host(np.zeros(np.shape(var.value), bm.as_jax(var.value).dtype), var.value)
  return run


def _window_as_kept(tree: dict, keys: list, counters: Dict[str, bm.Variable]) -> None:
  """The stored sums of the ``accumulate_steps`` window in ``tree`` (the file's contents, at ``keys``) in the form
  this trainer's ``counters`` keep them (:func:`_window_rows`), once, before they are checked and assigned."""
  stored = tree['values'].get('counters')
  if isinstance(stored, dict):
    for key, (name, var) in zip(keys, counters.items()):
      if key in stored:
        stored[key] = _window_rows(name, stored[key], np.shape(var.value))


def _one_side_window(path: str, tree: dict, groups: dict) -> list:
  """Where only one side has a window of sums between steps (``accumulate_steps`` other than 1, or a trainer
  that streams batches), leave it out of ``tree`` (the file's contents) and ``groups`` (this trainer's): a saved
  window that is empty holds nothing to carry over; this trainer's own window is to be emptied (returned, its
  Variables), as the saved run had nothing between steps. A saved window that holds sums not yet applied is
  refused, naming what would lose them."""
  names = tree.get('names', {}).get('counters')
  counters, stored = groups['counters'], tree['values'].get('counters')
  if not isinstance(names, dict) or not isinstance(stored, dict):
    return []
  saved = {key for key, name in names.items() if str(name).startswith('window/')}
  here = [name for name in counters if name.startswith('window/')]
  if saved and not here:
    weight = next((key for key in saved if names[key] == 'window/weight'), None)
    if weight is None or np.any(np.asarray(stored.get(weight, 1)) != 0):
      raise ValueError(f'Checkpoint path={path!r} holds the sums of an accumulate_steps window not yet applied '
                       f'(it was saved between the batches of one update), which this trainer, without such a '
                       f'window, would drop: resume with the accumulate_steps it was saved with. Nothing was loaded.')
    tree['values']['counters'] = {k: v for k, v in stored.items() if k not in saved}
  elif here and not saved:
    groups['counters'] = {k: v for k, v in counters.items() if k not in here}
    return [counters[name] for name in here]
  return []


def _run_of(path: str, tree: dict) -> Optional[Tuple[Progress, Dict[str, dict]]]:
  if 'progress' not in tree:
    return None
  try:
    progress = Progress(**{k: int(v) for k, v in tree['progress'].items()})
  except (TypeError, ValueError) as error:
    raise ValueError(f'Checkpoint path={path!r} has an unreadable record of where the run stood ({error}). '
                     f'Nothing was loaded.') from error
  return progress._replace(trained_all=bool(progress.trained_all)), tree.get('history', {})


class RunFiles:
  """A trainer's checkpoints as :meth:`fit` writes and reads them, for the fit loop, which never sees the trainer:
  :meth:`load` and :meth:`save` of :func:`load` and :func:`save_or_warn` with the trainer and its window bound.

  Examples
  --------
  >>> import os, tempfile, brainpy as bp, brainpy.math as bm
  >>> from brainpy_accum import AccumBPTT
  >>> from brainpy_accum.checkpoint._resume import Progress
  >>> from brainpy_accum.checkpoint._save_load import RunFiles
  >>> with bm.training_environment():
  ...   model = bp.dnn.Dense(2, 2)
  >>> files = RunFiles(AccumBPTT(model, 'mean_squared_error'), window=None)
  >>> path = os.path.join(tempfile.mkdtemp(), 'run.ckpt')
  >>> files.save(path, (Progress(epoch=3), {}))
  True
  >>> files.load(path)[0].epoch
  3
  """

  def __init__(self, trainer, window):
    self._trainer, self._window = trainer, window

  def load(self, path: str) -> Optional[Tuple[Progress, Dict[str, dict]]]:
    """:func:`load`: the trainer restored from ``path``; the run's ``(progress, history)`` saved with it."""
    return load(self._trainer, path, self._window)

  def save(self, path: str, run: Tuple[Progress, Dict[str, dict]]) -> bool:
    """:func:`save_or_warn`: the trainer and the run's ``(progress, history)`` to ``path``."""
    return save_or_warn(self._trainer, path, self._window, run)
