"""Nothing traced outlives its trace: runs under ``jax.checking_leaks()``, and ``bp.share`` after fit and predict.

BrainPy's time step saves its shared values (``bp.share.save(i=..., t=..., dt=..., **shared_args)``) into a
global environment; inside a traced step they are tracers, which ``bp.BPTT`` leaves behind. ``AccumBPTT`` puts
the environment back at the end of every traced time step (:mod:`brainpy_accum.core._shared_env`), so ``fit``,
its evaluation, ``predict``, the first-batch check and the planner trace cleanly, and ``bp.share`` reads after
them what it read before.
"""

import contextlib

import brainpy as bp
import brainpy.math as bm
import jax
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from brainpy_accum.core._shared_env import shared_env_restored, shared_environments
from helpers import make_batches, make_model, params_of

SIZES = (5,)  # 5 samples of 5 time steps: targets whose axes 0 and 1 both have the batch's size (their
# batch axis is decided by tracing the model, traced too)


@pytest.fixture(autouse=True)
def _share_left_as_found():
  """Each test starts without the time step's keys, as a fresh process does, and ends with BrainPy's
  environment as the suite had it (other tests' bp.BPTT runs leave tracers there)."""
  with shared_env_restored():
    for env in shared_environments():
      for key in ('i', 't', 'fit'):
        env.settings.pop(key, None)
    yield


def squared_error(predicts, targets):
  """The mean squared error written out: not one of the losses the first-batch check knows, so the check runs."""
  return bm.mean((predicts - targets) ** 2)


def _shared_tracers() -> dict:
  return {k: v for k, v in bp.share.get_shargs().items() if isinstance(v, jax.core.Tracer)}


def _fit_and_predict(trainer, batches, evaluate: bool = True):
  trainer.fit(batches, test_data=batches[:1] if evaluate else None, num_epoch=1)
  return trainer.predict(batches[0][0])


@pytest.mark.long  # the long suite (--long): README suite time
def test_bptt_leaves_tracers_in_bp_share_where_accum_bptt_leaves_it_as_it_was():
  """The same model and batch: after bp.BPTT's fit ``bp.share`` holds tracers; after AccumBPTT's fit and predict it
  reads what it read before (the decision documented in the guide: what the steps save exists only inside them;
  keys a user saved keep their values, the very objects; keys nobody saved stay unsaved)."""
  batches = make_batches(SIZES)
  reference = bp.BPTT(make_model('rnn'), squared_error, optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False)
  with shared_env_restored():  # bp.BPTT's leftovers go at the end of this block
    reference.fit(batches, num_epoch=1)
    assert {'i', 't', 'fit'} <= set(_shared_tracers())  # what a user of bp.BPTT reads from bp.share after fit
  _accum_bptt_leaves_bp_share_as_it_was(batches, contextlib.nullcontext)


@pytest.mark.extended  # CI leaves it out for its time budget (python -m pytest -q --long -m extended)
@pytest.mark.long  # the long suite (--long): leak checking compiles everything anew
def test_bptt_leaks_tracers_where_accum_bptt_traces_cleanly():
  """Under ``jax.checking_leaks()``: bp.BPTT's fit fails with a leaked trace; AccumBPTT's fit and predict pass and
  leave ``bp.share`` as it was."""
  batches = make_batches(SIZES)
  reference = bp.BPTT(make_model('rnn'), squared_error, optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False)
  with shared_env_restored():  # bp.BPTT's leftovers go at the end of this block
    with pytest.raises(Exception, match='Leaked trace'), jax.checking_leaks():
      reference.fit(batches, num_epoch=1)
  _accum_bptt_leaves_bp_share_as_it_was(batches, jax.checking_leaks)


def _accum_bptt_leaves_bp_share_as_it_was(batches, checking):
  bp.share.save(t=12.5, fit='mine', my_setting=[1, 2])
  before = dict(bp.share.get_shargs())
  assert 'i' not in before
  trainer = AccumBPTT(make_model('rnn'), squared_error, optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False,
                      num_micro_batch=3)
  with checking():
    predicted = _fit_and_predict(trainer, batches, evaluate=False)
  assert np.all(np.isfinite(np.asarray(predicted)))
  after = dict(bp.share.get_shargs())
  assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
  assert bp.share.load('t') == 12.5 and bp.share.load('fit') == 'mine' and bp.share.load('i', 'unset') == 'unset'


@pytest.mark.long  # the long suite (--long): README suite time
def test_the_model_still_reads_the_steps_shared_values():
  """Inside the step the model sees ``fit`` and ``t`` as bp.BPTT gives them: the same parameters after a step
  whose output depends on them."""

  class TimeGated(bp.DynamicalSystem):
    def __init__(self):
      super().__init__()
      self.cell = bp.dyn.RNNCell(3, 8)
      self.out = bp.dnn.Dense(8, 2)

    def update(self, x):
      gate = bm.where(bp.share.load('fit'), 1., 0.5) * (1. + bp.share.load('t'))
      return self.out(self.cell(x * gate))

  results = []
  for cls, options in ((bp.BPTT, {}), (AccumBPTT, {'num_micro_batch': 3})):
    bm.random.seed(0)
    with bm.training_environment():
      model = TimeGated()
    trainer = cls(model, squared_error, optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False, **options)
    trainer.fit(make_batches(SIZES), num_epoch=1)
    results.append(params_of(model))
  for accum, bptt in zip(*results[::-1]):
    np.testing.assert_allclose(accum, bptt, rtol=1e-5, atol=1e-6)


# each option on one of the two networks, both networks on the first (leak checking compiles everything anew:
# 20-35 s a trainer, so not every pair)
@pytest.mark.long  # the long suite (--long): 6 trainers, each compiled (5 of them 'extended': CI leaves them out)
@pytest.mark.parametrize('model, options', [
  pytest.param('rnn', dict(num_micro_batch=3), marks=pytest.mark.extended),
  pytest.param('snn', dict(num_micro_batch=3), marks=pytest.mark.extended),
  pytest.param('snn', dict(num_micro_batch=3, accumulate_steps=2), marks=pytest.mark.extended),
  pytest.param('rnn', dict(num_micro_batch=3, whole_batch_loss=True), marks=pytest.mark.extended),
  pytest.param('snn', dict(num_micro_batch='auto', memory_budget='1GiB'), marks=pytest.mark.extended),
  ('rnn', dict(num_micro_batch='auto', memory_budget='1GiB', remat='auto', loss_has_aux=True)),
], ids=['N=3-rnn', 'N=3-snn', 'accumulate_steps=2-snn', 'whole_batch_loss-rnn', 'auto-snn', 'auto+remat+aux-rnn'])
def test_every_traced_call_is_clean_under_checking_leaks(model, options):
  """Train steps (collect/close through the window), evaluation, predict, the first-batch check, the planner's
  probes and trial steps, the target axes' tracing: none leaves a tracer anywhere."""
  loss = squared_error
  if options.get('loss_has_aux'):
    loss = lambda p, y: (squared_error(p, y), {'peak': bm.max(p), 'mean': bm.mean(p)})  # noqa: E731
  trainer = AccumBPTT(make_model(model), loss, optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False, cache=False,
                      **options)
  with jax.checking_leaks():
    _fit_and_predict(trainer, make_batches(SIZES + (6, 6)))
  assert not _shared_tracers()
