"""Each batch sent to the device while the step before it runs (:mod:`brainpy_accum.trainer._feed`).

The reference is the loop without the overlap (``overlapping(False)``: every batch handed to its step from the
host, as before) and ``bp.BPTT``: with the overlap every result is the same, bit for bit, and the data source is
read no further ahead than before. ``fit`` sends batches ahead by default on an accelerator only: these tests,
on a CPU, turn it on.
"""

import functools
import re
import weakref

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.core._states import values_restored
from brainpy_accum.memory._stream import chunk_sizes
from brainpy_accum.trainer import _feed, _fit_loop
from brainpy_accum.trainer._feed import Feed, Sender, on_device, overlapping, prefetch_bytes, sends_ahead
from helpers import (assert_trees_close, make_batches, make_model, mse_with_aux, optimizer_state, params_of,
                     streaming_budget)

EXACT = dict(rtol=0, atol=0)
FIT = bp.tools.DotDict(fit=True)


@pytest.fixture(autouse=True)
def sending_ahead():
  """The overlap on, also on this CPU (where fit leaves it off by default); ``overlapping(False)`` inside a
  test turns it off for the comparison."""
  with overlapping(True):
    yield


def test_batches_go_ahead_by_default_on_an_accelerator_only(monkeypatch):
  with overlapping(None):
    assert jax.default_backend() != 'cpu' or not sends_ahead()
    monkeypatch.setattr(_feed.jax, 'default_backend', lambda: 'tpu')
    assert sends_ahead()


@pytest.fixture
def sent(monkeypatch):
  """Every batch (or chunk) that fit sends ahead, as the source gave it."""
  batches = []

  def counting(data):
    copy = on_device(data)
    if copy is not None:
      batches.append(data)
    return copy

  monkeypatch.setattr(_feed, 'on_device', counting)
  return batches


def _fit(overlap: bool, data, test_data=None, num_epoch=2, num_report=-1, loss='mean_squared_error', **options):
  """Train with or without the overlap; everything fit leaves behind, the report lines without their times."""
  calls = []
  trainer = AccumBPTT(make_model('rnn'), loss, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, **options)
  with overlapping(overlap):
    trainer.fit(data, test_data=test_data, num_epoch=num_epoch, num_report=num_report,
                fun_after_report=lambda idx, metrics, phase: calls.append((idx, phase, metrics)))
  history = [trainer._report_train_metrics, trainer._detailed_train_metrics, trainer._report_test_metrics,
             trainer._detailed_test_metrics]
  return {'params': params_of(trainer.target), 'optimizer': optimizer_state(trainer), 'history': history,
          'reports': calls, 'state': [np.asarray(v) for v in trainer.target.vars().unique().values()],
          'counters': (dict(trainer.compilations), dict(trainer.trace_counts), int(trainer.skipped_steps.value))}


def _same(with_overlap: dict, without: dict) -> None:
  assert with_overlap['counters'] == without['counters']  # no step compiled or traced again for a device batch
  assert [r[:2] for r in with_overlap['reports']] == [r[:2] for r in without['reports']]
  with_overlap['reports'], without['reports'] = [r[2] for r in with_overlap['reports']], [r[2] for r in without['reports']]
  for key in ('params', 'optimizer', 'history', 'reports', 'state'):
    assert_trees_close(with_overlap[key], without[key], **EXACT)


@pytest.mark.parametrize('options', [
  dict(num_micro_batch=2, loss=mse_with_aux, loss_has_aux=True, num_report=2),
  pytest.param(dict(num_micro_batch=2, accumulate_steps=2, skip_nonfinite=True, clip_grad_norm=0.1, num_report=3),
               marks=pytest.mark.long),  # the same feed as any batch's: the long suite (--long)
], ids=['metrics-reports', 'accumulate_steps'])
def test_overlap_trains_bit_for_bit_as_without(sent, options):
  """A batch like the one before goes ahead (not the first of a pass, nor one unlike the one before: the float64
  batch after a float32 one, the shorter last one); float64 data reaches the step as the float32 copy that the
  step would have made of it."""
  batches = make_batches((8, 8, 8, 8, 5), seed=3)
  batches[2:4] = [tuple(a.astype(np.float64) for a in batch) for batch in batches[2:4]]
  tests = make_batches((6, 6, 6), seed=4)
  without = _fit(False, batches, tests, **options)
  assert not sent
  with_overlap = _fit(True, batches, tests, **options)
  assert len(sent) == 2 * (2 + 2)  # per epoch: the 2nd and 4th training batches, the 2nd and 3rd test batches
  assert [x.dtype for x, _ in sent[:2]] == [np.float32, np.float64]
  _same(with_overlap, without)


