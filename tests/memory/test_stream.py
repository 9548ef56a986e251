"""Batches whose data does not fit ``memory_budget`` beside the step: streamed from the host in chunks.

The reference is ``bp.BPTT`` on the whole batch: one update per batch, the same parameters, losses and
model state, also with random initial states (drawn at the whole batch's size), carried states
(``reset_state=False``) and ``accumulate_steps``.
"""

import json
import re
import warnings

import brainpy as bp
import brainpy.math as bm
import numpy as np
import pytest
from hypothesis import given, strategies as st

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.diagnostics._compiles import count_compilations
from brainpy_accum.memory._budget import candidate_micro_batch_sizes, step_memory
from brainpy_accum.memory._stream import best_chunk, chunk_candidates, chunk_sizes, combine
from brainpy_accum.trainer._feed import overlapping
from helpers import (TINY_SIZES, assert_trees_close, make_batches, make_model, optimizer_state, params_of, step_bytes,
                     streaming_budget)
from test_training_loop import windows


N_IN, N_HIDDEN, T = 64, 8, 20
FIT = bp.tools.DotDict(fit=True)


def _model():
  return make_model('snn', n_in=N_IN, n_hidden=N_HIDDEN)  # random initial potentials at every reset


def _batches(sizes, seed=1):
  return make_batches(sizes, num_time=T, n_in=N_IN, seed=seed)


def _budget(batches, times_smaller=3):
  """A budget that the data of the largest batch exceeds ``times_smaller`` times (the arrays' own bytes: for
  checks made by arithmetic, before anything is compiled)."""
  return max(x.nbytes + y.nbytes for x, y in batches) // times_smaller


def _probe(model, loss=bp.losses.mean_squared_error, **options):
  """A trainer to measure steps with (its budget is not used)."""
  return AccumBPTT(model, loss, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False, num_micro_batch='auto',
                   memory_budget='1GiB', **options)


def test_batch_whose_step_does_not_fit_streams_and_trains_as_bptt():
  batches = _batches((48, 48, 22))  # 22: a shorter last chunk, with a plan (and step) of its own
  budget = streaming_budget([_probe(_model())], batches)
  reference = bp.BPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit(batches, num_epoch=2)
  trainer = AccumBPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=budget)
  trainer.fit(batches, num_epoch=2)
  assert set(trainer.stream_chunks) == {48, 22}
  for size, chunk in trainer.stream_chunks.items():
    assert chunk < size and trainer.memory_plans[chunk][1] <= budget
  # every chunk runs one step (the window's flag says whether it also updates): one compilation per chunk
  # shape, however many chunks, batches and updates; a chunk's model state and the window's sums keep their
  # weak types from one chunk and one update to the next
  shapes = {c for size, chunk in trainer.stream_chunks.items() for c in chunk_sizes(size, chunk)}
  assert trainer.compilations['fit'] == len(shapes)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  np.testing.assert_allclose(trainer.train_losses, reference.train_losses, rtol=1e-5)
  assert_trees_close(trainer.target.lif.V.value, reference.target.lif.V.value)  # the whole batch's final state
  with count_compilations() as compiled:
    trainer.fit(batches, num_epoch=1)
  assert compiled() == 0

@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended

