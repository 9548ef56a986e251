"""Resuming an interrupted ``fit``: a killed process, SIGTERM, Ctrl-C, and the checkpoint arguments.

The reference is the same run uninterrupted. Float32 results are compared with the suite's tolerance,
though a resumed run repeats the same compiled steps on the same values and is in practice bit-equal.
"""

import os
import signal
import subprocess
import sys
import time
import warnings

import brainpy as bp
import numpy as np
import pytest

import background
from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, params_of


WORKER = str(background.HERE / 'resume_worker.py')
KILL_AFTER = {'SIGKILL': 7, 'SIGTERM': 11}  # 'batch' lines read (of 15 over 3 epochs) before the signal


def _worker(checkpoint, out) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, WORKER, str(checkpoint), str(out)], env=background.env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _interrupt(process: subprocess.Popen, signum: int, after: int, fraction: float) -> str:
  """Send ``signum`` once ``after`` batch lines were printed and ``fraction`` of one batch's time more passed.

  The delay is measured in batches, not seconds, so the signal lands inside a step or a save however fast
  the machine (or a warm compilation cache) makes the run."""
  lines, times = [], []
  for line in process.stdout:
    lines.append(line)
    if line.startswith('batch'):
      times.append(time.monotonic())
    if len(times) == after:
      time.sleep(fraction * (times[-1] - times[-2]))
      process.send_signal(signum)
      break
  rest, _ = process.communicate(timeout=300)
  return ''.join(lines) + rest


def _finish(process: subprocess.Popen) -> str:
  output, _ = process.communicate(timeout=300)
  assert process.returncode == 0, output
  return output


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  out = tmp_path_factory.mktemp('reference') / 'reference.npz'
  _finish(_worker('-', out))
  return dict(np.load(out))


@pytest.mark.long  # the long suite (--long)
@pytest.mark.parametrize('signame', ['SIGKILL', 'SIGTERM'])
def test_killed_run_resumes_to_the_uninterrupted_result(signame, uninterrupted, tmp_path):
  checkpoint, out = tmp_path / 'run.ckpt', tmp_path / 'resumed.npz'
  signum = getattr(signal, signame)
  fraction = np.random.RandomState(KILL_AFTER[signame]).uniform(0., 1.)  # somewhere inside a step or a save
  output = _interrupt(_worker(checkpoint, out), signum, KILL_AFTER[signame], fraction)
  assert checkpoint.exists(), output
  assert not out.exists(), 'the worker was to be interrupted before it finished'
  assert not list(tmp_path.glob('run.ckpt.tmp-*')) or signame == 'SIGKILL', 'SIGTERM leaves no temporary file'
  if signame == 'SIGTERM':
    assert 'resuming' not in output and 'Traceback' not in output, output
  output = _finish(_worker(checkpoint, out))
  assert 'resuming from checkpoint' in output
  assert not list(tmp_path.glob('run.ckpt.tmp-*')), 'stale temporary files are removed by the next save'
  resumed = dict(np.load(out))
  assert resumed.keys() == uninterrupted.keys()
  assert_trees_close(resumed, uninterrupted)


def _trainer(**kwargs):
  return AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                   num_micro_batch=2, progress_bar=False, **kwargs)


BATCHES = make_batches((4, 4, 3, 4, 4, 2))


def _signalling(batches, at: int, signum=signal.SIGINT):
  """The batches, sending ``signum`` to this process while fetching batch ``at`` (fit reads it once batch
  ``at - 1`` is recorded, as bp.BPTT reads; a signal that comes then stops fit before batch ``at`` trains)."""
  def data():
    for i, batch in enumerate(batches):
      if i == at:
        os.kill(os.getpid(), signum)
      yield batch
  return data


@pytest.fixture
def ctrl_c_raises():
  """Python's own Ctrl-C handler (a process started in the background may ignore SIGINT)."""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, before)


def test_ctrl_c_finishes_the_batch_then_stops_with_a_checkpoint(tmp_path, ctrl_c_raises):
  checkpoint = tmp_path / 'run.ckpt'
  trainer = _trainer()
  with pytest.raises(KeyboardInterrupt):
    trainer.fit(_signalling(BATCHES, at=4), num_epoch=2, num_report=1, checkpoint=checkpoint)
  partial = _trainer()
  # batches 0-3: the signal came as batch 4 was read (after batch 3 was recorded, as bp.BPTT reads): not trained
  partial.fit(BATCHES[:4], num_epoch=1, num_report=1)
  assert_trees_close(params_of(trainer.target), params_of(partial.target))
  np.testing.assert_allclose(trainer.train_losses, partial.train_losses, rtol=1e-6)
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, 'the Ctrl-C handler is restored'
  assert checkpoint.exists()

  trainer.fit(BATCHES, num_epoch=2, num_report=1, checkpoint=checkpoint)  # the same call again: resumes
  whole = _trainer()
  whole.fit(BATCHES, num_epoch=2, num_report=1)
  assert_trees_close(params_of(trainer.target), params_of(whole.target))
  np.testing.assert_allclose(trainer.train_losses, whole.train_losses, rtol=1e-6)


