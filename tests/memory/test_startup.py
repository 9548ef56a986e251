"""Quick to start: the planner's few compilations, the step it compiles reused for training, the plan cache.

Every plan here, predicted or cached, is checked against XLA's own memory analysis of the step and against
a fixed-plan run (``micro_batch_size=`` the planned size, no planner): the same parameters after training.
"""

import json
import marshal
import os
import threading

import brainpy as bp
import jax
import pytest

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.diagnostics._compiles import count_compilations
from brainpy_accum.diagnostics._phases import PHASES, record_phases
from brainpy_accum.memory._budget import (StepMemory, candidate_micro_batch_sizes, device_tile, largest_fitting,
                                         whole_first)
from brainpy_accum.memory._chunks import PIECE_FILL, ChunkSearch
from brainpy_accum.memory._cache import PlanCache, cache_folder, use_compilation_cache
from brainpy_accum.memory._plan_key import _code
from brainpy_accum.memory._stream import chunk_sizes
from brainpy_accum.trainer._compiled_steps import CompiledSteps
from brainpy_accum.trainer._feed import overlapping
from helpers import TINY_SIZES, assert_trees_close, make_batches, make_model, params_of

FIT = bp.tools.DotDict(fit=True)
SIZE, NUM_TIME = 24, 20


def _model():
  return make_model('rnn', n_in=4, n_hidden=32, n_out=3)


def _trainer(model=None, loss=bp.losses.mean_squared_error, **kwargs):
  return AccumBPTT(model or _model(), loss, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, **kwargs)


@pytest.fixture(scope='module')
def data():
  """Two batches, and a budget between the step of micro-batches of 8 (fits) and of 12 (does not)."""
  batches = make_batches((SIZE, SIZE), num_time=NUM_TIME, n_in=4, n_out=3)
  probe = _trainer(num_micro_batch='auto', memory_budget='1GiB', cache=False)
  probe.target.reset(SIZE)
  need = {s: probe.compiled_step_bytes(plan_micro_batches(SIZE, micro_batch_size=s), FIT, *batches[0])
          for s in (8, 12)}  # XLA's bytes on this device (8 and 12 samples take 8 and 16 rows of a TPU's tiles)
  assert need[8] < need[12], need
  return batches, (need[8] + need[12]) // 2, need


def _piece_budget(batch, small: int, large: int, model=_model) -> int:
  """A budget whose share for a streamed batch's pieces (:data:`PIECE_FILL` of it) lies between the step of a
  piece of ``small`` samples of ``batch`` and one of ``large``, measured on this device as the pieces' search
  measures them (through the window, one micro-batch, the model state at the piece's size): the pieces' own bytes,
  not the whole batch's micro-batches' (on a TPU, whose tiles pad the data of a batch and of its pieces
  differently, those differ several-fold). ``model()`` builds the model."""
  probe = _trainer(model(), num_micro_batch='auto', memory_budget='1GiB', cache=False)
  need = {}
  for size in (small, large):
    probe.target.reset(size)
    piece = jax.tree_util.tree_map(lambda x: x[:size], batch)
    need[size] = probe.compiled_step_bytes(plan_micro_batches(size, num_micro_batch=1), FIT, *piece, via_window=True)
  assert need[small] < need[large], need
  return int((need[small] + need[large]) / 2 / PIECE_FILL)


@pytest.fixture(scope='module')
def piece_budget(data):
  """:func:`_piece_budget` of the batches of 24 between pieces of 8 and of 12 (16 rows on a TPU)."""
  return _piece_budget(data[0][0], 8, 12)


_FIXED = {}


def _fit_fixed(size, batches, remat=False):
  """The unplanned run of a plan: the same micro-batches given by hand (run once per plan, then kept)."""
  if (size, remat) not in _FIXED:
    model = _model()
    _trainer(model, micro_batch_size=size, remat=remat, cache=False).fit(batches, num_epoch=1)
    _FIXED[size, remat] = params_of(model)
  return _FIXED[size, remat]