def test_streamed_chunk_with_nan_is_left_out_and_the_clipped_update_is_that_of_the_other_chunks():
  """Every chunk runs the same compiled step, whose update only the last chunk's flag applies: a non-finite
  chunk (``skip_nonfinite``) leaves the batch's update to the other chunks (bp.BPTT on their samples, with
  the same clipping), and the chunks before the last update nothing (one Adam step per batch)."""
  batches = make_batches((24, 24, 24), num_time=T, n_in=N_IN, seed=5)
  budget = streaming_budget([_probe(make_model('rnn', n_in=N_IN), skip_nonfinite=True, clip_grad_norm=0.05)],
                             batches)
  x, y = batches[1]
  x = x.copy()
  x[1, 3, 0] = np.nan  # in the first chunk of the second batch
  trainer = AccumBPTT(make_model('rnn', n_in=N_IN), bp.losses.mean_squared_error, num_micro_batch='auto',
                      memory_budget=budget, skip_nonfinite=True, clip_grad_norm=0.05,
                      optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  trainer.fit([batches[0], (x, y), batches[2]], num_epoch=1)
  chunk = trainer.stream_chunks[24]
  assert len(chunk_sizes(24, chunk)) > 1  # streamed: the first chunk is left out, the others update

  class ClippedBPTT(bp.BPTT):
    def _step_func_fit(self, shared_args, inputs, targets):
      grads, loss = self.f_grad(shared_args, inputs, targets)
      norm = bm.sqrt(sum(bm.sum(g ** 2) for g in grads.values()))
      self.optimizer.update({k: g * bm.minimum(1., 0.05 / norm) for k, g in grads.items()})
      return (loss,)

  reference = ClippedBPTT(make_model('rnn', n_in=N_IN), bp.losses.mean_squared_error,
                          optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit([batches[0], (x[chunk:], y[chunk:]), batches[2]], num_epoch=1)
  assert int(trainer.skipped_steps.value) == 1
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  assert_trees_close(optimizer_state(trainer), optimizer_state(reference))  # moments: one update per batch


@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended
@TINY_SIZES
def test_larger_chunk_ruled_out_by_the_same_cut_of_a_smaller_chunk_does_not_fit(monkeypatch):
  """remat='auto': a larger chunk is not probed for the micro-batches that would win when the same cut,
  measured in a smaller chunk, plus the larger chunk's extra data and states, exceeds the budget; measured
  anyway, that cut of the larger chunk does not fit (the bound was right), and training is bp.BPTT's."""
  batches = _batches((48,))
  x, y = batches[0]
  # The workload: chunks of 6 in micro-batches of 3 fit (for the remat option that needs less), chunks of 6 in
  # one piece and chunks of 12 in micro-batches of 3 do not, and the 6 more samples of a chunk of 12 put the
  # cut of 3 measured in a chunk of 6 over the budget by arithmetic (all by XLA's bytes on this device).
  measure = _probe(_model(), remat='auto', cache=False)
  need = {(chunk, micro): min(step_bytes(measure, x, y, chunk, micro, True, remat) for remat in (False, True))
          for chunk, micro in ((6, 3), (6, 6), (12, 3))}
  measure.target.reset(12)
  more_data = measure._fixed_bytes(x[:12], y[:12])
  measure.target.reset(6)
  more_data -= measure._fixed_bytes(x[:6], y[:6])
  budget = need[6, 3] + min(need[6, 6] - need[6, 3], need[12, 3] - need[6, 3], more_data) // 2
  assert need[6, 3] <= budget < min(need[6, 6], need[12, 3], need[6, 3] + more_data), (need, more_data)
  probed = []
  trainer = AccumBPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=budget, remat='auto', cache=False)
  compilers = trainer.planner.compilers
  probe = lambda plan, *args: compilers.step_bytes(plan, *args)
  trainer.planner.compilers = compilers._replace(step_bytes=lambda plan, *args: probed.append(plan) or probe(plan, *args))
  trainer.fit(batches, num_epoch=1)
  chunk = trainer.stream_chunks[48]
  largest = max(c.micro_batch_size for c in trainer.planner.weighed_plans[chunk] if c.fits)
  larger = [c for c in chunk_candidates(48) if c > chunk]
  assert chunk == 6 and largest == 3 and larger  # the workload this test is about
  assert not [p for p in probed if p.batch_size in larger and p.micro_batch_size == largest]
  x, y = batches[0]
  trainer.target.reset(larger[-1])
  for remat in (False, True):
    plan = plan_micro_batches(larger[-1], micro_batch_size=largest)._replace(remat=remat)
    assert probe(plan, FIT, x[:larger[-1]], y[:larger[-1]], True).total > budget
  reference = bp.BPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit(batches, num_epoch=1)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))


