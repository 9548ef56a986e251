"""Damaged checkpoints are refused before anything is assigned; old files still load; a failed save keeps the last.

A byte changed anywhere in a checkpoint, a truncated or extended file, random bytes, another model's or
optimizer's checkpoint, a folder: each raises an error naming the file, and every Variable the trainer holds
(parameters, model state, optimizer state with its learning-rate step, the skipped-steps counter, the
``accumulate_steps`` window, BrainPy's random key) keeps its value, bit for bit. The trainer's values differ from
the file's in every Variable, so that any assignment would show. The trainer is built and trained once for the
module (its compiled steps are the same as those of ``test_resume.py``'s ``accumulate_steps=2`` trainer).
"""

import errno
import hashlib
import json
import os
import shutil
import warnings
from types import SimpleNamespace

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from brainpy_accum import AccumBPTT
from brainpy_accum.checkpoint import _file
from helpers import assert_trees_close, make_batches, make_model, optimizer_state, params_of

BATCHES = make_batches((4, 4, 3, 4, 4, 2))
DATA = os.path.join(os.path.dirname(__file__), 'data')
SETTINGS = settings(deadline=None, derandomize=True, print_blob=True, database=None)
QUICK = 40  # examples of each search in the README suite (about a second each); the long suite tries every offset


def _trainer(**kwargs):
  return AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                   num_micro_batch=2, progress_bar=False, accumulate_steps=2, **kwargs)


def _host(value) -> np.ndarray:
  value = bm.as_jax(value)
  return np.asarray(jax.random.key_data(value) if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key) else value)


def _variables(trainer) -> dict:
  """Every Variable a load could change, found by BrainPy's own traversal of the trainer (not the checkpoint
  module's grouping), with the ``accumulate_steps`` window's sums and BrainPy's global random state."""
  variables = dict(trainer.vars().unique())
  variables.update({f'window/{name}': var for name, var in trainer._window.variables().items()})
  variables['random'] = bm.random.DEFAULT
  return variables


def _values(trainer) -> dict:
  return {name: _host(var.value) for name, var in _variables(trainer).items()}


def _in_order(values: dict) -> list:
  """The values in BrainPy's traversal order: comparable between trainers, whose auto-generated names differ."""
  return list(values.values())


def _assert_unchanged(trainer, before: dict) -> None:
  after = _values(trainer)
  assert after.keys() == before.keys()
  changed = [name for name in before if not np.array_equal(after[name], before[name])]
  assert not changed, f'a refused load changed {changed}'


MOVED_SEED = 12345  # BrainPy's random state is global: every test that builds a model reseeds it


def _move_on(trainer) -> None:
  """Give every Variable another value than the checkpoint's."""
  for name, var in _variables(trainer).items():
    if name == 'random':
      bm.random.seed(MOVED_SEED)
    else:
      var.value = var.value + jnp.ones_like(var.value)


