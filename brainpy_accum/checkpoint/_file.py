"""The checkpoint file: a tree of dicts, strings, numbers and NumPy arrays, every byte of it under a checksum.

Layout of the current format::

    brainpy_accum.checkpoint.v2\\n        the format line
    <n> <SHA-256 of the header>\\n         the header's length in bytes and its checksum
    <header: n bytes of JSON>             the tree without its arrays; each array's path in the tree,
                                          dtype, shape, label and the SHA-256 of its bytes
    <each array's bytes, in the header's order (C order, the machine's byte order)>

Reading checks every part before it returns anything: the format line as written, the header against its
checksum, each array against its own, and the file's end where the last array ends. A byte changed anywhere, a
truncated or extended file is refused with an error that names the file and the part that failed (which
array, by its label). The checksums are taken of the bytes that are written, before writing.

Writing goes to a temporary file beside the target (``<path>.tmp-<pid>``), flushed to the disk, then renamed
into place: a crash or a full disk never leaves a partial file at ``path``, and a failed write leaves the file
that was there unchanged. Temporary files of writers that died (their process is gone) are removed by the
next write.

Files of the previous format (``brainpy_accum.checkpoint.v1``: BrainPy's msgpack, written with
:func:`brainpy.checkpoints.save_pytree`, without checksums) still load, with a warning that damage to them
cannot be detected.
"""

import glob
import hashlib
import json
import os
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

import brainpy as bp
import jax.numpy as jnp
import numpy as np

__all__ = ['FORMAT', 'OLD_FORMAT', 'write_tree', 'read_tree']

FORMAT = 'brainpy_accum.checkpoint.v2'
OLD_FORMAT = 'brainpy_accum.checkpoint.v1'
_FORMAT_LINE = (FORMAT + '\n').encode()
_MAX_HEADER_LINE = 100  # '<length> <64 hex digits>\n' is far shorter

Path = Tuple[str, ...]


# ------------------------------------------------------------------ writing

def write_tree(path: str, tree: dict, labels: Optional[Dict[Path, str]] = None) -> None:
  """Write ``tree`` (nested dicts with str keys; leaves: NumPy arrays, str, int, float, bool, None) to ``path``.

  ``labels``: a text per array path, used in the error if that array is found damaged (default: its path).
  Raises ``OSError`` naming ``path`` if the file cannot be written; the file at ``path`` is then unchanged.
  """
  skeleton, arrays = _split(tree)
  labels = labels or {}
  entries = [{'path': list(keys), 'label': labels.get(keys, '/'.join(keys)), 'dtype': array.dtype.name,
              'shape': list(array.shape), 'sha256': hashlib.sha256(_bytes_of(array)).hexdigest()}
             for keys, array in arrays]
  header = json.dumps({'tree': skeleton, 'arrays': entries}).encode()
  head = _FORMAT_LINE + f'{len(header)} {hashlib.sha256(header).hexdigest()}\n'.encode() + header
  _remove_stale_temporaries(path)
  temporary = f'{path}.tmp-{os.getpid()}'
  try:
    with open(temporary, 'wb') as file:
      file.write(head)
      for _, array in arrays:
        file.write(_bytes_of(array))
      file.flush()
      os.fsync(file.fileno())  # the content is on the disk before the name points at it
    os.replace(temporary, path)
  except OSError as error:
    raise _naming(error, path) from error
  finally:
    _remove(temporary)
  _sync_folder(path)