def test_checkpoints_and_resume_with_batches_sent_ahead(sent, tmp_path):
  """A run stopped after its third batch (the checkpoint of its second update kept) and resumed by a fresh
  trainer ends as the same run without the overlap, bit for bit (history too)."""
  batches = make_batches((8,) * 6, seed=16)

  def trainer():
    return AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), num_micro_batch=2,
                     progress_bar=False)

  def resumed(overlap, folder):
    folder.mkdir()
    path, stopped = str(folder / 'run.ckpt'), []

    def stop_once(idx, metrics, phase):
      if idx == 3 and not stopped:
        stopped.append(idx)
        raise RuntimeError('stopped')

    with overlapping(overlap):
      with pytest.raises(RuntimeError, match='stopped'):
        trainer().fit(batches, num_epoch=2, num_report=1, checkpoint=path, checkpoint_every=2,
                      fun_after_report=stop_once)
      second = trainer()
      second.fit(batches, num_epoch=2, num_report=1, checkpoint=path, checkpoint_every=2)
    return [params_of(second.target), optimizer_state(second), second._detailed_train_metrics,
            second._report_train_metrics]

  without = resumed(False, tmp_path / 'without')
  assert not sent
  with_overlap = resumed(True, tmp_path / 'with')
  # the 2nd and 3rd batches before the stop (at the 3rd's report: the 4th is not read), on resuming (at the 3rd)
  # the 4th to 6th, epoch 2
  assert len(sent) == 2 + 3 + 5
  assert_trees_close(with_overlap, without, **EXACT)  # (resuming as training straight through: test_resume.py)


@pytest.mark.long  # the long suite (--long): README suite time
def test_overlap_with_planned_steps_equals_bptt(sent):
  """``num_micro_batch='auto'`` with data sent ahead: a batch whose step does not fit in one micro-batch is
  streamed in pieces of one micro-batch each, each sent while the one before computes (never the whole batch
  beside the step), and trains to bp.BPTT's update. The budget lies between the steps of 2 and 4 micro-batches
  with the batch sent ahead beside them (XLA's measure on this device): the pieces and the one sent ahead fit it."""
  batches = make_batches((16,) * 4, seed=5)
  probe = AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch='auto', memory_budget='1GiB')
  probe.target.reset(16)
  steps = [probe.compiled_step_bytes(plan_micro_batches(16, num_micro_batch=n), FIT, *batches[0]) for n in (2, 4)]
  budget = sum(steps) // 2 + prefetch_bytes(*batches[0])
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05),
                      progress_bar=False, num_micro_batch='auto', memory_budget=budget)
  trainer.fit(batches, num_epoch=2)
  piece = trainer.stream_chunks[16]
  plan, used = trainer.memory_plans[piece]
  assert plan.num_micro_batches == 1 and piece < 16 and used <= budget
  pieces = 2 * 4 * (16 // piece)  # every piece of every batch goes ahead but each pass's first
  assert len(sent) == pieces - 2 and trainer.compilations['fit'] == 1
  assert all(len(x) == piece for x, _ in sent)
  expected = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  expected.fit(batches, num_epoch=2)
  assert_trees_close(params_of(trainer.target), params_of(expected.target))
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5)


def test_whole_batches_sent_ahead_train_bit_for_bit_as_bptt(sent):
  """Without micro-batch options the step is bp.BPTT's computation: the same numbers, with batches sent ahead."""
  batches = make_batches((8,) * 4, seed=6)
  expected = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  expected.fit(batches, num_epoch=2)
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  trainer.fit(batches, num_epoch=2)
  assert len(sent) == 2 * 3
  assert_trees_close(params_of(trainer.target), params_of(expected.target), **EXACT)
  assert_trees_close(trainer.train_losses, expected.train_losses, **EXACT)