@pytest.mark.parametrize('slope, fixed, curve, budget, most', [
  (5, 100, 0, 1300, 3), (3, 0, 0, 3000, 3), (1, 50, 0, 40, 3),  # affine: the first line is right
  (0.5, 7, 0.002, 60, 7),  # bending: the whole batch's step is 8 times a line's (bisection of 62 sizes: 7)
])
def test_largest_fitting_finds_bisections_answer_with_few_probes(slope, fixed, curve, budget, most):
  sizes = candidate_micro_batch_sizes(1000)
  bytes_of = lambda s: int(fixed + slope * s + curve * s * s)
  probed = []
  found = largest_fitting(sizes, budget, lambda s: probed.append(s) or StepMemory(bytes_of(s), fixed))
  fitting = [s for s in sizes if bytes_of(s) <= budget]
  assert found == (None if not fitting else (max(fitting), bytes_of(max(fitting))))
  assert len(probed) <= most, probed


@pytest.mark.parametrize('guess_error', [0., 0.03, -0.03, 0.5, -0.5, None])
@pytest.mark.parametrize('slope, fixed, curve, budget', [(5, 100, 0, 1300), (1, 50, 0, 40), (0.5, 7, 0.002, 60),
                                                         (3, 0, 0, 3000)])
def test_a_guess_only_orders_the_probes(slope, fixed, curve, budget, guess_error):
  """A guess from other measurements (a streamed batch's other chunk) starts the search at its pick; right or
  wrong, the answer is the one measured without it, and a right guess of a line costs at most two probes.
  ``None``: a guess that predicts nothing fits."""
  sizes = candidate_micro_batch_sizes(1000)
  bytes_of = lambda s: int(fixed + slope * s + curve * s * s)
  guess = (lambda s: 10 * budget) if guess_error is None else (lambda s: bytes_of(s) * (1 + guess_error))
  probed = []
  found = largest_fitting(sizes, budget, lambda s: probed.append(s) or StepMemory(bytes_of(s), fixed), guess=guess)
  fitting = [s for s in sizes if bytes_of(s) <= budget]
  assert found == (None if not fitting else (max(fitting), bytes_of(max(fitting))))
  assert not fitting or found[0] in probed  # measured, never predicted
  if guess_error == 0. and curve == 0 and fitting:
    assert len(probed) <= 2, probed


def test_a_guess_wrong_at_the_answer_does_not_rule_out_the_next_size():
  """A chunk of 2 of a tiny model: the accumulators dominate, so the step of 1 x 2 needs hardly more than
  2 x 1, while the guess (drawn through another chunk in one piece) and the line from the fixed bytes both
  grow steeply. The guess was 14% off at its pick, so it is not heard: 2 is measured, and fits."""
  steps = {2: 40189, 1: 39901}
  probed = []
  found = largest_fitting([2, 1], 40189, lambda s: probed.append(s) or StepMemory(steps[s], 28373),
                          guess=lambda s: 28373 + 6000 * s)
  assert found == (2, 40189) and probed == [1, 2]


def test_sizes_known_not_to_fit_without_a_figure_draw_no_line():
  """A streamed batch's pieces on a chip (the start-up bench's rate RNN at 8 MiB, figures from the CPU): the
  largest piece's data alone exceed the budget, so it is known not to fit without a compilation. Drawn as a
  figure just over the budget, it pulled every line far below the step's memory and the search compiled 7
  pieces where 2 find the answer."""
  sizes = [128, 88, 64, 56, 48, 40, 32, 24, 16, 8, 7, 6, 5, 4, 3, 2, 1]
  bytes_of = lambda s: 2827157 + 309256 * s
  probed = []
  found = largest_fitting(sizes, 6815744, lambda s: probed.append(s) or (None if s > 100 else bytes_of(s)))
  assert found == (8, bytes_of(8)) and probed == [128, 16, 8]
  probed = []  # none fits: the answer is None, every size but the arithmetic's measured no more than bisection
  assert largest_fitting(sizes, 1000, lambda s: probed.append(s) or (None if s > 100 else bytes_of(s))) is None
  assert probed[-1] == 1 and len(probed) <= 6, probed


