"""What makes a second run start fast: JAX's persistent compilation cache and a cache of the planner's plans.

Both live in one folder (:func:`cache_folder`): by default ``$XDG_CACHE_HOME/brainpy_accum`` or
``~/.cache/brainpy_accum``; ``BRAINPY_ACCUM_CACHE_DIR`` moves it, ``BRAINPY_ACCUM_CACHE=0`` turns both off, and
so does the trainer's ``cache=False``. JAX's cache goes to ``<folder>/jax`` only if JAX has none yet (an
already set ``JAX_COMPILATION_CACHE_DIR`` or ``jax.config`` value is kept). Plans go to ``<folder>/plans``, one
JSON file per key; the key holds everything a plan depends on and is stored in the file, so an entry written
for another key (a foreign one), an older format or a file that does not parse is ignored with a one-line
warning and written anew. Writes go to a temporary file in the same folder and are renamed into place
(``os.replace``), so two processes writing at once leave one whole entry, never a mix.
"""

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Optional, Union

import jax

__all__ = ['CACHE_SWITCH', 'CACHE_FOLDER', 'PlanCache', 'cache_folder', 'use_compilation_cache']

CACHE_SWITCH = 'BRAINPY_ACCUM_CACHE'      # '0', 'off', 'false' or 'no': no caches unless a trainer names a folder
CACHE_FOLDER = 'BRAINPY_ACCUM_CACHE_DIR'  # the folder of both caches
_OFF = ('0', 'off', 'false', 'no')
FORMAT = 2  # of the plan files; a file of another format is ignored (2: plans name their largest fitting micro-batch)


def cache_folder(cache: Union[bool, str, os.PathLike] = True) -> Optional[str]:
  """The caches' folder for the trainer option ``cache``, or ``None`` for no caches.

  ``cache`` may be ``True`` (the default folder, unless ``BRAINPY_ACCUM_CACHE=0``), ``False`` or a folder
  (used even with ``BRAINPY_ACCUM_CACHE=0``: it was asked for by name).

  Examples
  --------
  >>> from brainpy_accum.memory._cache import cache_folder
  >>> cache_folder(False) is None, cache_folder('/tmp/plans')
  (True, '/tmp/plans')
  """
  if isinstance(cache, bool):
    if not cache or os.environ.get(CACHE_SWITCH, '').strip().lower() in _OFF:
      return None
    if os.environ.get(CACHE_FOLDER):
      return os.environ[CACHE_FOLDER]
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(base, 'brainpy_accum')
  if isinstance(cache, (str, os.PathLike)):
    return os.fspath(cache)
  raise TypeError(f'cache={cache!r} must be True (the default folder), False (no caches) or a folder path.')


def use_compilation_cache(folder: str) -> str:
  """Turn on JAX's persistent compilation cache in ``folder/jax`` unless JAX already has a cache folder; return
  the folder JAX uses. When it sets the folder, compilations of 0.1 s or more are kept (JAX's default: 1 s)."""
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  path = os.path.join(folder, 'jax')
  jax.config.update('jax_compilation_cache_dir', path)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.1)
  return path


def _normal(key: Any) -> Any:
  """``key`` as JSON gives it back (tuples become lists), to compare with a stored key."""
  return json.loads(json.dumps(key, sort_keys=True))


class PlanCache:
  """Plans on disk, one JSON file ``{'format', 'key', 'plan'}`` per key, under ``folder/plans``."""

  def __init__(self, folder: str):
    self.folder = os.path.join(folder, 'plans')

  def path(self, key: Any) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]
    return os.path.join(self.folder, f'{digest}.json')

  def get(self, key: Any) -> Optional[dict]:
    """The plan stored for ``key``, or ``None``: absent, or ignored (with a warning) if foreign, stale or corrupt."""
    path = self.path(key)
    try:
      with open(path) as f:
        entry = json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError) as error:
      return _ignored(path, f'unreadable ({type(error).__name__})')
    if not isinstance(entry, dict) or entry.get('format') != FORMAT:
      return _ignored(path, 'of another format')
    if entry.get('key') != _normal(key):
      return _ignored(path, 'written for another model, batch, option or version')
    plan = entry.get('plan')
    return plan if isinstance(plan, dict) else _ignored(path, 'without a plan')

  def put(self, key: Any, plan: dict) -> None:
    """Store ``plan`` for ``key`` atomically; a folder that cannot be written gives a warning, not an error."""
    path = self.path(key)
    try:
      os.makedirs(self.folder, exist_ok=True)
      with tempfile.NamedTemporaryFile('w', dir=self.folder, prefix='.writing-', suffix='.json', delete=False) as f:
        json.dump({'format': FORMAT, 'key': key, 'plan': plan}, f, sort_keys=True)
        temporary = f.name
      os.replace(temporary, path)
    except (OSError, TypeError, ValueError) as error:
      warnings.warn(f'plan cache: could not write {path} ({type(error).__name__}: {error}); planning is not cached.',
                    UserWarning, stacklevel=2)


def _ignored(path: str, why: str) -> None:
  warnings.warn(f'plan cache: ignored {path}, {why}; planning anew.', UserWarning, stacklevel=3)
  return None