def test_a_failing_batch_fails_with_the_same_error_before_anything_changes():
  """A batch unlike the one before (here: its targets hold other samples) is not sent ahead: its check raises
  at its turn, with the error it raised before, and the trainer stands where it stood after the batch before."""
  batches = make_batches((8, 8, 8), seed=7)
  bad = (make_batches((8,), seed=8)[0][0], make_batches((6,), seed=8)[0][1])
  results, errors = [], []
  for overlap in (False, True):
    trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05),
                        num_micro_batch=2, progress_bar=False)
    with overlapping(overlap), pytest.raises(ValueError) as error:
      trainer.fit(batches + [bad] + batches, num_epoch=1)
    errors.append(str(error.value))
    results.append([params_of(trainer.target), optimizer_state(trainer), trainer._detailed_train_metrics])
  assert errors[0] == errors[1] and 'targets has shape (6, 5, 2)' in errors[0]
  assert_trees_close(results[1], results[0], **EXACT)
  expected = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  expected.fit(batches, num_epoch=1)
  assert_trees_close(results[1][0], params_of(expected.target))


def test_a_batch_that_cannot_be_sent_waits_for_its_step(monkeypatch):
  """A copy that fails (here: out of device memory) leaves the batch on the host, to its step as before."""
  def exhausted(*args, **kwargs):
    raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.')

  batches = make_batches((8,) * 3, seed=9)
  without = _fit(False, batches, num_micro_batch=2)
  monkeypatch.setattr(_feed, '_put', exhausted)  # the feed's copies only (a trainer puts its own arrays there)
  _same(_fit(True, batches, num_micro_batch=2), without)


def test_data_already_on_the_device_is_not_copied(sent, monkeypatch):
  """Device arrays reach the step as they are: the same objects, nothing sent."""
  batches = [tuple(jnp.asarray(a) for a in batch) for batch in make_batches((8,) * 3, seed=10)]
  stepped = []
  real = _fit_loop._call_step
  monkeypatch.setattr(_fit_loop, '_call_step', lambda step, shared, x, y: stepped.append((x, y)) or real(step, shared, x, y))
  _fit(True, batches, num_epoch=1, num_micro_batch=2)
  assert not sent and all(x is bx and y is by for (x, y), (bx, by) in zip(stepped, batches))


def test_a_generator_is_read_as_bptt_reads_it(sent):
  """At batch k's report the source has given batches up to k and no more, as bp.BPTT reads it (the next batch is
  read once the loop asks for it, then sent ahead while the step before runs: it used to be read at the step's
  dispatch, before the report); the batches sent ahead are those the source gave."""
  read = []

  def source():
    for i, batch in enumerate(make_batches((8,) * 5, seed=11)):
      read.append(i)
      yield batch

  seen = []
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, progress_bar=False)
  trainer.fit(source, num_epoch=1, num_report=1, fun_after_report=lambda idx, m, phase: seen.append((idx, len(read))))
  assert seen == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
  assert len(sent) == 4


def test_at_most_one_batch_is_on_its_way_beside_the_running_step(monkeypatch):
  """When a batch is sent, the step before the running one is done (its batch freed on the device) and no
  earlier copy is still held: the device holds the running step's batch and the one sent, no more."""
  held, steps, done = [], [], []
  real_send, real_call = _feed.on_device, _fit_loop._call_step

  def send(data):
    done.append(all(leaf.is_ready() for out in steps[:-1] for leaf in jax.tree_util.tree_leaves(out)))
    alive = [ref for ref in held if ref() is not None]
    copy = real_send(data)
    held[:] = alive + [weakref.ref(copy[0])]
    done[-1] = done[-1] and len(alive) <= 1  # the batch in hand (its step running), none before it
    return copy

  def call(step, shared, x, y):
    result = real_call(step, shared, x, y)
    steps.append(result[0])
    return result

  monkeypatch.setattr(_feed, 'on_device', send)
  monkeypatch.setattr(_fit_loop, '_call_step', call)
  _fit(True, make_batches((8,) * 6, seed=12), num_epoch=1, num_micro_batch=2)
  assert done == [True] * 5


