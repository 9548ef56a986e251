"""What makes a second run start fast: JAX's persistent compilation cache and a cache of the planner's plans.

Both live in one folder (:func:`cache_folder`): by default ``$XDG_CACHE_HOME/brainpy_accum`` or
``~/.cache/brainpy_accum``; ``BRAINPY_ACCUM_CACHE_DIR`` moves it, ``BRAINPY_ACCUM_CACHE=0`` turns both off, and
so does the trainer's ``cache=False``. JAX's cache goes to ``<folder>/jax`` only if JAX has none yet (an
already set ``JAX_COMPILATION_CACHE_DIR`` or ``jax.config`` value is kept). Plans go to ``<folder>/plans``, one
JSON file per key; the key holds everything a plan depends on and is stored in the file, so an entry written
for another key (a foreign one), an older format or a file that does not parse is ignored with a one-line
warning and written anew. Writes go to a temporary file in the same folder and are renamed into place
(``os.replace``), so two processes writing at once leave one whole entry, never a mix.

:class:`CachedPlans` is a planner's dialogue with that cache: the key of a batch, what it stores, and the plans,
chunk sizes and piece sizes it reads back, none trusted: each is checked, and measured again by the planner,
before it is used, else a one-line warning and planning anew.
"""

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import jax

from ..core._cut import MicroBatchPlan, plan_micro_batches
from ._budget import candidate_micro_batch_sizes, format_memory
from ._device import PlanBudget
from ._stream import chunk_candidates

__all__ = ['CACHE_SWITCH', 'CACHE_FOLDER', 'CachedPlans', 'PlanCache', 'cache_folder', 'use_compilation_cache']

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