@pytest.mark.long  # the long suite (--long)
def test_streamed_carried_states_and_windows_train_as_bptt():
  """``reset_state=False`` (each chunk continues its samples' state) and ``accumulate_steps=2`` (chunks of
  two batches, one update) against bp.BPTT on the windows' concatenated batches."""
  batches = _batches((32, 32, 32, 32), seed=2)
  rnn = lambda: make_model('rnn', n_in=N_IN, n_hidden=N_HIDDEN)
  budget = streaming_budget([_probe(_model()), _probe(rnn(), accumulate_steps=2)], batches)
  reference = bp.BPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit(batches, num_epoch=1)
  reference.fit(batches, num_epoch=1, reset_state=False)
  trainer = AccumBPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=budget)
  trainer.fit(batches, num_epoch=1)
  trainer.fit(batches, num_epoch=1, reset_state=False)
  assert trainer.stream_chunks
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  np.testing.assert_allclose(trainer.train_losses, reference.train_losses, rtol=1e-5)

  # A window's batches are reset one by one, bp.BPTT's merged batch at once: random initial states would
  # differ, so this half uses the rate network (zero initial state).
  reference = bp.BPTT(rnn(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit(windows(batches, 2), num_epoch=1)
  trainer = AccumBPTT(rnn(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=budget, accumulate_steps=2)
  trainer.fit(batches, num_epoch=1)
  assert trainer.stream_chunks == {32: trainer.stream_chunks[32]}
  assert_trees_close(params_of(trainer.target), params_of(reference.target))


@pytest.mark.parametrize('sent_ahead', [False, pytest.param(True, marks=pytest.mark.long)], ids=['chunks', 'pieces'])
def test_streamed_rerun_takes_its_chunk_from_the_plan_cache(tmp_path, capsys, sent_ahead):
  """A rerun streams in the chunk size that the first run chose, without the chunk search's probes: the
  chunk's plan comes from the cache, its step compiled again and measured, and training is the same. A
  cached choice that names no chunk size of the batch is ignored with a note, and the search runs again. Where
  data is sent to the device ahead (an accelerator's path, forced here on any device: the README suite's case
  is ``test_startup.py``'s), the batch streams in pieces of one micro-batch and the piece size is cached alike."""
  batches = _batches((24,))
  budget = streaming_budget([_probe(_model())], batches)
  options = dict(progress_bar=False, num_micro_batch='auto', memory_budget=budget, cache=tmp_path)
  trainer = lambda: AccumBPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), **options)
  with overlapping(sent_ahead):
    first = trainer()
    first.fit(batches, num_epoch=1)
    chunk = first.stream_chunks[24]
    capsys.readouterr()

    rerun = trainer()
    probes, compilers = [], rerun.planner.compilers
    rerun.planner.compilers = compilers._replace(
      step_bytes=lambda *args, **kwargs: probes.append(args[0]) or compilers.step_bytes(*args, **kwargs))
    rerun.fit(batches, num_epoch=1)
    assert rerun.stream_chunks[24] == chunk and probes == []
    assert 'from the plan cache' in capsys.readouterr().out
    assert_trees_close(params_of(rerun.target), params_of(first.target))

    kind, field, cut = ('pieces', 'piece', 'piece') if sent_ahead else ('streamed', 'stream_chunk', 'chunk')
    for path in (tmp_path / 'plans').iterdir():
      entry = json.loads(path.read_text())
      if entry['key'].get(kind):
        path.write_text(json.dumps(dict(entry, plan={field: 25})))  # more samples than the batch holds
    third = trainer()
    with pytest.warns(UserWarning, match=f'plan cache: .*does not name a {cut} size'):
      third.fit(batches, num_epoch=1)
  assert third.stream_chunks[24] == chunk
  assert_trees_close(params_of(third.target), params_of(first.target))


@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended
@TINY_SIZES
def test_chunk_size_planned_before_as_a_batch_is_planned_again_through_the_window():
  """A batch of 12 planned first (its plain step), then a batch streamed in chunks: a chunk's step passes
  through the window and needs more memory, so a chunk size planned as a plain batch is planned again. The
  chosen chunk's step fits the budget by XLA's measure, whichever batch comes first."""
  batches = make_batches((12, 96), num_time=50, n_in=64, seed=1)
  # between the batch of 12's step in one piece (fits) and that step through the window (does not), by XLA's
  # bytes on this device: a plan of 12 made for the plain step does not hold for the chunk's
  measure = _probe(make_model('rnn', n_in=64, n_hidden=64), remat=True)
  plain, through = (step_bytes(measure, *batches[0], 12, 12, via_window) for via_window in (False, True))
  budget = (plain + through) // 2
  assert plain < budget < through < step_bytes(measure, *batches[1], 96, 1, False), (plain, through)
  reference = bp.BPTT(make_model('rnn', n_in=64, n_hidden=64), bp.losses.mean_squared_error,
                      optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit(batches, num_epoch=1)
  trainer = AccumBPTT(make_model('rnn', n_in=64, n_hidden=64), bp.losses.mean_squared_error,
                      optimizer=bp.optim.Adam(lr=0.01), progress_bar=False, num_micro_batch='auto',
                      memory_budget=budget, remat=True)
  trainer.fit(batches, num_epoch=1)
  chunk = trainer.stream_chunks[96]
  assert chunk == 12  # the workload: the chunk is the size planned before as a plain batch (now 2 x 6)
  x, y = (a[:chunk] for a in batches[1])
  trainer.target.reset(chunk)
  close = step_memory(trainer.compile_step(x, y, plan=trainer.plan_for(chunk), via_window=True, quick=True))
  assert close.total <= budget, (chunk, close.total, budget)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))