def test_pieces_of_a_streamed_batch_leave_the_device_once_their_steps_are_done(monkeypatch):
  """A batch streamed in pieces: when a piece is sent, no copy sent before it is still held but the running step's
  (the feed used to keep every piece's copy until the batch's end, so that on a TPU v5e the 13th piece of a batch
  of 16 found no room and was copied with its step, 2026-12-07), also across a batch's end."""
  held, alive_at_send = [], []

  def send(data):
    alive_at_send.append(sum(ref() is not None for ref in held))
    copy = on_device(data)
    held.append(weakref.ref(copy[0]))
    return copy

  monkeypatch.setattr(_feed, 'on_device', send)
  batches = [(np.full((8, 3), b, np.float32), np.zeros(8, np.float32)) for b in range(3)]
  pieces = lambda x, y: [(i, 2, lambda i=i: (x[i:i + 2], y[i:i + 2])) for i in range(0, 8, 2)]
  feed, sums = Feed(batches, Sender(), units=pieces), []
  for fed in feed:
    for i, (_, _, piece) in enumerate(pieces(*fed.batch)):
      x, _ = fed.sent.pop(i, None) or piece()
      sums.append(jnp.sum(x))  # the piece's step, dispatched
      feed.dispatched(sums[-1], i, 4)
  assert len(alive_at_send) == 11 and max(alive_at_send) == 1  # the running piece's copy, none before it
  assert [float(s) for s in sums] == [6. * b for b in range(3) for _ in range(4)]


@pytest.mark.parametrize('pieces', [None, 4])
def test_data_copied_at_its_step_arrives_before_the_next_unit_is_sent(monkeypatch, pieces):
  """A unit that nothing sent ahead (each pass's first) is copied when its step is called and has arrived before
  the next unit is sent, so that the two copies do not share the link; every unit is copied once."""
  events = []

  class Copy(tuple):
    def block_until_ready(self):
      events.append(('arrived', int(self[0][0, 0])))
      return self

  def copy(data):  # (device data, a Copy, is not copied again)
    if isinstance(data, Copy):
      return None
    events.append(('copied', int(data[0][0, 0])))
    return Copy(data)

  monkeypatch.setattr(_feed, 'on_device', copy)
  monkeypatch.setattr(_feed, '_copy_at_step', copy)
  # the rows of piece i of batch b start with 10 b + i
  batches = [(np.repeat(np.arange(4.), 2)[:, None] + np.zeros((8, 3)) + 10 * b, np.zeros(8)) for b in range(2)]
  units = _whole if pieces is None else (lambda x, y: [(i, 2, lambda i=i: (x[i:i + 2], y[i:i + 2]))
                                                       for i in range(0, 8, 2)])
  feed = Feed(batches, Sender(), units=units)
  for fed in feed:
    for i in ([None] if pieces is None else range(pieces)):
      host = fed.batch if i is None else units(*fed.batch)[i][2]()
      assert isinstance(feed.for_step(fed.sent.pop(i, None) or host, i), Copy)
      feed.dispatched(jnp.zeros(()), i, pieces or 1)
  copied = [unit for kind, unit in events if kind == 'copied']
  assert copied == ([0, 1, 2, 3, 10, 11, 12, 13] if pieces else [0, 10])
  events = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]  # (waiting twice is no second copy)
  assert events[:3] == [('copied', 0), ('arrived', 0), ('copied', copied[1])]


@pytest.mark.parametrize('backend', ['cpu', 'tpu'])
def test_sending_waits_for_the_step_before_the_running_one_only(monkeypatch, backend):
  """``Sender.send`` after step k's dispatch waits for step k - 1 (its data then leaves the device), never for
  step k: the device always has the step k queued while the next data is copied. A Sender that sends nothing
  sends nothing on any device; off the CPU (here: a TPU, as the Sender sees it) it still waits for the step
  before the one dispatched (each step holds its data on the device), on the CPU for none."""
  monkeypatch.setattr(_feed.jax, 'default_backend', lambda: backend)

  class Step:
    def __init__(self, name):
      self.name = name

    def block_until_ready(self):
      waited.append(self.name)
      return self

  waited, ahead = [], Sender()
  for k in range(4):
    ahead.dispatched(Step(k))
    ahead.send((np.ones((2, 1)), np.ones(2)))
  assert waited == [0, 1, 2]
  with overlapping(False):
    quiet = Sender()
  quiet.dispatched(Step('a')), quiet.dispatched(Step('b'))
  assert quiet.send((np.ones((2, 1)), np.ones(2))) is None
  assert waited == ([0, 1, 2] if backend == 'cpu' else [0, 1, 2, 'a'])


