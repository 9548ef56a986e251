"""The device's own memory, on a CPU standing in for an accelerator (:mod:`simulated_device`).

A GPU or TPU reports its memory limit, and XLA refuses at compile time a program larger than the device
(``RESOURCE_EXHAUSTED``). On such a device ``num_micro_batch='auto'`` plans against the device's memory when no
``memory_budget`` is given, planning takes a refusal as a measurement (never an error), and a fixed cut whose
step is refused gets an error naming the cut that fits. The same on a real device: ``test_accelerator.py``.
"""

import re

import brainpy as bp
import numpy as np
import pytest

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.memory._device import DEVICE_MARGIN, Budget
from helpers import (SIMULATED_DEVICE, assert_trees_close, make_batches, make_model, optimizer_state, params_of,
                     tpu_tiles)
from brainpy_accum.trainer._feed import overlapping, prefetch_bytes
from simulated_device import simulated_device
from test_stream import _batches as stream_batches, _budget as stream_budget, _model as stream_model

FIT = bp.tools.DotDict(fit=True)
SIZE, N_IN, N_HIDDEN, N_OUT, T = 24, 4, 32, 3, 20

pytestmark = SIMULATED_DEVICE


def _model():
  return make_model('rnn', n_in=N_IN, n_hidden=N_HIDDEN, n_out=N_OUT)


def _batches(sizes=(SIZE, SIZE)):
  return make_batches(sizes, num_time=T, n_in=N_IN, n_out=N_OUT)


def _trainer(**options):
  return AccumBPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                   **options)


def _bptt(batches, **fit):
  reference = bp.BPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit(batches, num_epoch=2, **fit)
  return reference


def _step_bytes(num_micro_batch: int, x, y, **options) -> int:
  """XLA's measure of the train step cut into ``num_micro_batch`` (on the CPU, no device simulated)."""
  probe = _trainer(num_micro_batch='auto', memory_budget='1GiB', cache=False, **options)
  probe.target.reset(len(x))
  return probe.compiled_step_bytes(plan_micro_batches(len(x), num_micro_batch=num_micro_batch), FIT, x, y)


@pytest.fixture(scope='module')
def sizes():
  """The steps of the whole batch and of its halves and quarters, and a device limit between the whole
  batch's step and its halves' (with the margin the device's budget keeps)."""
  x, y = _batches()[0]
  whole, half, quarter = (_step_bytes(n, x, y) for n in (1, 2, 4))
  limit = (whole + int(half / (1 - DEVICE_MARGIN)) + 2048) // 2
  assert half / (1 - DEVICE_MARGIN) + 1024 < limit < whole  # the case these tests are about
  return {'whole': whole, 'half': half, 'quarter': quarter, 'limit': limit}


@pytest.mark.parametrize('as_on_a_tpu', [False, True], ids=['cut', 'pieces'])
def test_auto_without_a_budget_plans_against_the_device_and_trains_as_bptt(monkeypatch, sizes, capsys, as_on_a_tpu):
  """The whole batch's step does not fit the device: it is refused, planning takes that as 'does not fit', and the
  batch is cut, with no error; training equals bp.BPTT's. ``as_on_a_tpu``: batches sent to the device ahead and
  sizes in a TPU's tiles, the path of ``test_accelerator.py``'s batch that the chip cannot hold whole: the NumPy
  batch streams in pieces of one micro-batch, each step within the device's budget."""
  batches = _batches()
  if as_on_a_tpu:
    tpu_tiles(monkeypatch)
  with overlapping(as_on_a_tpu), simulated_device(monkeypatch, sizes['limit'], in_use=1000) as refused:
    trainer = _trainer(num_micro_batch='auto', cache=False)
    plan = trainer.plan_memory(*batches[0])  # no out-of-memory error
    trainer.fit(batches, num_epoch=2)
  budget = trainer.planner.budget
  assert budget <= (1 - DEVICE_MARGIN) * sizes['limit'] and budget >= sizes['half']
  assert trainer.memory_budget is None and trainer.num_micro_batch_for(SIZE) > 1
  assert (SIZE in trainer.stream_chunks) == as_on_a_tpu  # on a GPU or TPU, a NumPy batch streams in pieces
  assert trainer.memory_plans[plan.batch_size][1] <= budget  # the step that runs: the batch's, or a piece's
  assert all(used <= budget for _, used in trainer.memory_plans.values())
  if not as_on_a_tpu:
    assert plan.num_micro_batches == 2
  assert refused and min(refused) >= sizes['whole']  # the whole batch's step was refused, as measured on the CPU
  out = capsys.readouterr().out
  assert "of the device's memory (" in out and 'TPU (simulated on the CPU)' in out
  reference = _bptt(batches)  # the whole batch on the CPU, where nothing refuses it
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  np.testing.assert_allclose(trainer.train_losses, reference.train_losses, rtol=1e-5)