def test_answer_is_always_measured_even_where_memory_is_far_from_a_line():
  sizes = list(range(64, 0, -1))
  steps = {s: 10 * s if s < 30 else 1000 + s for s in sizes}  # a jump: lines predict badly across it
  probed = []
  found = largest_fitting(sizes, 400, lambda s: probed.append(s) or steps[s])
  assert found == (29, 290) and 29 in probed and 30 in probed


@TINY_SIZES
@pytest.mark.parametrize('remat', [False, pytest.param('auto', marks=pytest.mark.long)])  # README suite time
def test_predicted_plan_fits_by_xla_and_trains_as_the_same_fixed_plan(data, remat):
  batches, budget, need = data
  model = _model()
  trainer = _trainer(model, num_micro_batch='auto', memory_budget=budget, remat=remat, cache=False)
  with count_compilations() as compiled:
    trainer.fit(batches, num_epoch=1)
  plan, used = trainer.memory_plans[SIZE]
  model.reset(SIZE)
  assert used == trainer.compiled_step_bytes(plan, FIT, *batches[0]) <= budget  # XLA's measure of that plan
  if remat is False:
    assert plan.micro_batch_size == 8 and used == need[8]  # the fewest micro-batches that fit
  assert trainer.compilations['fit'] == 1 and trainer.trace_counts['fit'] == 1  # planned once, not compiled again
  assert compiled() <= (5 if remat is False else 8)  # probes, the step, the loss check (a bisection: 6 probes alone)
  assert_trees_close(params_of(model), _fit_fixed(plan.micro_batch_size, batches, bool(plan.remat)))


def _recorded_probes(trainer) -> list:
  """The list of the plans that ``trainer``'s planner probes quickly from now on (a search's probes)."""
  probes, compilers = [], trainer.planner.compilers
  trainer.planner.compilers = compilers._replace(
    step_bytes=lambda *args, **kwargs: probes.append(args[0]) or compilers.step_bytes(*args, **kwargs))
  return probes


def _steps_of(trainer, size: int) -> int:
  """The train steps a batch of ``size`` runs: one, or one per piece size where it is streamed."""
  chunk = trainer.stream_chunks.get(size)
  return 1 if chunk is None else len(set(chunk_sizes(size, chunk)))


@pytest.mark.parametrize('sent_ahead', [False, True], ids=['whole', 'pieces'])
def test_cached_plan_is_measured_again_and_trains_as_the_fixed_plan(data, tmp_path, capsys, sent_ahead):
  """A rerun takes every plan from the cache (each step compiled again and measured, no search) and writes
  nothing new. Where the batch is sent to the device ahead (an accelerator's path, forced here on any device),
  its step in one micro-batch does not fit beside the next batch: it streams in pieces, and the cache holds the
  piece size beside the pieces' plans (one for each piece size: a shorter last one has its own). (A spoilt
  cached piece size: ``test_stream.py``'s ``test_streamed_rerun_takes_its_chunk_from_the_plan_cache[pieces]``.)"""
  batches, budget, _ = data
  with overlapping(sent_ahead):
    first = _trainer(num_micro_batch='auto', memory_budget=budget, cache=tmp_path)
    first.fit(batches[:1], num_epoch=1)
  written = sorted(os.listdir(tmp_path / 'plans'))
  assert (SIZE in first.stream_chunks) == sent_ahead
  assert len(written) == (1 + _steps_of(first, SIZE) if sent_ahead else 1)  # the pieces' size and plans
  capsys.readouterr()

  model = _model()
  rerun = _trainer(model, num_micro_batch='auto', memory_budget=budget, cache=tmp_path)
  probes = _recorded_probes(rerun)
  with overlapping(sent_ahead), count_compilations() as compiled:
    rerun.fit(batches, num_epoch=1)
  assert 'from the plan cache' in capsys.readouterr().out
  assert probes == [] and sorted(os.listdir(tmp_path / 'plans')) == written  # nothing searched or written anew
  plan, steps = rerun.plan_for(SIZE), _steps_of(rerun, SIZE)
  assert plan == first.plan_for(SIZE) and rerun.stream_chunks == first.stream_chunks
  assert all(used <= budget for _, used in rerun.memory_plans.values())
  assert rerun.compilations['fit'] == steps and compiled() <= steps + 2  # the steps (measured again), the loss check
  assert_trees_close(params_of(model), _fit_fixed(plan.micro_batch_size, batches))