def _split(tree: dict, keys: Path = ()) -> Tuple[dict, List[Tuple[Path, np.ndarray]]]:
  """``tree`` without its arrays, and the arrays with their paths, in the tree's order."""
  skeleton, arrays = {}, []
  for key, value in tree.items():
    if not isinstance(key, str):
      raise TypeError(f'checkpoint tree keys must be str, got {key!r} at {"/".join(keys)}')
    if isinstance(value, dict):
      skeleton[key], inner = _split(value, keys + (key,))
      arrays.extend(inner)
    elif isinstance(value, (np.ndarray, np.generic)):
      arrays.append((keys + (key,), np.asarray(value, order='C')))  # ascontiguousarray makes 0-d 1-d
    elif value is None or isinstance(value, (str, int, float, bool)):
      skeleton[key] = value
    else:
      raise TypeError(f'checkpoint tree leaf {"/".join(keys + (key,))} is a {type(value).__name__}: '
                      f'only NumPy arrays, str, int, float, bool and None are stored')
  return skeleton, arrays


def _bytes_of(array: np.ndarray) -> memoryview:
  """The array's bytes without a copy (any dtype, bfloat16 and 0-d arrays included)."""
  return memoryview(array.reshape(-1).view(np.uint8))


def _naming(error: OSError, path: str) -> OSError:
  """``error`` as the same kind of ``OSError`` (``FileNotFoundError``, ...), its message naming ``path``."""
  message = (f'Could not write the checkpoint path={path!r}: {error.strerror or error}. The file at that path, '
             f'if any, is the previous checkpoint, unchanged.')
  return OSError(error.errno, message) if error.errno is not None else OSError(message)


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except OSError:
    pass  # already gone, or its folder is: nothing of it is left at the target either way


def _sync_folder(path: str) -> None:
  """Make the rename itself durable where the platform allows (POSIX; elsewhere opening a folder fails)."""
  try:
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(folder)
  except OSError:
    pass  # some file systems refuse fsync on a folder; the rename is then as durable as they make it
  finally:
    os.close(folder)


def _remove_stale_temporaries(path: str) -> None:
  """Remove ``path.tmp-<pid>`` files left by writers that were killed mid-write (their pid is gone)."""
  for temporary in glob.glob(glob.escape(path) + '.tmp-*'):
    pid = temporary.rsplit('-', 1)[-1]
    if pid.isdigit() and not _alive(int(pid)):
      _remove(temporary)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


# ------------------------------------------------------------------ reading

def read_tree(path: str) -> dict:
  """The tree that :func:`write_tree` wrote to ``path``, every checksum verified; raises before returning
  anything if a byte of the file differs from what was written. A file of the previous format (no checksums)
  is read with a warning."""
  if os.path.isdir(path):
    raise IsADirectoryError(f'path={path!r} is a folder, not a checkpoint file: pass the file that '
                            f'save_checkpoint wrote (e.g. {os.path.join(path, "run.ckpt")!r}). Nothing was loaded.')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No checkpoint at path={path!r}: save one with trainer.save_checkpoint(path).')
  with open(path, 'rb') as file:
    start = file.read(len(_FORMAT_LINE))
    if start == _FORMAT_LINE:
      return _read_current(path, file)
  if not start:
    raise ValueError(f'Checkpoint path={path!r} is empty (0 bytes). Nothing was loaded.')
  if len(start) < len(_FORMAT_LINE) and _FORMAT_LINE.startswith(start):
    raise ValueError(f'Checkpoint path={path!r} is truncated: it ends after {len(start)} bytes, inside its first '
                     f'line. Nothing was loaded.')
  if _near(start, _FORMAT_LINE):
    raise ValueError(f'Checkpoint path={path!r} is damaged: its first line reads {start!r}, written as '
                     f'{_FORMAT_LINE!r}. Nothing was loaded.')
  return _read_old(path)


def _near(start: bytes, expected: bytes) -> bool:
  """Whether ``start`` is ``expected`` with a few bytes changed (a damaged format line, not another file)."""
  return len(start) == len(expected) and sum(a != b for a, b in zip(start, expected)) <= 3