def test_the_loop_waits_for_no_step_between_reports(monkeypatch):
  """Between reports the loop never waits for the step it has just dispatched: whatever it waits for (the step
  before, so that one batch at most goes ahead; a copy the source may overwrite) is never the newest step's
  outputs. (Whether a step is still running when the next is dispatched depends on the device's speed: on a TPU
  a small step is done before the host dispatches the next, so the waits themselves are checked.)"""
  newest, waits = [], []
  real_call, real_wait = _fit_loop._call_step, jax.block_until_ready

  def call(step, shared, x, y):
    result = real_call(step, shared, x, y)
    newest[:] = [id(leaf) for leaf in jax.tree_util.tree_leaves(result[0])]  # result[1]: its compilations
    return result

  def wait(tree):
    waits.append(any(id(leaf) in newest for leaf in jax.tree_util.tree_leaves(tree)))
    return real_wait(tree)

  batches = make_batches((64,) * 6, num_time=20, seed=13)
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, progress_bar=False)
  monkeypatch.setattr(_fit_loop, '_call_step', call)
  monkeypatch.setattr(_feed.jax, 'block_until_ready', wait)
  trainer.fit(batches, num_epoch=1)
  assert len(waits) >= 4 and not any(waits), waits


def test_feed_keeps_the_last_flag_and_the_error_of_a_failing_source():
  """The batches read before a source fails are all yielded (the last one as not last), then the error."""
  def failing():
    yield np.ones((2, 1)), np.ones(2)
    yield np.ones((2, 1)), np.ones(2)
    raise OSError('disk gone')

  feed, flags = Feed(failing(), Sender(), units=_whole, ahead=True), []
  with pytest.raises(OSError, match='disk gone'):
    for fed in feed:
      feed.dispatched(jnp.zeros(()))
      flags.append(fed.last)
  assert flags == [False, False]
  assert [fed.last for fed in Feed([(np.ones((2, 1)), np.ones(2))], Sender(), units=_whole, ahead=True)] == [True]


def _whole(inputs, targets):
  """Every batch runs whole (no pieces)."""
  return None


@pytest.mark.parametrize('ahead', [False, True])
def test_a_source_may_reuse_the_arrays_of_the_batch_before(monkeypatch, ahead):
  """A source may refill a batch's host arrays when it makes the batch after it (reading one batch ahead, as a pass
  with accumulate_steps does: two after it; the loop has called that batch's step by then): its copy to the device
  is complete before the source is read on."""
  class Copy(tuple):
    def block_until_ready(self):
      events.append(('copied', int(self[0][0])))
      return self

  events = []
  monkeypatch.setattr(_feed, 'on_device', lambda batch: Copy(batch))

  def source():
    for i in range(5):
      events.append(('read', i))
      yield np.full(1, i), np.zeros(1)

  feed = Feed(source(), Sender(), units=_whole, ahead=ahead)
  for _ in feed:
    feed.dispatched(jnp.zeros(()))
  reads = {i: events.index(('read', i)) for i in range(5)}
  for i in range(1, 4 - ahead):  # the batches sent ahead and handed on before the source made batch i + 1 (i + 2)
    assert reads[i + ahead] < events.index(('copied', i)) < reads[i + 1 + ahead]


def test_prefetch_bytes_counts_the_copies_on_the_device():
  x, y = np.ones((8, 5, 3), np.float32), np.zeros((8,), np.int64)
  assert prefetch_bytes(x, y) == 8 * 5 * 3 * 4 + 8 * np.dtype(jax.dtypes.canonicalize_dtype(np.int64)).itemsize
  assert prefetch_bytes(jnp.asarray(x), y) == 8 * np.dtype(jax.dtypes.canonicalize_dtype(np.int64)).itemsize
  assert prefetch_bytes({'a': x, 'b': x}, y) == 2 * x.nbytes + prefetch_bytes(np.zeros(0), y)


def test_report_lines_name_the_same_plans(capsys):
  """What fit prints is what it printed without the overlap (times aside)."""
  lines = []
  for overlap in (False, True):
    _fit(overlap, make_batches((8,) * 3, seed=14), num_micro_batch=2, num_report=1)
    lines.append(re.sub(r'use [0-9.]+ s', 'use - s', capsys.readouterr().out))
  assert lines[0] == lines[1] and lines[0].count('Train') == 6