def _write_entry(tmp_path, change):
  """Plan once into ``tmp_path``, then ``change(entry)`` the stored JSON; the path of the file."""
  batches, budget, _ = _write_entry.data
  _trainer(num_micro_batch='auto', memory_budget=budget, cache=tmp_path).fit(batches[:1], num_epoch=1)
  path, = [tmp_path / 'plans' / name for name in os.listdir(tmp_path / 'plans')]
  path.write_text(change(json.loads(path.read_text())))
  return path


@pytest.mark.parametrize('change, note', [
  (lambda entry: '{"format": 1, "key": ', 'unreadable'),                     # a half-written file
  (lambda entry: json.dumps(dict(entry, key={'model': 'another'})), 'another model'),  # a foreign entry
  (lambda entry: json.dumps(dict(entry, format=0)), 'another format'),
  (lambda entry: json.dumps(dict(entry, plan=dict(entry['plan'], micro_batch_size=SIZE))), 'over memory_budget'),
  (lambda entry: json.dumps(dict(entry, plan=dict(entry['plan'], micro_batch_size='x'))), 'does not describe'),
  (lambda entry: json.dumps(dict(entry, plan=dict(entry['plan'], micro_batch_size=True))), 'does not describe'),
  (lambda entry: json.dumps(dict(entry, plan=dict(entry['plan'], remat=-2))), 'does not describe'),
])
def test_corrupt_foreign_or_stale_entries_are_ignored_with_a_note_and_replanned(data, tmp_path, change, note):
  """The batch's own plan, one entry, on every device: its data is handed to its step, not sent ahead (where it
  is sent ahead it streams in pieces: ``test_stream.py`` spoils their cached piece size)."""
  _write_entry.data = data
  batches, budget, _ = data
  with overlapping(False):
    path = _write_entry(tmp_path, change)
    model = _model()
    trainer = _trainer(model, num_micro_batch='auto', memory_budget=budget, cache=tmp_path)
    with pytest.warns(UserWarning, match=f'plan cache: .*{note}') as notes:
      trainer.fit(batches, num_epoch=1)
  assert len([n for n in notes if 'plan cache' in str(n.message)]) == 1
  plan, used = trainer.memory_plans[SIZE]
  assert plan.micro_batch_size == 8 and used <= budget
  assert json.loads(path.read_text())['plan']['micro_batch_size'] == 8  # written anew, whole
  assert_trees_close(params_of(model), _fit_fixed(8, batches))


def test_writers_at_once_leave_a_whole_entry(tmp_path):
  cache, key = PlanCache(str(tmp_path)), {'k': 1}

  def write(n):
    for i in range(50):
      cache.put(key, {'fits': True, 'micro_batch_size': n, 'round': i})

  writers = [threading.Thread(target=write, args=(n,)) for n in (3, 5)]
  for w in writers:
    w.start()
  for w in writers:
    w.join()
  assert cache.get(key)['micro_batch_size'] in (3, 5) and cache.get(key)['round'] == 49
  assert os.listdir(tmp_path / 'plans') == [os.path.basename(cache.path(key))]  # no temporary file left


def test_cache_folder_and_switch(monkeypatch, tmp_path):
  monkeypatch.setenv('BRAINPY_ACCUM_CACHE', '1')
  monkeypatch.setenv('BRAINPY_ACCUM_CACHE_DIR', str(tmp_path))
  assert cache_folder(True) == str(tmp_path)
  monkeypatch.delenv('BRAINPY_ACCUM_CACHE_DIR')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert cache_folder(True) == str(tmp_path / 'xdg' / 'brainpy_accum')
  monkeypatch.setenv('BRAINPY_ACCUM_CACHE', 'off')
  assert cache_folder(True) is None and cache_folder(False) is None
  assert cache_folder(tmp_path / 'named') == str(tmp_path / 'named')  # named by the trainer: used anyway
  # JAX's cache folder, already set (the suite sets one), is kept
  before = jax.config.jax_compilation_cache_dir
  assert before and use_compilation_cache(str(tmp_path)) == before == jax.config.jax_compilation_cache_dir
  with pytest.raises(TypeError, match=r"cache=3 must be True \(the default folder\), False \(no caches\) or a folder"):
    _trainer(num_micro_batch=2, cache=3)


