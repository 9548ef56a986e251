"""``remat='auto'``: the planner keeps the fastest (micro-batches, remat) plan that fits, and trains as bp.BPTT."""

import brainpy as bp
import brainpy.math as bm
import jax
import numpy as np
import pytest

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.memory._fastest import choose_fastest_plan, finer_sizes
from helpers import NO_DEVICE_LIMIT, TINY_SIZES, assert_trees_close, make_batches, make_model, params_of, tpu_tiles

FIT = bp.tools.DotDict(fit=True)
NUM_TIME = 60


def _model():
  return make_model('rnn', n_in=8, n_hidden=64, n_out=4)


def _trainer(model=None, **kwargs):
  return AccumBPTT(model or _model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                   progress_bar=False, **kwargs)


def _step_bytes(batch_size, remat, x, y):
  trainer = _trainer(num_micro_batch=1, remat=remat)
  trainer.target.reset(batch_size)
  return trainer.compiled_step_bytes(plan_micro_batches(batch_size, num_micro_batch=1), FIT, x, y)


def _every_value(trainer):
  """Every Variable of the trainer (parameters, model states, optimizer) and the global random key."""
  key = bm.random.DEFAULT.value
  key = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  return [np.asarray(v.value) for v in trainer.vars().unique().values()] + [np.asarray(key)]


def micro_batches_cost_more_than_remat(plans):
  """A deterministic cost model: each micro-batch costs 1, remat adds half of it."""
  return [plan.num_micro_batches * (1.5 if plan.remat else 1.) for plan in plans]


def remat_costs_more_than_micro_batches(plans):
  return [plan.num_micro_batches * 0.1 + (1. if plan.remat else 0.) for plan in plans]


@pytest.fixture(scope='module')
def remat_only_budget():
  """A batch and a budget that remat meets at one micro-batch, and that storing every step does not."""
  x, y = make_batches((48,), num_time=NUM_TIME, n_in=8, n_out=4)[0]
  with_remat, without = _step_bytes(48, True, x, y), _step_bytes(48, False, x, y)
  assert with_remat < without
  return x, y, with_remat


@pytest.mark.parametrize('kwargs', [dict(remat='auto'), dict(remat='auto', num_micro_batch=4),
                                    dict(remat='auto', micro_batch_size=8)])
def test_remat_auto_without_the_memory_planner_is_named(kwargs):
  with pytest.raises(ValueError, match=r"remat='auto' .* needs num_micro_batch='auto' and a memory_budget; got "
                                       r"num_micro_batch=.* Add num_micro_batch='auto'"):
    _trainer(**kwargs)


@NO_DEVICE_LIMIT
def test_remat_auto_without_a_budget_is_named():
  with pytest.raises(ValueError, match="needs memory_budget"):
    _trainer(num_micro_batch='auto', remat='auto')


# The largest micro-batch of a batch of 64 whose step (4 bytes a sample, remat 1) fits 100 bytes: 25 samples would,
# of the sizes the planner tries: ceil(64 / 3) = 22 where every size is tried (a CPU, a GPU), 24 (22 rounded up to
# a multiple of 8) where sizes are rounded to a TPU's tiles.
LARGEST_WITHOUT_REMAT = {1: 22, 128: 24}


@pytest.mark.parametrize('tile', sorted(LARGEST_WITHOUT_REMAT), ids=['every-size', 'tpu-tiles'])
def test_fastest_plan_is_remat_when_micro_batches_cost_more(monkeypatch, tile):
  tpu_tiles(monkeypatch, tile)
  need = lambda size, remat: size * (1 if remat else 4)
  cost = lambda pairs: micro_batches_cost_more_than_remat(
    [plan_micro_batches(64, micro_batch_size=s)._replace(remat=r) for s, r in pairs])
  chosen, weighed = choose_fastest_plan(64, 100, need, cost)
  assert (chosen.micro_batch_size, chosen.remat, chosen.fits) == (64, True, True)
  assert all(c.bytes <= 100 for c in weighed if c.fits) and any(not c.fits for c in weighed)
  # remat is weighed only above the largest micro-batch that fits without it
  assert max(c.micro_batch_size for c in weighed if not c.remat and c.fits) == LARGEST_WITHOUT_REMAT[tile]
  assert {c.micro_batch_size for c in weighed if c.remat and c.fits} == {64, 32}


@pytest.mark.parametrize('tile', sorted(LARGEST_WITHOUT_REMAT), ids=['every-size', 'tpu-tiles'])
def test_fastest_plan_keeps_micro_batches_when_remat_costs_more(monkeypatch, tile):
  tpu_tiles(monkeypatch, tile)
  need = lambda size, remat: size * (1 if remat else 4)
  cost = lambda pairs: remat_costs_more_than_micro_batches(
    [plan_micro_batches(64, micro_batch_size=s)._replace(remat=r) for s, r in pairs])
  chosen, _ = choose_fastest_plan(64, 100, need, cost)
  assert (chosen.micro_batch_size, chosen.remat) == (LARGEST_WITHOUT_REMAT[tile], False)