def test_a_share_of_the_device_is_a_budget(monkeypatch, sizes):
  with simulated_device(monkeypatch, sizes['limit']):
    trainer = _trainer(num_micro_batch='auto', memory_budget='90%', cache=False)
    budget = trainer.planner.budget
  grain = sizes['limit'] // 1024
  assert budget == int(0.9 * sizes['limit']) // grain * grain and trainer.memory_budget == '90%'


def test_the_device_budget_leaves_out_what_other_arrays_hold(monkeypatch):
  """Of the bytes in use, those of the trainer's own Variables (the step's arguments, counted in its memory) are
  not taken off again; the rest is."""
  limit, grain = 1024 * 1000, 1000
  with simulated_device(monkeypatch, limit, in_use=300_000):
    assert Budget(None).bytes(held=lambda: 100_000) == (int((1 - DEVICE_MARGIN) * limit) - 200_000) // grain * grain
    assert Budget('50%').bytes(held=lambda: 400_000) == limit // 2 // grain * grain
    budget = Budget('50%')
    assert "the device's memory (50%)" == budget.describe()
    budget.bytes()
    assert budget.bytes() == 212_000 and budget.describe() == (
      "the device's memory (207.0 KiB of TPU (simulated on the CPU): 50% of its limit 1000.0 KiB less 293.0 KiB "
      "held by other arrays)")


@pytest.mark.parametrize('options', [pytest.param(dict(remat='auto'), marks=pytest.mark.long), dict(accumulate_steps=2)],
                         ids=['remat_auto', 'window'])  # remat_auto in the long suite: README suite time
def test_planning_takes_a_refusal_as_a_measurement(monkeypatch, sizes, options):
  """A budget named above the device's memory: every plan the device refuses is measured as not fitting, and the
  plan found fits the device; training equals bp.BPTT's (on the windows' batches with accumulate_steps)."""
  batches = _batches()
  with simulated_device(monkeypatch, sizes['limit']) as refused:
    trainer = _trainer(num_micro_batch='auto', memory_budget=10 * sizes['whole'], cache=False, **options)
    trainer.fit(batches, num_epoch=2)
  plan, used = trainer.memory_plans[SIZE]
  assert refused and (plan.num_micro_batches > 1 or plan.remat) and used <= sizes['limit']  # cut, or remat
  whole = [(np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches]))]
  reference = _bptt(whole if options.get('accumulate_steps') else batches)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))


def test_a_cached_plan_the_device_refuses_is_planned_anew(monkeypatch, sizes, tmp_path):
  batches = _batches()
  first = _trainer(num_micro_batch='auto', memory_budget=10 * sizes['whole'], cache=tmp_path)
  first.fit(batches, num_epoch=1)
  assert first.plan_for(SIZE).num_micro_batches == 1  # cached: the whole batch in one piece
  with simulated_device(monkeypatch, sizes['limit']), pytest.warns(UserWarning, match='plan cache: the cached plan'):
    rerun = _trainer(num_micro_batch='auto', memory_budget=10 * sizes['whole'], cache=tmp_path)
    rerun.fit(batches, num_epoch=2)
  assert rerun.plan_for(SIZE).num_micro_batches > 1 and rerun.memory_plans[SIZE][1] <= sizes['limit']
  assert_trees_close(params_of(rerun.target), params_of(_bptt(batches).target))


@pytest.mark.parametrize('option', ['num_micro_batch', 'micro_batch_size'])
def test_a_fixed_cut_the_device_refuses_names_the_cut_that_fits(monkeypatch, sizes, option):
  """num_micro_batch=1 (or micro-batches of the whole batch) on a device that refuses that step: a MemoryError
  before anything changes, naming the step's size, the device's limit and the cut that fits."""
  trainer = _trainer(**{option: 1 if option == 'num_micro_batch' else SIZE})
  before = params_of(trainer.target), optimizer_state(trainer)
  fits = 'num_micro_batch=2' if option == 'num_micro_batch' else f'micro_batch_size={SIZE // 2}'
  with simulated_device(monkeypatch, sizes['limit']):
    with pytest.raises(MemoryError, match=rf'does not fit the device: XLA refused to compile it, as it needs .* more '
                                          rf'than the .* of the TPU \(simulated on the CPU\) device; nothing was run '
                                          rf'or changed\. {fits} fits \(2 micro-batches of {SIZE // 2}'):
      trainer.fit(_batches(), num_epoch=1)
  assert_trees_close(params_of(trainer.target), before[0], rtol=0, atol=0)
  assert_trees_close(optimizer_state(trainer), before[1], rtol=0, atol=0)