class Saved(SimpleNamespace):
  def __repr__(self):  # hypothesis prints its examples' arguments
    return f'Saved({len(self.content)} bytes)'


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A trainer mid-run, the bytes of the checkpoint ``fit`` wrote of it, and the trainer moved on from there."""
  folder = tmp_path_factory.mktemp('damage')
  trainer = _trainer()
  trainer.fit(BATCHES[:3], num_epoch=1, num_report=1, checkpoint=folder / 'run.ckpt')  # with progress, history
  content = (folder / 'run.ckpt').read_bytes()
  at_save = _values(trainer)
  _move_on(trainer)
  moved = _values(trainer)
  assert all(not np.array_equal(moved[name], at_save[name]) for name in moved), 'every Variable moved on'
  return Saved(trainer=trainer, content=content, folder=folder, at_save=at_save, moved=moved)


def _assert_refused(saved, content: bytes) -> str:
  """Loading ``content`` raises an error naming the file and changes nothing; returns the message."""
  path = saved.folder / 'damaged.ckpt'
  path.write_bytes(content)
  bm.random.seed(MOVED_SEED)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    with pytest.raises(ValueError) as error:
      saved.trainer.load_checkpoint(path)
  message = str(error.value)
  assert repr(str(path)) in message and message.endswith('Nothing was loaded.'), message
  assert not caught, [str(w.message) for w in caught]  # never read as an old file without checksums
  _assert_unchanged(saved.trainer, saved.moved)
  return message


def _flipped(content: bytes, offset: int, mask: int) -> bytes:
  damaged = bytearray(content)
  damaged[offset] ^= mask
  return bytes(damaged)


def test_intact_checkpoint_loads_to_the_saved_values(saved, tmp_path):
  """The reference for the searches below: the same bytes, undamaged, load (and change every Variable)."""
  path = tmp_path / 'intact.ckpt'
  path.write_bytes(saved.content)
  trainer = _trainer()
  trainer.load_checkpoint(path)
  assert_trees_close(_in_order(_values(trainer)), _in_order(saved.at_save), rtol=0, atol=0)


@settings(SETTINGS, max_examples=QUICK)
@given(data=st.data())
def test_a_byte_changed_anywhere_is_refused_and_changes_nothing(saved, data):
  offset = data.draw(st.integers(0, len(saved.content) - 1), label='offset')
  mask = data.draw(st.integers(1, 255), label='xor')
  _assert_refused(saved, _flipped(saved.content, offset, mask))


@settings(SETTINGS, max_examples=QUICK)
@given(data=st.data())
def test_a_truncated_or_extended_file_is_refused_and_changes_nothing(saved, data):
  if data.draw(st.booleans(), label='extended'):
    content = saved.content + data.draw(st.binary(min_size=1, max_size=64), label='tail')
  else:
    content = saved.content[:data.draw(st.integers(0, len(saved.content) - 1), label='length')]
  _assert_refused(saved, content)


@settings(SETTINGS, max_examples=QUICK)
@given(data=st.data())
def test_random_bytes_and_overwritten_ranges_are_refused(saved, data):
  if data.draw(st.booleans(), label='all random'):
    content = data.draw(st.binary(max_size=2 * len(saved.content)), label='content')
  else:  # a block of the file overwritten, as a bad sector or a partial copy does
    start = data.draw(st.integers(0, len(saved.content) - 1), label='start')
    block = data.draw(st.binary(min_size=1, max_size=512), label='block')
    content = saved.content[:start] + block + saved.content[start + len(block):]
    if content == saved.content:
      return
  _assert_refused(saved, content)


@pytest.mark.extended  # CI leaves it out for its time budget (python -m pytest -q --long -m extended)
@pytest.mark.long  # the long suite (--long): about 2 x 8,000 loads
def test_every_offset_flipped_and_every_truncation_is_refused(saved):
  masks = np.random.RandomState(0).randint(1, 256, size=len(saved.content))
  for offset, mask in enumerate(masks):
    _assert_refused(saved, _flipped(saved.content, offset, int(mask)))
  for length in range(len(saved.content)):
    _assert_refused(saved, saved.content[:length])


def _layout(content: bytes):
  """Where each array's bytes lie, read from the file's documented layout (format line, header line, header)."""
  first = content.index(b'\n') + 1
  second = content.index(b'\n', first) + 1
  length = int(content[first:second].split()[0])
  header = json.loads(content[second:second + length])
  offset = second + length
  for entry in header['arrays']:
    size = int(np.prod(entry['shape'])) * jnp.dtype(entry['dtype']).itemsize
    yield entry, offset, size
    offset += size


def test_the_error_names_the_damaged_part(saved):
  """Each array has its own checksum: a byte flipped in a parameter names that parameter; the header has one."""
  arrays = list(_layout(saved.content))
  for entry, offset, size in arrays:
    if entry['path'][:2] == ['values', 'params']:
      message = _assert_refused(saved, _flipped(saved.content, offset + size // 2, 0x10))
      name = saved.trainer.target.train_vars().unique().keys()
      assert f"is damaged: {entry['label']} (float32" in message, message
      assert entry['label'].split()[-1] in name
      break
  header_end = arrays[0][1]
  message = _assert_refused(saved, _flipped(saved.content, header_end - 3, 0x01))
  assert 'is damaged: its header' in message
  entry, offset, size = [array for array in arrays if array[2] > 1][-1]
  message = _assert_refused(saved, saved.content[:offset + 1])
  assert f"is truncated: it ends after {offset + 1} bytes, inside {entry['label']}" in message
  assert 'is empty (0 bytes)' in _assert_refused(saved, b'')


def test_foreign_checkpoints_and_a_folder_are_refused(saved, tmp_path):
  """Another model (other shapes), another optimizer (other state): refused before anything is assigned, as is
  a folder. (A checkpoint without an accumulate_steps window loads, its window emptied: ``test_resume.py``.)"""
  with bm.training_environment(), jax.disable_jit():  # built without compiling its initialisers
    other_model = bp.Sequential(bp.dyn.RNNCell(3, 5), bp.dnn.Dense(5, 2))
  foreign = {
      'model': AccumBPTT(other_model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                         num_micro_batch=2, accumulate_steps=2, progress_bar=False),
      'optimizer': AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.SGD(lr=0.05),
                             num_micro_batch=2, accumulate_steps=2, progress_bar=False),
  }
  for what, trainer in foreign.items():
    content = open(trainer.save_checkpoint(tmp_path / f'{what}.ckpt'), 'rb').read()
    message = _assert_refused(saved, content)
    assert 'does not fit' in message or 'variables, this trainer has' in message, (what, message)
  with pytest.raises(IsADirectoryError, match='is a folder, not a checkpoint file.*Nothing was loaded'):
    saved.trainer.load_checkpoint(tmp_path)
  bm.random.seed(MOVED_SEED)
  _assert_unchanged(saved.trainer, saved.moved)


def test_old_format_file_loads_to_its_values_with_a_note(tmp_path):
  """``data/v1_run.ckpt`` was written by the previous format's code (commit 402804c,
  ``brainpy_accum.checkpoint.v1``): ``_trainer()`` fitted on ``BATCHES[:3]`` for one epoch with
  ``num_report=1`` and ``checkpoint=``; ``data/v1_run.npz`` holds that trainer's parameters, optimizer state,
  losses and random key as it saved them (``params_of``, ``optimizer_state``)."""
  expected = np.load(os.path.join(DATA, 'v1_run.npz'))
  stored = [expected[f'arr_{i}'] for i in range(len(expected.files) - 2)]
  path = tmp_path / 'run.ckpt'
  shutil.copy(os.path.join(DATA, 'v1_run.ckpt'), path)
  trainer = _trainer()
  with pytest.warns(UserWarning, match='older format brainpy_accum.checkpoint.v1, without checksums') as caught:
    trainer.load_checkpoint(path)
  assert len(caught) == 1 and '\n' not in str(caught[0].message)
  assert_trees_close(params_of(trainer.target) + optimizer_state(trainer), stored, rtol=0, atol=0)
  np.testing.assert_array_equal(_host(bm.random.DEFAULT.value), expected['random_key'])

  resumed = _trainer()
  with pytest.warns(UserWarning, match='without checksums'):
    resumed.fit(BATCHES[:3], num_epoch=1, num_report=1, checkpoint=path)  # the run it holds is done: no training
  np.testing.assert_array_equal(resumed.train_losses, expected['train_losses'])
  assert_trees_close(params_of(resumed.target) + optimizer_state(resumed), stored, rtol=0, atol=0)
  resumed.save_checkpoint(path)
  assert path.read_bytes().startswith(b'brainpy_accum.checkpoint.v2\n')


class _DiskFull:
  """A file that takes ``room`` bytes, then fails as a full disk does."""

  def __init__(self, file, room: int):
    self.file, self.room = file, room

  def write(self, data) -> int:
    data = memoryview(data).cast('B')
    taken = self.file.write(data[:self.room])
    self.room -= taken
    if taken < len(data):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return taken

  def __getattr__(self, name):
    return getattr(self.file, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.file.close()


def _full_disk(monkeypatch, room: int = 1000, failing=lambda call: True):
  """Make ``_file``'s writes fail with ENOSPC after ``room`` bytes, for the calls where ``failing(call)``."""
  calls = []

  def opened(name, mode='r', *args, **kwargs):
    file = open(name, mode, *args, **kwargs)
    if 'w' not in mode:
      return file
    calls.append(name)
    return _DiskFull(file, room) if failing(len(calls)) else file
  monkeypatch.setattr(_file, 'open', opened, raising=False)
  return calls