class CachedPlans:
  """A planner's dialogue with the plan cache: the key of a batch, the entries it stores, and those it reads back.

  An entry read back is never trusted: one that does not describe a plan (a chunk size, a piece size) of the
  batch is ignored, and one whose step no longer fits the budget is dropped, each with a one-line warning, and
  the batch is planned anew. A cached 'does not fit' (the same step measured by an earlier run) raises its error
  again, for streaming to go on.

  Parameters
  ----------
  cache : PlanCache, optional
    The plans of earlier runs (``None``: plans are not cached).
  key_of : callable, optional
    ``key_of(shared_args, inputs, targets, via_window, budget) -> dict``: everything a batch's plan depends on.
  budget : PlanBudget
    The budget plans are made against (:class:`~brainpy_accum.memory._device.PlanBudget`): in every key.

  Examples
  --------
  >>> from brainpy_accum.memory._cache import CachedPlans
  >>> CachedPlans(None, None, budget=None).key((None, 'inputs', 'targets'), via_window=False) is None  # no cache
  True
  """

  def __init__(self, cache: Optional[PlanCache], key_of: Optional[Callable[..., dict]], budget: PlanBudget):
    self.cache, self.key_of, self.budget = cache, key_of, budget

  def key(self, batch: tuple, via_window: bool, modelled: bool = False, **kind) -> Optional[dict]:
    """Everything the plan of ``batch`` (``shared_args, inputs, targets``) depends on, as JSON, with ``kind``
    (the choice of chunk or piece, beside the batch's own plans); ``None`` where plans are not cached: no cache,
    or ``modelled``, a plan timed by a model."""
    if self.cache is None or self.key_of is None or modelled:
      return None
    return dict(self.key_of(*batch, via_window, self.budget.bytes()), **kind)

  def is_cached(self, batch: tuple) -> bool:
    """Whether the cache has a file for this batch's plan (not read: planning reads and checks it)."""
    key = self.key(batch, False)
    return key is not None and os.path.exists(self.cache.path(key))

  def store(self, key: Optional[dict], entry: dict) -> None:
    """Store ``entry`` (a plan, a 'does not fit', a chunk or piece size) for ``key``; nothing where ``None``."""
    if key is not None:
      self.cache.put(key, entry)

  def plan(self, key: Optional[dict], batch_size: int, share: int) -> Optional[Tuple[MicroBatchPlan, int]]:
    """The cached plan of a batch of ``batch_size`` (a share of ``share`` samples per device) and the largest
    micro-batch that fits it, or ``None``: none cached, or an entry that describes no plan of it (warned of). A
    cached 'does not fit' raises its ``ValueError`` again."""
    entry = None if key is None else self.cache.get(key)
    if entry is None:
      return None
    if entry.get('fits') is False and isinstance(entry.get('error'), str):
      raise ValueError(entry['error'])
    plan = _cached_plan(entry, share)
    if plan is None:
      warnings.warn(f'plan cache: ignored an entry for batch {batch_size} that does not describe a plan of it; '
                    f'planning anew.', UserWarning, stacklevel=3)
      return None
    return plan, max(plan.micro_batch_size, entry.get('largest', plan.micro_batch_size))

  def still_fits(self, plan: MicroBatchPlan, batch_size: int, used: int) -> bool:
    """Whether the cached ``plan``, its step compiled again and measured at ``used`` bytes, fits the budget;
    warns where it does not."""
    if used <= self.budget.bytes():
      return True
    warnings.warn(f'plan cache: the cached plan for batch {batch_size} ({plan.describe_cuts()}) needs '
                  f'{format_memory(used)} now, over {self.budget.describe()}; planning anew.', UserWarning,
                  stacklevel=3)
    return False

  def chunk(self, key: Optional[dict], batch_size: int, micro_batch_of: Callable[[int], Optional[int]]
            ) -> Optional[int]:
    """The chunk size an earlier run chose to stream a batch of ``batch_size`` in, if cached and its step still
    fits (``micro_batch_of`` plans it: from the cache too, its step compiled again and measured); else ``None``."""
    return self._size(key, 'stream_chunk', chunk_candidates(batch_size), lambda size: micro_batch_of(size) is not None,
                      ignored=f'streaming batch {batch_size} that does not name a chunk size of it',
                      unfit=f'chunk size {{}} for streaming batch {batch_size}')

  def piece(self, key: Optional[dict], batch_size: int, fits: Callable[[int], bool]) -> Optional[int]:
    """The piece size an earlier run chose to stream a batch of ``batch_size`` in, if cached and ``fits(piece)``
    (its step planned again, from the cache too, and still in one micro-batch beside what streaming holds);
    else ``None``."""
    sizes = [size for size in candidate_micro_batch_sizes(batch_size) if size < batch_size]
    return self._size(key, 'piece', sizes, fits,
                      ignored=f'batch {batch_size} streamed in pieces that does not name a piece size of it',
                      unfit=f'piece size {{}} for batch {batch_size}')

  def _size(self, key: Optional[dict], field: str, sizes: Sequence[int], fits: Callable[[int], bool], *,
            ignored: str, unfit: str) -> Optional[int]:
    entry = None if key is None else self.cache.get(key)
    if entry is None:
      return None
    size = entry.get(field)
    if not isinstance(size, int) or isinstance(size, bool) or size not in sizes:
      warnings.warn(f'plan cache: ignored an entry for {ignored}; planning anew.', UserWarning, stacklevel=3)
      return None
    if not fits(size):
      warnings.warn(f'plan cache: the cached {unfit.format(size)} does not fit {self.budget.describe()} now; '
                    f'planning anew.', UserWarning, stacklevel=3)
      return None
    return size


def _cached_plan(entry: dict, share: int) -> Optional[MicroBatchPlan]:
  """The plan a plan-cache entry describes for a share of ``share`` samples, or ``None`` if it describes none."""
  size, remat = entry.get('micro_batch_size'), entry.get('remat')
  largest = entry.get('largest', size)
  count = lambda x: isinstance(x, int) and not isinstance(x, bool) and 1 <= x  # noqa: E731 (a bool is an int too)
  if not (count(size) and size <= share and (remat is None or isinstance(remat, bool) or count(remat))
          and count(largest) and largest <= share):
    return None
  return plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)


def _ignored(path: str, why: str) -> None:
  warnings.warn(f'plan cache: ignored {path}, {why}; planning anew.', UserWarning, stacklevel=3)
  return None