def test_without_a_device_limit_the_budget_must_be_named():
  with pytest.raises(ValueError, match="needs memory_budget, e.g. memory_budget='2GiB': without one it plans against "
                                       "the device's own memory, but the CPU device reports no memory limit"):
    _trainer(num_micro_batch='auto')
  with pytest.raises(ValueError, match=r"memory_budget='90%' is a share of the device's memory, but the CPU device "
                                       r"reports no memory limit \(a CPU has none\): pass the bytes"):
    _trainer(num_micro_batch='auto', memory_budget='90%')
  with pytest.raises(ValueError, match=r"memory_budget='150%' must be a share of the device between 0% and 100%"):
    _trainer(num_micro_batch='auto', memory_budget='150%')


@pytest.mark.extended  # CI leaves it out for its time budget (python -m pytest -q --long -m extended)
@pytest.mark.long  # the long suite (--long): a chunk search, as test_stream.py's
def test_a_batch_larger_than_the_device_is_streamed_in_chunks_it_holds(monkeypatch):
  """No budget named, a batch whose data is three times the device: streamed from the host in chunks whose steps
  the device holds (every chunk step it refuses is measured as not fitting), with bp.BPTT's update (the
  spiking network and data of ``test_stream.py``)."""
  batches = stream_batches((48, 48))
  with simulated_device(monkeypatch, int(stream_budget(batches) / (1 - DEVICE_MARGIN))) as refused:
    trainer = AccumBPTT(stream_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01),
                        progress_bar=False, num_micro_batch='auto', cache=False)
    trainer.fit(batches, num_epoch=2)
  chunk = trainer.stream_chunks[48]
  assert refused and chunk < 48 and trainer.memory_plans[chunk][1] <= trainer.planner.budget
  reference = bp.BPTT(stream_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01),
                      progress_bar=False)
  reference.fit(batches, num_epoch=2)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  np.testing.assert_allclose(trainer.train_losses, reference.train_losses, rtol=1e-5)


def test_the_batch_sent_ahead_counts_in_the_plan(sizes):
  """Where fit sends data to the device while a step runs (on an accelerator; here forced), the plan leaves room
  for it: a budget that holds the halves' step but not it and the batch sent ahead streams the batch in pieces
  of one micro-batch, whose step and the next piece sent ahead fit."""
  x, y = _batches()[0]
  ahead = prefetch_bytes(x, y)
  budget = sizes['half'] + ahead // 2
  assert ahead > 0 and sizes['half'] <= budget < sizes['half'] + ahead < sizes['whole']
  with overlapping(False):
    trainer = _trainer(num_micro_batch='auto', memory_budget=budget, cache=False)
    trainer.target.reset(SIZE)
    assert trainer.plan_memory(x, y).num_micro_batches == 2 and trainer.memory_plans[SIZE][1] == sizes['half']
  with overlapping(True):
    trainer = _trainer(num_micro_batch='auto', memory_budget=budget, cache=False)
    trainer.target.reset(SIZE)
    plan = trainer.plan_memory(x, y)
  piece = trainer.stream_chunks[SIZE]
  assert plan.num_micro_batches == 1 and plan.batch_size == piece < SIZE
  assert trainer.memory_plans[piece][1] <= budget


def test_a_refused_fixed_cut_whose_halves_are_refused_too_names_the_finer_cut_that_fits(monkeypatch, sizes):
  """The search for the cut that fits takes every refusal on its way as a measurement too (a device that refuses
  the whole batch and its halves, not its quarters)."""
  limit = (sizes['half'] + int(sizes['quarter'] / (1 - DEVICE_MARGIN)) + 2048) // 2
  assert sizes['quarter'] / (1 - DEVICE_MARGIN) + 1024 < limit < sizes['half']  # the case this test is about
  trainer = _trainer(num_micro_batch=1)
  with simulated_device(monkeypatch, limit) as refused:
    with pytest.raises(MemoryError, match=r'num_micro_batch=1\) does not fit the device: .* needs at least .* '
                                          r'nothing was run or changed\. num_micro_batch=(\d+) fits') as error:
      trainer.fit(_batches(), num_epoch=1)
  fits = int(re.search(r'num_micro_batch=(\d+) fits', str(error.value)).group(1))
  assert fits > 2 and len(refused) >= 2  # the whole batch's step and its halves' refused, a finer cut named


def test_a_device_too_small_for_one_sample_names_the_fixes_that_remain(monkeypatch):
  """With the device's own memory as the budget there is no memory_budget to raise: the error names the device's
  budget and the other fixes, before anything changes."""
  with simulated_device(monkeypatch, 30_000):
    trainer = _trainer(num_micro_batch='auto', cache=False)
    before = params_of(trainer.target)
    with pytest.raises(ValueError, match=r"The train step of batch 24, even streamed from the host one sample at a "
                                         r"time, needs .* "
                                         r"more than the device's memory \(.* of TPU \(simulated on the CPU\): its "
                                         r"limit .* and a margin of 5%\)\. Use remat=True, fewer time steps, smaller "
                                         r"batches or a device with more memory\."):
      trainer.fit(_batches(), num_epoch=1)
  assert_trees_close(params_of(trainer.target), before, rtol=0, atol=0)