@pytest.mark.long  # the long suite (--long): the planner's search of the chunks, twice
def test_streamed_chunks_go_ahead_one_by_one_bit_for_bit(sent, tmp_path):
  """A batch larger than the budget, streamed in chunks: each chunk is sent while the one before it runs, the next
  batch's first while this batch's last runs (never a whole batch beside them); results as without the overlap, also
  with ``loss_weight_fn`` (its values read when the batch is combined, not in between). The second run reads the
  first's plans from the plan cache (its steps compiled again)."""
  batches = make_batches((24, 24), num_time=20, n_in=64, seed=15)

  def snn_trainer(budget, **options):
    return AccumBPTT(make_model('snn', n_in=64), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.01),
                     num_micro_batch='auto', memory_budget=budget, progress_bar=False,
                     loss_weight_fn=lambda x, y: jnp.asarray(x.shape[0], jnp.float32), **options)

  budget = streaming_budget([snn_trainer('1GiB')], batches)  # (on a TPU v5e a third of the data held no sample's step)
  results = []
  for overlap in (False, True):
    trainer = snn_trainer(budget, cache=tmp_path)
    with overlapping(True), values_restored([bm.random.DEFAULT]):  # both plan alike, with the chunk sent ahead
      trainer.target.reset(24)  # beside each step counted (the reset's random draws put back: fit's are bp.BPTT's)
      trainer.plan_memory(*batches[0])
    with overlapping(overlap):
      trainer.fit(batches, num_epoch=1)
    results.append([params_of(trainer.target), optimizer_state(trainer), trainer.train_losses,
                    np.asarray(trainer.target.lif.V.value)])
  chunks = chunk_sizes(24, trainer.stream_chunks[24])  # (in a TPU's tiles, a shorter last one)
  assert len(chunks) > 1 and len(sent) == 2 * len(chunks) - 1 and {len(x) for x, _ in sent} == set(chunks)
  assert_trees_close(results[1], results[0], **EXACT)
  expected = bp.BPTT(make_model('snn', n_in=64), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.01),
                     progress_bar=False)
  expected.fit(batches, num_epoch=1)
  assert_trees_close(results[1][0], params_of(expected.target))
  assert_trees_close(results[1][2], expected.train_losses)


def _pieces_budget(model: str, batch) -> int:
  """A budget that the batch's step in one micro-batch fits, but not with the whole next batch sent beside it:
  'auto' streams it in pieces. The margin is half a batch's bytes, so the probe's step must be the trainers' own,
  their optimizer included (bp.BPTT's default one keeps a learning-rate schedule: on a TPU v5e its step took
  1,024 bytes more than with Adam(lr=0.05), more than the margin of 800)."""
  size = len(batch[1])
  probe = AccumBPTT(make_model(model), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05),
                    num_micro_batch='auto', memory_budget='1GiB')
  probe.target.reset(size)
  whole = probe.compiled_step_bytes(plan_micro_batches(size, num_micro_batch=1), FIT, *batch)
  return whole + prefetch_bytes(*batch) // 2


@pytest.mark.parametrize('data', ['ragged', pytest.param('dict', marks=pytest.mark.long),  # (--long: README time)
                                  pytest.param('generator', marks=pytest.mark.long)])
def test_pieces_sent_ahead_train_as_bptt(sent, data):
  """NumPy batches streamed in pieces, each sent while the one before computes: the update of the whole batch,
  for a ragged last batch (a piece plan of its own), dict inputs, and a generator read as bp.BPTT reads it."""
  model = 'dict_rnn' if data == 'dict' else 'rnn'
  batches = make_batches((16, 16, 16, 11) if data == 'ragged' else (16,) * 3, seed=21, dict_inputs=data == 'dict')
  read = []

  def source():
    for i, batch in enumerate(batches):
      read.append(i)
      yield batch

  seen = []
  trainer = AccumBPTT(make_model(model), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                      num_micro_batch='auto', memory_budget=_pieces_budget(model, batches[0]), cache=False)
  trainer.fit(source if data == 'generator' else batches, num_epoch=2, num_report=1,
              fun_after_report=lambda idx, metrics, phase: seen.append(len(read)))
  assert 16 in trainer.stream_chunks and trainer.stream_chunks[16] < 16 and sent
  if data == 'generator':  # at each report of epoch 2 the source had given that batch, no more
    assert [n - 3 for n in seen[3:]] == [1, 2, 3]
  expected = bp.BPTT(make_model(model), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  expected.fit(batches, num_epoch=2, num_report=1)
  assert_trees_close(params_of(trainer.target), params_of(expected.target))
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5)