def test_a_batch_that_fits_whole_says_one_micro_batch(capsys):
  x, y = make_batches((6,), num_time=4, n_in=4, n_out=3)[0]
  trainer = _trainer(num_micro_batch='auto', memory_budget='1GiB', cache=False)
  trainer.target.reset(6)
  trainer.plan_memory(x, y)
  assert '(1 micro-batch)' in capsys.readouterr().out


def test_code_digest_does_not_depend_on_reference_counts():
  """The plan key's digest of a function's code is the same however many references its constants have
  (``marshal.dumps`` is not: its reference flags follow the counts, which gave one loss two keys in one
  process, and a cached entry that the next trainer did not find)."""
  namespace = {}
  exec("def loss(p, t):\n  return ((p - t) ** 2).mean() * 1.5 + len('a constant string, not interned!')\n", namespace)
  code = namespace['loss'].__code__
  before, marshalled = _code(namespace['loss']), marshal.dumps(code)
  held = list(code.co_consts) * 3  # more references to the constants
  assert marshal.dumps(code) != marshalled  # the effect the digest must not have (CPython)
  assert _code(namespace['loss']) == before and held


_CACHE_EVENTS = {'/jax/compilation_cache/compile_requests_use_cache': 0, '/jax/compilation_cache/cache_hits': 0}


def _count_cache_event(event, **kwargs):
  if event in _CACHE_EVENTS:
    _CACHE_EVENTS[event] += 1


jax.monitoring.register_event_listener(_count_cache_event)


def test_rerun_with_a_cached_plan_compiles_nothing_new_the_loss_check_included(data, tmp_path):
  """A checked loss (not one of BrainPy's means over elements): the rerun reads its plan and checks the loss
  cut as the first run did, so every compilation of the rerun, the check's (on its own thread) included,
  is found in JAX's persistent cache."""
  batches, budget, _ = data
  mean_of_squares = lambda predicts, targets: bp.losses.mean_squared_error(predicts, targets)

  def fit():
    model = _model()
    AccumBPTT(model, mean_of_squares, optimizer=bp.optim.Adam(lr=0.05), num_micro_batch='auto',
              memory_budget=budget, progress_bar=False, cache=tmp_path).fit(batches, num_epoch=1)
    return params_of(model)

  first = fit()
  before = dict(_CACHE_EVENTS)
  again = fit()
  requests, hits = (_CACHE_EVENTS[e] - before[e] for e in _CACHE_EVENTS)
  assert requests >= 2 and hits == requests  # the step and the check at least; nothing compiled anew
  assert_trees_close(again, first)


@pytest.mark.parametrize('tpu_path', [False, True])
def test_first_fit_phases_add_up_to_the_fit_and_hold_the_planners_compilations(data, tpu_path):
  """The start-up bench's phases (:mod:`~brainpy_accum.diagnostics._phases`): the planner's quick probes and its
  compilation for training are where they happen, nothing is counted twice (the phases on the fit's thread add up
  to the whole span), and no compilation is lost. Both paths on every device: quick probes first (a CPU's), and
  the whole batch compiled for training first with the data sent ahead (a TPU's: no quick probe need run)."""
  batches, budget, _ = data
  trainer = _trainer(num_micro_batch='auto', memory_budget=budget, cache=False)
  with whole_first(tpu_path), overlapping(tpu_path), record_phases() as recorded, count_compilations() as compiled:
    trainer.fit(batches, num_epoch=1)
  table = recorded.table()
  assert table['planned step compiles']['compilations'] >= 1
  assert tpu_path or table['planning probes']['compilations'] >= 1
  for name in ('planning probes', 'planned step compiles'):  # each of the planner's compilations, with its plan
    events = [note for phase_name, note, _ in recorded.events if phase_name == name]
    assert len(events) >= table[name]['compilations'] and all(note.startswith('batch ') for note in events), events
  assert table['trial runs']['seconds'] == 0  # (remat=False: no trial steps)
  assert sum(table[name]['seconds'] for name in PHASES) == pytest.approx(table['total']['seconds'], abs=1e-6)
  assert table['total']['compilations'] >= compiled()  # (the check's thread, beside, is not counted by compiled)