@pytest.mark.parametrize('saved, resumed', [(1, 2), pytest.param(2, 1, marks=pytest.mark.long)])  # README time
def test_a_checkpoint_between_updates_resumes_with_another_accumulate_steps(saved, resumed, tmp_path):
  """Saved between updates, a run has nothing summed to carry over: a trainer with another accumulate_steps (a
  window of sums where the saved one had none, or the reverse) resumes it, and trains as bp.BPTT does on its
  windows from there. It was refused as another model or configuration."""
  path = tmp_path / 'run.ckpt'
  first = _trainer(accumulate_steps=saved)
  first.fit(BATCHES[:2], num_epoch=1)  # with accumulate_steps=2 one whole window: nothing left in it
  first.save_checkpoint(path)
  second = _trainer(accumulate_steps=resumed)
  second.load_checkpoint(path)
  second.fit(BATCHES[2:], num_epoch=1)
  reference = bp.BPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                      progress_bar=False)
  for batches, k in ((BATCHES[:2], saved), (BATCHES[2:], resumed)):
    reference.fit([tuple(np.concatenate(p) for p in zip(*batches[i:i + k])) for i in range(0, len(batches), k)],
                  num_epoch=1)
  assert_trees_close(params_of(second.target), params_of(reference.target))


def test_a_checkpoint_inside_a_window_is_not_resumed_without_one(tmp_path, ctrl_c_raises):
  """Saved between the batches of one update, the window's sums are part of the run: a trainer without a window
  would drop them, so it refuses the checkpoint, naming accumulate_steps, before anything changes."""
  checkpoint = tmp_path / 'run.ckpt'
  with pytest.raises(KeyboardInterrupt):  # batches 0-2 run (batch 4 read ahead as batch 3 came): the window holds 2
    _trainer(accumulate_steps=2).fit(_signalling(BATCHES, at=4), num_epoch=1, checkpoint=checkpoint)
  other = _trainer()
  before = params_of(other.target)
  with pytest.raises(ValueError, match='holds the sums of an accumulate_steps window not yet applied.*resume with '
                                       'the accumulate_steps it was saved with'):
    other.load_checkpoint(checkpoint)
  assert_trees_close(params_of(other.target), before, rtol=0, atol=0)


@pytest.mark.parametrize('saved, resumed, at, updates', [
  (2, 3, 4, ((0, 1), (2, 3, 4, 5))), pytest.param(3, 2, 5, ((0, 1, 2), (3, 4, 5)), marks=pytest.mark.long)])
def test_a_window_resumed_with_another_accumulate_steps_joins_the_new_window(saved, resumed, at, updates, tmp_path,
                                                                            ctrl_c_raises):
  """Stopped between the batches of one update and resumed with another accumulate_steps, the saved sums join
  the new trainer's window that holds the batch it resumes at (windows counted from the epoch's first batch, as
  the guide says): that update is bp.BPTT's on every batch since the last update."""
  checkpoint = tmp_path / 'run.ckpt'
  with pytest.raises(KeyboardInterrupt):  # batches 0 to at - 2 trained: the last (at - 2) left in the window
    _trainer(accumulate_steps=saved).fit(_signalling(BATCHES, at=at), num_epoch=1, checkpoint=checkpoint)
  resumed_trainer = _trainer(accumulate_steps=resumed)
  resumed_trainer.fit(BATCHES, num_epoch=1, checkpoint=checkpoint)
  reference = bp.BPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                      progress_bar=False)
  reference.fit([tuple(np.concatenate(p) for p in zip(*[BATCHES[i] for i in update])) for update in updates],
                num_epoch=1)
  assert_trees_close(params_of(resumed_trainer.target), params_of(reference.target))