@pytest.mark.parametrize('failure', ['disk full mid-write', 'rename fails', 'folder disappeared'])
def test_failed_save_raises_naming_the_path_and_keeps_the_previous_checkpoint(failure, saved, tmp_path, monkeypatch):
  folder = tmp_path / 'run'
  folder.mkdir()
  path = folder / 'run.ckpt'
  path.write_bytes(saved.content)  # the previous checkpoint
  if failure == 'disk full mid-write':
    whole = len(open(saved.trainer.save_checkpoint(tmp_path / 'whole.ckpt'), 'rb').read())
    _full_disk(monkeypatch, room=whole - 50)  # among the last arrays' bytes
  elif failure == 'rename fails':
    def rename(source, target):
      raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(_file.os, 'replace', rename)
  else:
    shutil.rmtree(folder)
  with pytest.raises(OSError, match=f'Could not write the checkpoint path={str(path)!r}.*previous checkpoint'):
    saved.trainer.save_checkpoint(path)
  monkeypatch.undo()
  if failure == 'folder disappeared':
    assert not folder.exists()
    return
  assert os.listdir(folder) == ['run.ckpt'], 'no temporary file is left'
  assert path.read_bytes() == saved.content
  loaded = _trainer()
  loaded.load_checkpoint(path)
  assert_trees_close(_in_order(_values(loaded)), _in_order(saved.at_save), rtol=0, atol=0)