@pytest.mark.parametrize('remat, sent_ahead', [(False, False), ('auto', False), (False, True)])
def test_whole_first_a_batch_that_fits_is_compiled_once_and_one_that_does_not_plans_as_before(data, remat,
                                                                                             sent_ahead):
  """Where the planner compiles the batch in one micro-batch for training first (a TPU's way, forced here on the
  CPU): a batch that fits is planned with that one compilation, no quick probe, and trains as the fixed plan of
  one micro-batch, also where the batch is sent ahead (the TPU's way with NumPy data: whether to stream it in
  pieces is decided by that compilation); one that does not fit is planned as the quick probes plan it, without
  probing the whole batch again."""
  batches, budget, need = data
  roomy = _trainer(num_micro_batch='auto', memory_budget='1GiB', remat=remat, cache=False)
  probes = _recorded_probes(roomy)
  with whole_first(True), overlapping(sent_ahead), count_compilations() as compiled:
    roomy.fit(batches, num_epoch=1)
  assert probes == [] and roomy.plan_for(SIZE).num_micro_batches == 1 and roomy.compilations['fit'] == 1
  assert compiled() <= 3  # the step; (the loss check is skipped: a mean over elements), small ones
  assert_trees_close(params_of(roomy.target), _fit_fixed(SIZE, batches))

  tight = _trainer(num_micro_batch='auto', memory_budget=budget, remat=remat, cache=False)
  probes = _recorded_probes(tight)
  with whole_first(True):
    tight.fit(batches, num_epoch=1)
  planned = _trainer(num_micro_batch='auto', memory_budget=budget, remat=remat, cache=False)
  planned.fit(batches, num_epoch=1)
  assert all(p.micro_batch_size < SIZE or p.remat for p in probes)  # (the whole batch without remat: compiled)
  if remat is False:
    assert tight.plan_for(SIZE) == planned.plan_for(SIZE)
  else:  # the same candidates, measured alike (which wins is timed), for every size planned: on a TPU a NumPy
    # batch that does not fit is streamed in pieces, so the sizes weighed are the pieces', not the batch's
    weighed = lambda trainer: {size: [c[:4] for c in candidates]  # noqa: E731
                               for size, candidates in trainer.planner.weighed_plans.items()}
    assert weighed(tight) == weighed(planned) and weighed(tight)


@pytest.mark.long  # about 5 s: two fits; README suite time
def test_whole_first_a_cached_plan_of_a_batch_sent_ahead_is_compiled_once(data, tmp_path, monkeypatch):
  """A TPU's path with the plan cache: the rerun's whole-batch step, compiled for training to decide whether to
  stream the batch in pieces, is the cached plan's step: compiled once, not again for the cache."""
  batches = data[0]
  trials = []
  real = CompiledSteps._compiled_for_training
  monkeypatch.setattr(CompiledSteps, '_compiled_for_training',
                      lambda self, plan, *args, **kwargs: trials.append(plan) or real(self, plan, *args, **kwargs))
  for run in ('first', 'rerun'):
    trials.clear()
    trainer = _trainer(num_micro_batch='auto', memory_budget='1GiB', cache=tmp_path)
    with whole_first(True), overlapping(True):
      trainer.fit(batches, num_epoch=1)
    assert trainer.plan_for(SIZE).num_micro_batches == 1
    assert [plan.micro_batch_size for plan in trials] == [SIZE], (run, trials)