def test_finished_run_is_continued_by_a_larger_num_epoch(tmp_path):
  checkpoint = tmp_path / 'run.ckpt'
  first = _trainer(accumulate_steps=2)
  first.fit(BATCHES, num_epoch=1, checkpoint=checkpoint)
  again = _trainer(accumulate_steps=2)
  again.fit(BATCHES, num_epoch=1, checkpoint=checkpoint)  # done already: nothing trains
  assert_trees_close(params_of(again.target), params_of(first.target))
  np.testing.assert_allclose(again.train_losses, first.train_losses)
  more = _trainer(accumulate_steps=2)
  more.fit(BATCHES, num_epoch=3, checkpoint=checkpoint)
  whole = _trainer(accumulate_steps=2)
  whole.fit(BATCHES, num_epoch=3)
  assert_trees_close(params_of(more.target), params_of(whole.target))
  np.testing.assert_allclose(more.train_losses, whole.train_losses, rtol=1e-6)


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(checkpoint=3), TypeError, 'checkpoint=3 must be a file path'),
    (dict(checkpoint_every=2), ValueError, "checkpoint_every=2 needs a checkpoint path"),
    (dict(checkpoint='x.ckpt', checkpoint_every=0), ValueError, 'checkpoint_every=0 must be a positive int'),
    (dict(checkpoint='x.ckpt', checkpoint_every=1.5), TypeError, 'checkpoint_every=1.5 must be a positive int'),
])
def test_checkpoint_arguments_are_checked_before_training(kwargs, error, message, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  trainer = _trainer()
  before = params_of(trainer.target)
  with pytest.raises(error, match=message):
    trainer.fit(BATCHES, num_epoch=1, **kwargs)
  assert_trees_close(params_of(trainer.target), before)
  assert not list(tmp_path.iterdir())


def test_checkpoint_of_another_model_is_refused_before_training(tmp_path):
  checkpoint = tmp_path / 'run.ckpt'
  _trainer().fit(BATCHES[:1], num_epoch=1, checkpoint=checkpoint)
  other = AccumBPTT(make_model('snn'), bp.losses.mean_squared_error, num_micro_batch=2, progress_bar=False)
  before = params_of(other.target)
  with pytest.raises(ValueError, match='Nothing was loaded'):
    other.fit(BATCHES, num_epoch=1, checkpoint=checkpoint)
  assert_trees_close(params_of(other.target), before)


def test_loaded_checkpoint_reuses_the_compiled_step(tmp_path):
  """Loaded values keep the placement, commitment and weak types of the trained ones: no new compilation."""
  trainer = _trainer()
  trainer.fit(BATCHES[:2], num_epoch=1)
  trainer.load_checkpoint(trainer.save_checkpoint(tmp_path / 'run.ckpt'))
  trainer.fit(BATCHES[:2], num_epoch=1)
  assert trainer.compilations['fit'] == 1


@pytest.mark.long  # the long suite (--long)
def test_ignored_ctrl_c_stays_ignored_and_a_handler_that_returns_ends_fit_early(tmp_path):
  """SIG_IGN: fit trains on as if nothing came. A user's handler that returns: fit stops at the batch
  boundary, writes the checkpoint, runs the handler and returns; the same call then resumes."""
  before = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    trainer = _trainer()
    trainer.fit(_signalling(BATCHES, at=2), num_epoch=1)
    whole = _trainer()
    whole.fit(BATCHES, num_epoch=1)
    assert_trees_close(params_of(trainer.target), params_of(whole.target))
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    calls = []
    signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    checkpoint = tmp_path / 'run.ckpt'
    stopped = _trainer()
    stopped.fit(_signalling(BATCHES, at=2), num_epoch=1, num_report=1, checkpoint=checkpoint)
    assert calls == [signal.SIGINT] and len(stopped.train_losses) == 2
    stopped.fit(BATCHES, num_epoch=1, num_report=1, checkpoint=checkpoint)
    assert_trees_close(params_of(stopped.target), params_of(whole.target))
  finally:
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize('saved_with_metrics', [True, False])
def test_resuming_with_other_metrics_warns(tmp_path, saved_with_metrics):
  """A run saved with metrics resumed by a loss without them (or the reverse) continues the parameters exactly,
  but the metric histories no longer line up with the loss's: said, naming loss_has_aux."""
  from helpers import mse_with_aux

  def trainer(metrics):
    return AccumBPTT(make_model('rnn'), mse_with_aux if metrics else bp.losses.mean_squared_error,
                     optimizer=bp.optim.Adam(lr=0.05), num_micro_batch=2, progress_bar=False, loss_has_aux=metrics)

  path, data = str(tmp_path / 'run.ckpt'), make_batches((4, 4))
  trainer(saved_with_metrics).fit(data, num_epoch=1, checkpoint=path)
  said = r"recorded the metrics \['abs_err', 'mean_out'\]" if saved_with_metrics else 'recorded no metrics'
  with pytest.warns(UserWarning, match=said + '.*loss_has_aux'):
    trainer(not saved_with_metrics).fit(data, num_epoch=2, checkpoint=path)
  same = str(tmp_path / 'same.ckpt')

  def stopping():  # saved after each update, stopped before the epoch's report: the metrics only in its window
    yield from data[:1]
    raise RuntimeError('stop')

  with pytest.raises(RuntimeError, match='stop'):
    trainer(saved_with_metrics).fit(stopping, num_epoch=1, checkpoint=same, checkpoint_every=1)
  with warnings.catch_warnings():
    warnings.simplefilter('error', UserWarning)  # the same loss again: nothing to say
    trainer(saved_with_metrics).fit(data, num_epoch=2, checkpoint=same)