def test_fit_warns_when_a_checkpoint_cannot_be_written_and_trains_on(tmp_path, monkeypatch):
  """A checkpoint every update, two epochs. The 2nd cannot be written (a full disk), nor the 3rd and 4th (the
  folder is gone from the last batch of epoch 0 to the first of epoch 1): each warns, the run goes on to the
  result of a run without checkpoints, and the next checkpoint that can be written is the run's last state."""
  path = tmp_path / 'run' / 'run.ckpt'
  path.parent.mkdir()
  _full_disk(monkeypatch, failing=lambda call: call == 2)

  def folder_gone(idx, metrics, phase):  # runs after each batch's report, before its checkpoint
    if idx == 6:
      shutil.rmtree(path.parent)
    elif idx == 7:
      path.parent.mkdir()

  trainer = _trainer()
  with pytest.warns(UserWarning, match='Could not write the checkpoint') as caught:
    trainer.fit(BATCHES, num_epoch=2, num_report=1, checkpoint=path, checkpoint_every=1, fun_after_report=folder_gone)
  failures = [str(w.message) for w in caught if 'Could not write the checkpoint' in str(w.message)]
  assert len(failures) == 3, failures
  assert 'No space left on device' in failures[0]
  assert all('No such file or directory' in message for message in failures[1:])
  assert all(repr(str(path)) in message and 'fit does not stop' in message for message in failures)
  straight = _trainer()
  straight.fit(BATCHES, num_epoch=2, num_report=1)
  assert_trees_close(params_of(trainer.target), params_of(straight.target), rtol=0, atol=0)
  np.testing.assert_array_equal(trainer.train_losses, straight.train_losses)
  assert os.listdir(path.parent) == ['run.ckpt']
  loaded = _trainer()
  loaded.load_checkpoint(path)
  assert_trees_close(_in_order(_values(loaded)), _in_order(_values(trainer)), rtol=0, atol=0)


def test_fit_stops_on_an_unwritten_checkpoint_when_its_warning_is_an_error(saved, tmp_path, monkeypatch):
  """The documented way to stop instead: the warning as an error. The previous checkpoint stays, and the same
  call run again resumes from it."""
  path = tmp_path / 'run.ckpt'
  trainer = _trainer()
  _full_disk(monkeypatch, failing=lambda call: call == 2)
  with warnings.catch_warnings():
    warnings.filterwarnings('error', 'Could not write the checkpoint')
    with pytest.raises(UserWarning, match=f'Could not write the checkpoint path={str(path)!r}'):
      trainer.fit(BATCHES, num_epoch=1, num_report=1, checkpoint=path, checkpoint_every=1)
  # updates (and checkpoints) after batches 1, 3, 5: stopped after batch 3, whose checkpoint failed
  assert len(trainer.train_losses) == 4
  monkeypatch.undo()
  trainer.fit(BATCHES, num_epoch=1, num_report=1, checkpoint=path, checkpoint_every=1)  # resumes after batch 1
  straight = _trainer()
  straight.fit(BATCHES, num_epoch=1, num_report=1)
  assert_trees_close(params_of(trainer.target), params_of(straight.target), rtol=0, atol=0)
  np.testing.assert_array_equal(trainer.train_losses, straight.train_losses)


def test_checksums_are_of_the_bytes_written(saved):
  """The header's checksums are SHA-256 of the file's own bytes (an independent reading of the layout)."""
  first = saved.content.index(b'\n') + 1
  second = saved.content.index(b'\n', first) + 1
  length, digest = saved.content[first:second].split()
  assert hashlib.sha256(saved.content[second:second + int(length)]).hexdigest() == digest.decode()
  for entry, offset, size in _layout(saved.content):
    assert hashlib.sha256(saved.content[offset:offset + size]).hexdigest() == entry['sha256'], entry['label']


def test_fit_refuses_a_damaged_checkpoint_before_training(saved):
  path = saved.folder / 'damaged_run.ckpt'
  path.write_bytes(_flipped(saved.content, len(saved.content) // 2, 0x40))
  bm.random.seed(MOVED_SEED)
  with pytest.raises(ValueError, match=f'Checkpoint path={str(path)!r} is damaged.*Nothing was loaded'):
    saved.trainer.fit(BATCHES, num_epoch=1, checkpoint=path)
  _assert_unchanged(saved.trainer, saved.moved)
  assert path.read_bytes() == _flipped(saved.content, len(saved.content) // 2, 0x40), 'fit wrote nothing'