def test_whole_first_pieces_search_starts_where_the_whole_batch_predicts(monkeypatch):
  """A TPU's path, forced on the CPU: the whole batch's compilation, which decides that the batch streams in
  pieces, scaled to a piece's samples is where the pieces' search starts, so half the batch (far above the piece
  that fits) is not compiled; the piece chosen is the one the search finds without that guess. A batch of 48, a
  budget for pieces of 8 and not of the next size up (10; 16 on a TPU, whose sizes above 8 are multiples of 8),
  which divides the batch: the piece is the largest size that fits, measured by the search itself."""
  size = 2 * SIZE
  batches = make_batches((size,), num_time=NUM_TIME, n_in=4, n_out=3)
  budget = _piece_budget(batches[0], 8, min(s for s in candidate_micro_batch_sizes(size) if s > 8))
  trials, real = [], CompiledSteps._compiled_for_training
  monkeypatch.setattr(CompiledSteps, '_compiled_for_training', lambda self, plan, *args, **kwargs: trials.append(
    plan.batch_size) or real(self, plan, *args, **kwargs))
  trainer = _trainer(num_micro_batch='auto', memory_budget=budget, cache=False)
  with overlapping(True), whole_first(True):
    trainer.plan_memory(*batches[0])
  assert trainer.stream_chunks[size] <= size // 3 and trials[0] == size, (trainer.stream_chunks, trials)
  if device_tile() == 1:  # (on a TPU this tiny model's whole batch, its 4 input features padded to 128 lanes, takes
    # several times its pieces' bytes per sample: the guess scaled from it is far off; the answer is still exact)
    assert size // 2 not in trials and len(trials) <= 3, trials
  unguided = _trainer(num_micro_batch='auto', memory_budget=budget, cache=False)
  monkeypatch.setattr(unguided.planner.streaming, '_whole_bytes', lambda request: None)
  with overlapping(True), whole_first(True):
    unguided.plan_memory(*batches[0])
  assert unguided.stream_chunks == trainer.stream_chunks