def test_device_data_of_a_size_planned_in_pieces_runs_in_one_step(monkeypatch):
  """A batch size planned in pieces for NumPy batches (sent ahead), then given as data already on the device:
  nothing to send, so its step runs whole, in micro-batches of the pieces' size (one step a batch, the slices
  taken inside it), and trains as bp.BPTT."""
  batches = make_batches((16,) * 3, seed=22)
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                      num_micro_batch='auto', memory_budget=_pieces_budget('rnn', batches[0]), cache=False)
  trainer.fit(batches, num_epoch=1)
  piece = trainer.stream_chunks[16]
  stepped, real = [], _fit_loop._call_step
  monkeypatch.setattr(_fit_loop, '_call_step', lambda step, shared, x, y: stepped.append(len(x)) or
                      real(step, shared, x, y))
  trainer.fit([tuple(jnp.asarray(a) for a in batch) for batch in batches], num_epoch=1)
  assert stepped == [16] * 3 and trainer.plan_for(16).micro_batch_size == piece
  expected = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  expected.fit(batches, num_epoch=2)
  assert_trees_close(params_of(trainer.target), params_of(expected.target))
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses[-1:], rtol=1e-5)


@pytest.mark.long  # the long suite (--long): README suite time
def test_steps_in_flight_stay_bounded_when_nothing_is_sent(monkeypatch):
  """Batches unlike the one before (here of other lengths) are not sent ahead; the loop still waits for the step
  before the running one, so that the device holds two steps' data at most (found in review: one more a batch)."""
  batches = [make_batches((8,), num_time=3 + i, seed=i)[0] for i in range(6)]
  held, real = [], _feed.Sender.dispatched

  def counting(self, outputs):
    real(self, outputs)
    held.append(len(self._running))

  monkeypatch.setattr(_feed.Sender, 'dispatched', counting)
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, progress_bar=False)
  trainer.fit(batches, num_epoch=1)
  assert held and max(held) <= 1


def test_spikes_sent_as_uint8_train_as_bptt_on_float32_spikes(sent):
  """0-or-1 inputs held as uint8 cross to the device in a quarter of float32's bytes (what the planner counts for
  a piece sent ahead) and the model converts them there: streamed in pieces, the same training as bp.BPTT's on
  the same spikes in float32."""
  rng = np.random.default_rng(3)
  batches = [((rng.random(x.shape) < 0.3).astype(np.uint8), y) for x, y in make_batches((16,) * 3, seed=22)]
  floats = [(x.astype(np.float32), y) for x, y in batches]
  assert prefetch_bytes(*batches[0]) * 4 - prefetch_bytes(*floats[0]) == 3 * batches[0][1].nbytes
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                      num_micro_batch='auto', memory_budget=_pieces_budget('rnn', batches[0]), cache=False)
  trainer.fit(batches, num_epoch=2)
  assert 16 in trainer.stream_chunks and any(x.dtype == jnp.uint8 for x, _ in sent)
  expected = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  expected.fit(floats, num_epoch=2)
  assert_trees_close(params_of(trainer.target), params_of(expected.target))
  np.testing.assert_allclose(trainer.train_losses, expected.train_losses, rtol=1e-5)