def _read_current(path: str, file) -> dict:
  size = os.fstat(file.fileno()).st_size
  line = file.readline(_MAX_HEADER_LINE)
  try:
    length_text, digest = line.decode('ascii').split(' ')
    if not (length_text.isdigit() and digest.endswith('\n')):
      raise ValueError(line)
    length, digest = int(length_text), digest[:-1]
  except ValueError:
    raise ValueError(f'Checkpoint path={path!r} is damaged: its second line {line!r} is not '
                     f"'<header length> <header SHA-256>'. Nothing was loaded.") from None
  start = file.tell()
  header = file.read(length)
  if len(header) < length:
    raise ValueError(f'Checkpoint path={path!r} is truncated (or the header length in its second line damaged): it '
                     f'ends after {size} bytes, inside its header (bytes {start}-{start + length - 1}). '
                     f'Nothing was loaded.')
  if hashlib.sha256(header).hexdigest() != digest:
    raise ValueError(f'Checkpoint path={path!r} is damaged: its header (bytes {start}-{start + length - 1}: the '
                     f'names, dtypes and shapes of its arrays, where the run stood) does not match the SHA-256 '
                     f'written with it. Nothing was loaded.')
  header = json.loads(header)  # verified: as written
  tree = header['tree']
  end = file.tell() + sum(_entry_bytes(entry) for entry in header['arrays'])
  damaged = []
  for entry, offset in _with_offsets(header['arrays'], file.tell()):
    array = np.empty(entry['shape'], jnp.dtype(entry['dtype']))
    where = f"{entry['label']} ({entry['dtype']}{entry['shape']}, bytes {offset}-{offset + array.nbytes - 1})"
    if file.readinto(_bytes_of(array)) < array.nbytes:
      raise ValueError(f'Checkpoint path={path!r} is truncated: it ends after {size} bytes, inside {where}; the '
                       f'whole file has {end} bytes. Nothing was loaded.')
    if hashlib.sha256(_bytes_of(array)).hexdigest() != entry['sha256']:
      damaged.append(where)
    _place(tree, entry['path'], array)
  if damaged:
    raise ValueError(f'Checkpoint path={path!r} is damaged: {"; ".join(damaged)} '
                     f'{"does" if len(damaged) == 1 else "do"} not match the SHA-256 written with '
                     f'{"it" if len(damaged) == 1 else "them"}. Nothing was loaded.')
  if size != end:
    raise ValueError(f'Checkpoint path={path!r} has {size - end} bytes after its end (byte {end}): it was '
                     f'extended or overwritten after it was written. Nothing was loaded.')
  return tree


def _entry_bytes(entry: dict) -> int:
  return int(np.prod(entry['shape'], dtype=np.int64)) * jnp.dtype(entry['dtype']).itemsize


def _with_offsets(entries: List[dict], offset: int) -> Iterator[Tuple[dict, int]]:
  for entry in entries:
    yield entry, offset
    offset += _entry_bytes(entry)


def _place(tree: dict, keys: List[str], array: np.ndarray) -> None:
  for key in keys[:-1]:
    tree = tree.setdefault(key, {})
  tree[keys[-1]] = array


def _read_old(path: str) -> dict:
  """A file of the previous format, BrainPy's msgpack without checksums: read as before, with a warning."""
  try:
    tree = bp.checkpoints.load_pytree(path)
  except Exception as error:
    raise ValueError(f'path={path!r} is not a readable checkpoint: it starts with neither {_FORMAT_LINE!r} nor '
                     f'an older {OLD_FORMAT} file ({type(error).__name__}: {error}). Nothing was loaded.') from error
  if not isinstance(tree, dict) or tree.get('format') != OLD_FORMAT:
    raise ValueError(f'path={path!r} is not a readable checkpoint: a msgpack file, but not one written by '
                     f'AccumBPTT.save_checkpoint. Nothing was loaded.')
  warnings.warn(f'Checkpoint path={path!r} has the older format {OLD_FORMAT}, without checksums: damage to it '
                f'cannot be detected. Saving the trainer again writes {FORMAT}, with checksums.',
                UserWarning, stacklevel=5)  # the caller of load_checkpoint
  return {key: value for key, value in tree.items() if key != 'format'}