def test_whole_first_pieces_whose_data_alone_exceed_the_budget_cost_no_compilation(monkeypatch):
  """A TPU's path, forced on the CPU: a batch of 48 whose pieces of 24 are known not to fit by arithmetic (their
  data alone over the budget: not compiled; made so here for every BrainPy and JAX version, whose steps' bytes
  differ) streams in pieces with two compilations, the answer's and the next size's, where a figure made up for the
  24 (just over the budget) led the search to compile four (the small rate RNN of the start-up bench: seven). The
  piece is the one found where the 24 is compiled and measured too."""
  size, n_in = 2 * SIZE, 64
  batches = make_batches((size,), num_time=NUM_TIME, n_in=n_in, n_out=3)
  model = lambda: make_model('rnn', n_in=n_in, n_hidden=32, n_out=3)  # noqa: E731
  budget = _piece_budget(batches[0], 8, min(s for s in candidate_micro_batch_sizes(size) if s > 8), model)
  trials, refused = [], []
  real, real_data = CompiledSteps._compiled_for_training, ChunkSearch.chunk_data
  monkeypatch.setattr(CompiledSteps, '_compiled_for_training', lambda self, plan, *args, **kwargs: trials.append(
    plan.batch_size) or real(self, plan, *args, **kwargs))
  monkeypatch.setattr(ChunkSearch, 'chunk_data', lambda self, chunk: (
    None if chunk >= size // 2 else real_data(self, chunk)) or refused.append(chunk))
  trainer = _trainer(model(), num_micro_batch='auto', memory_budget=budget, cache=False)
  with overlapping(True), whole_first(True):
    trainer.plan_memory(*batches[0])
  piece = trainer.stream_chunks[size]
  assert piece in trials and len(trials) == len(set(trials)), trials
  assert not [t for t in trials if size // 2 <= t < size] and min(refused, default=size) > piece, (refused, trials)
  if device_tile() == 1:  # (a TPU's search, guided from below by a whole batch that its tiles pad several-fold more
    # than the pieces, finds the 16 too large before it reaches the 24: a TPU v5e compiled 1, 2, 7, 8 and 16)
    assert refused and len(trials) <= 2, (refused, trials)
  monkeypatch.setattr(ChunkSearch, 'chunk_data', lambda self, chunk: self._chunk_of(chunk))  # every size measured
  measured = _trainer(model(), num_micro_batch='auto', memory_budget=budget, cache=False)
  with overlapping(True), whole_first(True):
    measured.plan_memory(*batches[0])
  assert measured.stream_chunks == trainer.stream_chunks  # (so the 24 does not fit: a piece below it is chosen)


def test_whole_first_plans_pieces_sent_ahead_and_trains_as_the_fixed_plan(data, piece_budget, monkeypatch):
  """A TPU's path, forced on the CPU: the batch sent ahead streams in pieces of one micro-batch, each piece's step
  compiled for training first, and the chosen piece's compilation is the one its plan keeps: no step is compiled
  for training twice, and the piece is not probed quickly beside; the run trains as the fixed plan of the pieces'
  size."""
  batches, budget = data[0], piece_budget
  trials, real = [], CompiledSteps._compiled_for_training
  monkeypatch.setattr(CompiledSteps, '_compiled_for_training', lambda self, plan, *args, **kwargs: trials.append(
    (plan.batch_size, plan.micro_batch_size, kwargs.get('via_window', args[3] if len(args) > 3 else False)))
    or real(self, plan, *args, **kwargs))
  model = _model()
  trainer = _trainer(model, num_micro_batch='auto', memory_budget=budget, cache=False)
  probes = _recorded_probes(trainer)
  with overlapping(True), whole_first(True):
    trainer.fit(batches, num_epoch=1)
  assert SIZE in trainer.stream_chunks
  piece = trainer.stream_chunks[SIZE]
  assert (piece, piece, True) in trials and len(trials) == len(set(trials)), trials
  assert all(p.batch_size != piece for p in probes), probes
  assert_trees_close(params_of(model), _fit_fixed(trainer.plan_for(SIZE).micro_batch_size, batches))


def test_whole_first_a_batch_that_fits_traces_no_first_batch_check(data):
  """A TPU's path, forced on the CPU: the planner's first compilation, the whole batch's for training, is most
  often the plan, and a batch in one micro-batch has nothing to check; so the check is not traced nor compiled
  before that search (it cost a small rate RNN 0.6 s of a 2.3 s first epoch on a TPU v5e), and where the batch
  does not fit it still runs, at the first step."""
  batches, budget, _ = data
  loss = lambda predicts, targets: bp.losses.mean_squared_error(predicts, targets)  # noqa: E731 (not skipped)
  for memory_budget, checked in (('1GiB', False), (budget, True)):
    trainer = _trainer(loss=loss, num_micro_batch='auto', memory_budget=memory_budget, cache=False)
    with whole_first(True), record_phases() as recorded:
      trainer.fit(batches, num_epoch=1)
    table = recorded.table()
    assert (table['beside']['compilations'] > 0) == checked, (memory_budget, table['beside'])  # the check's own
    assert (trainer.plan_for(SIZE).num_micro_batches > 1) == checked


@pytest.mark.parametrize('sent_ahead', [False, True])
def test_whole_first_a_coupled_loss_still_warns_once(data, piece_budget, sent_ahead):
  """A TPU's path, forced on the CPU, the check started only once the plan is known: a loss that couples the
  samples (a batch-wide mean subtracted) warns once where the batch is cut, in micro-batches or (sent ahead) in
  streamed pieces."""
  batches, budget, _ = data

  def coupled(predicts, targets):
    return bp.losses.mean_squared_error(predicts - predicts.mean(), targets)

  trainer = _trainer(loss=coupled, num_micro_batch='auto', memory_budget=piece_budget if sent_ahead else budget,
                     cache=False)
  with whole_first(True), overlapping(sent_ahead), pytest.warns(UserWarning, match='couples the samples') as record:
    trainer.fit(batches, num_epoch=2)
  assert sum('couples the samples' in str(w.message) for w in record) == 1
  if sent_ahead:
    assert SIZE in trainer.stream_chunks
  else:
    assert SIZE not in trainer.stream_chunks and trainer.plan_for(SIZE).num_micro_batches > 1