@pytest.mark.parametrize('send_ahead', [False, True])
@pytest.mark.parametrize('source', ['refilled', 'from the model'])
def test_sources_that_refill_their_arrays_or_read_the_model_train_as_bp_bptt(source, send_ahead):
  """The source is read as bp.BPTT reads it, once the step before is dispatched. A loader that refills one pair of
  NumPy arrays for every batch trained on the next batch's values (the feed read one batch ahead, and on a CPU a
  step, or a copy by JAX, reads NumPy arrays after its call returns); one whose batches follow the parameters (a
  curriculum) got them before the update before. Both now end as bp.BPTT ends (for the refilled arrays: on the
  batches themselves, as bp.BPTT without its progress bar reads refilled arrays late too), on the CPU and with data
  sent ahead."""
  batches = make_batches((12, 12, 12, 12), num_time=6, seed=21)

  def refilled():
    x, y = np.empty_like(batches[0][0]), np.empty_like(batches[0][1])
    for bx, by in batches:
      x[...], y[...] = bx, by
      yield x, y

  def data_for(model, reference):
    if source == 'refilled':
      return batches if reference else refilled
    return lambda: ((x, y * (1 + 10 * float(np.mean(params_of(model)[0])))) for x, y in batches)

  def trained(make, reference):
    model = make_model('rnn')
    trainer = make(model, 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05))
    trainer.progress_bar = False
    with overlapping(send_ahead):
      trainer.fit(data_for(model, reference), num_epoch=1)
    return params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed')

  expected = trained(bp.BPTT, reference=True)
  assert_trees_close(trained(functools.partial(AccumBPTT, num_micro_batch=3), reference=False), expected)


def test_a_refilling_source_with_accumulate_steps_and_a_report_that_sets_the_next_batch():
  """With accumulate_steps the pass reads one batch ahead (to know its last): a source refilling one pair of arrays
  trained batch k on batch k + 1's values (batch 0 never); each batch is now copied as it is read. Without it, data
  sent ahead: the next batch used to be read before the batch in hand's report, so a source that follows what
  fun_after_report sets (a curriculum's level) made it one report late."""
  batches = make_batches((8, 8, 8, 8, 8, 5), num_time=6, seed=22)

  def refilled():
    x, y = np.empty((8,) + batches[0][0].shape[1:], np.float32), np.empty((8,) + batches[0][1].shape[1:], np.float32)
    for bx, by in batches:
      x[:len(bx)], y[:len(by)] = bx, by
      yield x[:len(bx)], y[:len(by)]

  accumulated = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05),
                          num_micro_batch=3, accumulate_steps=2, progress_bar=False)
  accumulated.fit(refilled, num_epoch=1)
  reference = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False)
  reference.fit([tuple(np.concatenate(p) for p in zip(*batches[i:i + 2])) for i in (0, 2, 4)], num_epoch=1)
  assert_trees_close(params_of(accumulated.target), params_of(reference.target))

  def by_level(trainer):
    level = [1.]
    data = lambda: ((x * level[0], y) for x, y in batches[:4])  # noqa: E731
    trainer.fit(data, num_epoch=1, num_report=1, fun_after_report=lambda *_: level.__setitem__(0, level[0] + 1))
    return params_of(trainer.target), trainer.get_hist_metric('fit', 'loss', 'detailed')

  expected = by_level(bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05),
                              progress_bar=False))
  assert_trees_close(by_level(AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05),
                                        num_micro_batch=3, progress_bar=False)), expected)


@pytest.mark.parametrize('form', ['stacked array', 'getitem only', 'BrainPy pairs'])
def test_sources_python_iterates_train_as_bp_bptt_with_data_sent_ahead(form):
  """A stacked NumPy array of batches, ``(n, 2, ...)``, sent ahead whole, failed on its truth value; a class with
  only ``__getitem__`` and ``__len__`` (which Python, and bp.BPTT, iterate) was refused as not iterable; a list of
  BrainPy arrays of two rows each (which bp.BPTT unpacks) was refused as not a pair."""
  batches = make_batches((6, 6, 6), num_time=5, n_out=3, seed=23)

  class Indexed:
    def __len__(self):
      return len(batches)

    def __getitem__(self, i):
      return batches[i]

  data = {'stacked array': np.stack([np.stack(batch) for batch in batches]), 'getitem only': Indexed(),
          'BrainPy pairs': [bm.asarray(np.stack(batch)) for batch in batches]}[form]
  results = []
  for make in (bp.BPTT, functools.partial(AccumBPTT, num_micro_batch=3)):
    trainer = make(make_model('rnn', n_out=3), 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05),
                   progress_bar=False)
    trainer.fit(batches if make is bp.BPTT else data, num_epoch=1)
    results.append((params_of(trainer.target), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert_trees_close(results[1], results[0])