def test_fastest_plan_times_only_fitting_plans_and_names_the_budget_that_would_fit():
  timed = []
  chosen, _ = choose_fastest_plan(8, 10 ** 9, lambda size, remat: size, lambda pairs: timed.extend(pairs) or
                                  [1.] * len(pairs))
  assert (chosen.micro_batch_size, chosen.remat) == (8, False) and timed == [(8, False), (4, False), (2, False)]
  with pytest.raises(ValueError, match=r'even micro-batches of one sample with remat need 6 B \(6 bytes\) for a '
                                       r'batch of 8. Raise memory_budget to at least 6.'):
    choose_fastest_plan(8, 4, lambda size, remat: size + (5 if remat else 9), lambda pairs: [1.] * len(pairs))


@pytest.mark.parametrize('batch_size, size, expected', [(64, 64, [64, 32, 16]), (48, 16, [16, 8, 4]),
                                                        (10, 3, [3, 2, 1]), (4, 1, [1])])
def test_finer_cuts_have_twice_and_four_times_the_micro_batches(batch_size, size, expected):
  assert finer_sizes(batch_size, size, 2) == expected


@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended
@TINY_SIZES
def test_planner_chooses_remat_where_it_is_the_faster_fit_and_trains_as_bptt(remat_only_budget, capsys):
  x, y, budget = remat_only_budget
  small = make_batches((12,), num_time=NUM_TIME, n_in=8, n_out=4, seed=1)[0]
  assert _step_bytes(12, False, *small) <= budget  # the small batch fits whole without remat (on this device)
  memory_only = _trainer(num_micro_batch='auto', memory_budget=budget)
  memory_only.target.reset(48)
  assert memory_only.plan_memory(x, y).num_micro_batches > 1

  model = _model()
  trainer = _trainer(model, num_micro_batch='auto', memory_budget=budget, remat='auto')
  for batch in ((x, y), small):
    model.reset(len(batch[0]))
    trainer.plan_memory(*batch, step_time=micro_batches_cost_more_than_remat)
  table = capsys.readouterr().out
  assert "memory plan for batch 48" in table and '<- chosen' in table and 'the fastest that fits' in table
  large, used = trainer.memory_plans[48]
  assert (large.num_micro_batches, large.remat, used <= budget) == (1, True, True)
  assert (trainer.memory_plans[12][0].num_micro_batches, trainer.memory_plans[12][0].remat) == (1, False)

  batches = [(x, y), small, (x, y)]
  trainer.fit(batches, num_epoch=2)
  reference_model = _model()
  reference = bp.BPTT(reference_model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                      progress_bar=False)
  reference.fit(batches, num_epoch=2)
  assert_trees_close(params_of(model), params_of(reference_model))
  assert_trees_close(trainer.get_hist_metric('fit', 'loss', 'detailed'),
                     reference.get_hist_metric('fit', 'loss', 'detailed'))
  assert trainer.compilations['fit'] == 2  # one per batch shape
  model.reset(48)
  assert trainer.compiled_step_bytes(None, FIT, x, y) == used  # the step compiled with the plan's remat


@pytest.mark.long  # the long suite (--long): README suite time
@TINY_SIZES
def test_planning_with_trial_steps_changes_nothing(remat_only_budget):
  x, y, budget = remat_only_budget
  bm.random.seed(3)
  model = _model()
  trainer = _trainer(model, num_micro_batch='auto', memory_budget=budget, remat='auto')
  model.reset(48)
  before = _every_value(trainer)
  plan = trainer.plan_memory(x, y)  # timed trial steps on this batch
  assert_trees_close(_every_value(trainer), before, rtol=0, atol=0)
  weighed = trainer.planner.weighed_plans[48]
  assert all(c.seconds > 0 for c in weighed if c.fits) and any(c.remat for c in weighed)
  assert plan.micro_batch_size in {c.micro_batch_size for c in weighed if c.fits}


@TINY_SIZES
@pytest.mark.parametrize('remat', [False, True, 7])
def test_fixed_remat_keeps_the_memory_only_plan(remat, remat_only_budget):
  x, y, budget = remat_only_budget
  trainer = _trainer(num_micro_batch='auto', memory_budget=budget, remat=remat)
  trainer.target.reset(48)
  plan = trainer.plan_memory(x, y)
  assert plan.remat is None and trainer._model.remat_in_effect() == remat and 'remat' not in plan.describe()
  assert not trainer.planner.weighed_plans