def _max_over_samples(predicts, targets):  # couples the samples: the worst sample's error
  return bm.max(bm.mean((predicts - targets) ** 2, axis=(1, 2)))


def _mean_over_samples(predicts, targets):  # not BrainPy's own MSE, so that the first-batch check runs
  return bm.mean((predicts - targets) ** 2)


@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended
@TINY_SIZES
def test_streamed_chunks_trained_in_one_piece_still_get_the_loss_check():
  """Chunks of 2 trained as one micro-batch (the budget is that step's bytes, so no larger micro-batch fits
  any chunk): the chunks combine like micro-batches, so a loss that couples the samples must warn (the check
  cuts the first chunk in two). Chunks of one sample: see the next test."""
  batches = _batches((24,))
  x, y = batches[0]
  probe = AccumBPTT(_model(), _max_over_samples, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                    num_micro_batch='auto', memory_budget='1GiB', cache=False)
  probe.target.reset(2)
  budget = probe.compiled_step_bytes(plan_micro_batches(2, micro_batch_size=2), FIT, x[:2], y[:2], via_window=True)
  assert budget < step_bytes(probe, x, y, 24, 1, via_window=False)  # the batch is streamed
  trainer = AccumBPTT(_model(), _max_over_samples, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=budget, cache=False)
  with pytest.warns(UserWarning, match='couples the samples'):
    trainer.fit(batches, num_epoch=1)
  assert trainer.stream_chunks == {24: 2} and trainer.memory_plans[2][0].num_micro_batches == 1

@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended

def test_budget_below_one_sample_names_what_streaming_needs_and_that_figure_trains_as_bptt():
  """A budget that not even one sample at a time fits: the error names the budget that streaming one sample at
  a time needs (not the unstreamed step's), before anything changes; with that budget the batch streams in
  chunks of one, checked silently (a mean over samples) and trained as bp.BPTT, while a loss that couples the
  samples warns (the check takes the batch's first two samples)."""
  batches = _batches((24, 24), seed=3)
  # between one sample's arguments and updated parameters (by arithmetic: a streamed chunk of one is planned) and
  # its step through the window (XLA's bytes on this device)
  measure = _probe(_model(), _mean_over_samples, cache=False)
  x, y = batches[0]
  one = step_bytes(measure, x, y, 1, 1, via_window=True)
  measure.target.reset(1)
  least = measure._fixed_bytes(x[:1], y[:1])
  assert least < one, (least, one)
  trainer = AccumBPTT(_model(), _mean_over_samples, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=(least + one) // 2, cache=False)
  before = params_of(trainer.target)
  with pytest.raises(ValueError, match='streamed from the host one sample at a time it needs') as error:
    trainer.fit(batches, num_epoch=1)
  assert_trees_close(params_of(trainer.target), before, rtol=0, atol=0)
  need = int(re.search(r'at least (\d+)', str(error.value)).group(1))
  reference = bp.BPTT(_model(), _mean_over_samples, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit(batches, num_epoch=1)
  trainer = AccumBPTT(_model(), _mean_over_samples, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=need, cache=False)
  with warnings.catch_warnings():
    warnings.simplefilter('error', UserWarning)
    trainer.fit(batches, num_epoch=1)
  assert trainer.stream_chunks == {24: 1} and trainer.memory_plans[1][1] <= need
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  np.testing.assert_allclose(trainer.train_losses, reference.train_losses, rtol=1e-5)
  assert_trees_close(trainer.target.lif.V.value, reference.target.lif.V.value)
  coupled = AccumBPTT(_model(), _max_over_samples, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=need, cache=False)
  with pytest.warns(UserWarning, match='couples the samples'):  # checked on the batch's first two samples
    coupled.fit(batches[:1], num_epoch=1)
  assert coupled.stream_chunks == {24: 1}


def test_whole_batch_loss_batch_whose_data_exceeds_the_budget_is_refused_naming_why():
  """whole_batch_loss=True is not streamed: a batch whose data alone exceeds the budget gets an error that says
  so, by arithmetic, before any plan is made or anything changes."""
  batches = _batches((24,))
  trainer = AccumBPTT(_model(), _max_over_samples, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=_budget(batches, 3), whole_batch_loss=True, cache=False)
  before = params_of(trainer.target)
  with pytest.raises(ValueError, match='whole_batch_loss=True keeps the whole batch'):
    trainer.fit(batches, num_epoch=1)
  assert_trees_close(params_of(trainer.target), before, rtol=0, atol=0)
  assert trainer.memory_plans == {}


def test_batch_that_fits_is_not_streamed():
  batches = _batches((8,))
  budget = 2 * step_bytes(_probe(_model()), *batches[0], 8, 8, via_window=False)  # the whole step, twice over
  trainer = AccumBPTT(_model(), bp.losses.mean_squared_error, progress_bar=False, num_micro_batch='auto',
                      memory_budget=budget)
  trainer.fit(batches, num_epoch=1)
  assert trainer.stream_chunks == {} and trainer.memory_plans[8][0].num_micro_batches == 1

@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended

def test_first_batch_check_started_before_planning_stays_when_the_batch_is_streamed():
  """A batch whose data is well within the budget (so the loss check starts before planning) can still be
  streamed, when its step does not fit at one sample per micro-batch but a chunk's does; its chunks combine
  like micro-batches, so the check must report (this once raised 'No micro-batch plan for batch_size=2')."""
  rng = np.random.RandomState(0)
  x, y = rng.randn(2, 400, 48).astype('float32'), rng.randn(2, 400, 4).astype('float32')
  coupled = lambda p, t: bp.losses.mean_squared_error(p, t) + 1e-4 * bm.sum(p)  # a sum over the batch

  def trainer(budget):
    return AccumBPTT(make_model('rnn', n_in=48, n_hidden=64, n_out=4), coupled, optimizer=bp.optim.Adam(lr=0.01),
                     progress_bar=False, num_micro_batch='auto', memory_budget=budget, cache=False)

  probe = trainer('1GiB')
  probe.target.reset(2)
  whole = probe.compiled_step_bytes(plan_micro_batches(2, micro_batch_size=1), FIT, x, y)
  probe.target.reset(1)
  chunk = probe.compiled_step_bytes(plan_micro_batches(1, micro_batch_size=1), FIT, x[:1], y[:1], via_window=True)
  budget = (whole + chunk) // 2
  assert chunk < budget < whole and 2 * probe._argument_bytes(x, y) <= budget  # the case: checked before planning
  streamed = trainer(budget)
  with pytest.warns(UserWarning, match='couples the samples'):
    streamed.fit([(x, y)], num_epoch=1)
  assert streamed.stream_chunks == {2: 1}


@given(batch_size=st.integers(2, 300), data=st.data())
def test_chunk_search_plans_only_chunks_that_can_win_and_picks_as_planning_all(batch_size, data):
  candidates = chunk_candidates(batch_size)
  micro = {c: data.draw(st.one_of(st.none(), st.integers(1, c))) for c in candidates}  # a plan fits at most its chunk
  planned = []
  chosen = best_chunk(batch_size, lambda c: planned.append(c) or micro[c])
  fitting = [c for c in candidates if micro[c] is not None]
  assert chosen == (max(fitting, key=lambda c: (micro[c], c)) if fitting else None)
  for i, c in enumerate(planned):  # each planned chunk could still win when it was planned
    assert c > max([micro[p] for p in planned[:i] if micro[p] is not None], default=0)


@given(batch_size=st.integers(2, 300), data=st.data())
def test_chunk_search_with_a_guess_and_cheap_checks_picks_as_planning_all(batch_size, data):
  """With a guessed first chunk and ``can_hold`` (the trainer's lower bound or quick probe), the pick is still
  that of planning every chunk, and a chunk is planned only if it can hold micro-batches large enough to win."""
  candidates = chunk_candidates(batch_size)
  # each chunk's largest fitting cut, or None; memory grows with the cut, so smaller cuts fit too
  largest = {c: data.draw(st.one_of(st.none(), st.sampled_from(candidate_micro_batch_sizes(c)))) for c in candidates}
  first = data.draw(st.one_of(st.none(), st.sampled_from(candidates)))
  planned, asked = [], []

  def can_hold(chunk, micro):
    asked.append((chunk, micro))
    assert micro in candidate_micro_batch_sizes(chunk)
    return largest[chunk] is not None and micro <= largest[chunk]

  chosen = best_chunk(batch_size, lambda c: planned.append(c) or largest[c], can_hold=can_hold, first=first)
  fitting = [c for c in candidates if largest[c] is not None]
  assert chosen == (max(fitting, key=lambda c: (largest[c], c)) if fitting else None)
  assert len(planned) == len(set(planned)) and (first is None or planned[0] == first)
  for i, c in enumerate(planned[1:], 1):  # each later chunk could still win when it was planned
    found = [(largest[p], p) for p in planned[:i] if largest[p] is not None]
    if found:
      best_micro, best = max(found)
      assert largest[c] is not None and largest[c] >= (best_micro if c > best else best_micro + 1)


def test_chunk_arithmetic_and_combined_metrics():
  assert chunk_candidates(48) == [24, 12, 6, 3, 2, 1]
  assert chunk_sizes(21, 6) == [6, 6, 6, 3]
  loss, aux = combine([(np.float32(1.), {'a': np.float32(2.)}), (np.float32(4.), {'a': np.float32(8.)})],
                      [3, 1], 'mean')
  assert loss == pytest.approx(1.75) and aux['a'] == pytest.approx(3.5) and loss.dtype == np.float32
  loss, aux = combine([(np.float32(1.), {}), (np.float32(4.), {})], None, 'sum')
  assert loss == pytest.approx(5.)
