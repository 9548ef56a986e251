"""AccumBPTT against bp.BPTT on the whole batch: parameters after several Adam steps, losses, metrics."""

import dataclasses
import functools
from typing import Tuple

import brainpy as bp
import brainpy.math as bm
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, mse_with_aux, params_of

# Two full batches and the short last batch of an epoch; 2 epochs = 6 optimizer updates.
SIZES = (10, 10, 7)


@dataclasses.dataclass(frozen=True)
class Scenario:
  model: str = 'rnn'
  sizes: Tuple[int, ...] = SIZES
  time_first: bool = False
  dict_inputs: bool = False
  loss: str = 'aux'
  jit: bool = True
  num_epoch: int = 2
  test_size: int = 9


def last_step_mse(predicts, targets):
  """Loss on the last time step only; predicts are time-first, targets (batch, n_out)."""
  return bp.losses.mean_squared_error(predicts[-1], targets)


def summed_mse(predicts, targets):
  """A loss that sums over samples (and averages over time and features)."""
  return bm.sum(bm.mean((predicts - targets) ** 2, axis=(1, 2)))


LOSSES = {'aux': (mse_with_aux, True), 'last_step': (last_step_mse, False), 'sum': (summed_mse, False)}


def run(scenario: Scenario, trainer_cls=bp.BPTT, **trainer_kwargs):
  """Train from a fixed initial state; return parameters, metrics and the trainer."""
  model = make_model(scenario.model)
  loss_fun, has_aux = LOSSES[scenario.loss]
  trainer = trainer_cls(model, loss_fun, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=has_aux,
                        data_first_axis='T' if scenario.time_first else 'B', jit=scenario.jit,
                        progress_bar=False, **trainer_kwargs)
  batches = make_batches(scenario.sizes, time_first=scenario.time_first, dict_inputs=scenario.dict_inputs)
  if scenario.loss == 'last_step':
    batches = [(x, y[-1]) for x, y in batches]
  test_batches = make_batches((scenario.test_size,), seed=1, time_first=scenario.time_first, dict_inputs=scenario.dict_inputs)
  if scenario.loss == 'last_step':
    test_batches = [(x, y[-1]) for x, y in test_batches]
  trainer.fit(batches, test_data=test_batches, num_epoch=scenario.num_epoch)
  metrics = {phase: {name: trainer.get_hist_metric(phase, name, 'detailed')
                     for name in (trainer._detailed_train_metrics if phase == 'fit' else trainer._detailed_test_metrics)}
             for phase in ('fit', 'test')}
  return params_of(model), metrics, trainer


@functools.lru_cache(maxsize=None)
def reference(scenario: Scenario):
  params, metrics, _ = run(scenario)
  return params, metrics


def assert_matches_reference(scenario, **trainer_kwargs):
  params, metrics, trainer = run(scenario, AccumBPTT, **trainer_kwargs)
  ref_params, ref_metrics = reference(scenario)
  assert_trees_close(params, ref_params)
  assert_trees_close(metrics, ref_metrics)
  return trainer


# Even and uneven cuts (batches of 10, 10 and 7) down to one sample per micro-batch; one micro-batch of the rate
# RNN is test_one_micro_batch_is_bitwise_bptt.
@pytest.mark.parametrize('model, num_micro_batch', [  # rnn-2, snn-1 and snn-10 in the long suite: README suite time
  pytest.param('rnn', 2, marks=pytest.mark.long), ('rnn', 4), pytest.param('snn', 1, marks=pytest.mark.long),
  ('snn', 4), pytest.param('snn', 10, marks=pytest.mark.long)])
def test_update_and_metrics_match_whole_batch_bptt(model, num_micro_batch):
  trainer = assert_matches_reference(Scenario(model=model), num_micro_batch=num_micro_batch)
  assert set(trainer._detailed_train_metrics) == {'loss', 'mean_out', 'abs_err'}


def test_one_micro_batch_is_bitwise_bptt():
  scenario = Scenario()
  params, metrics, _ = run(scenario, AccumBPTT, num_micro_batch=1)
  assert_trees_close(params, reference(scenario)[0], rtol=0, atol=0)
  assert_trees_close(metrics, reference(scenario)[1], rtol=0, atol=0)


def test_no_accumulation_option_is_bitwise_bptt():
  """``AccumBPTT(model, loss)``, nothing else: the one-line switch with no option trains as bp.BPTT."""
  scenario = Scenario()
  params, metrics, trainer = run(scenario, AccumBPTT)
  assert trainer.num_micro_batch_for(10) == 1
  assert_trees_close(params, reference(scenario)[0], rtol=0, atol=0)
  assert_trees_close(metrics, reference(scenario)[1], rtol=0, atol=0)


def test_micro_batch_size_matches_whole_batch_bptt():
  assert_matches_reference(Scenario(model='snn'), micro_batch_size=4)


@pytest.mark.long  # the long suite (--long): README suite time
def test_batch_smaller_than_num_micro_batch_matches():
  assert_matches_reference(Scenario(sizes=(3, 2)), num_micro_batch=4)


@pytest.mark.long  # the long suite (--long): README suite time
def test_time_first_data_matches():
  assert_matches_reference(Scenario(time_first=True), num_micro_batch=3)


@pytest.mark.long  # the long suite (--long): README suite time
def test_time_first_inputs_with_batch_first_targets_match():
  assert_matches_reference(Scenario(time_first=True, loss='last_step'), num_micro_batch=4)


@pytest.mark.long  # the long suite (--long): README suite time
def test_dict_inputs_match():
  assert_matches_reference(Scenario(model='dict_rnn', dict_inputs=True), num_micro_batch=4)


def test_sum_reduction_matches_summed_loss():
  assert_matches_reference(Scenario(loss='sum'), num_micro_batch=4, grad_reduction='sum')


@pytest.mark.long  # the long suite (--long): README suite time
def test_mean_reduction_of_summed_loss_differs():
  """Guards the sum test above: the reduction really changes the update."""
  params, _, _ = run(Scenario(loss='sum', num_epoch=1), AccumBPTT, num_micro_batch=4, grad_reduction='mean')
  ref_params, _ = reference(Scenario(loss='sum', num_epoch=1))
  assert not all(np.allclose(p, r, rtol=1e-3) for p, r in zip(params, ref_params))

@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended

def test_without_jit_matches():
  trainer = assert_matches_reference(Scenario(sizes=(6, 5), jit=False, num_epoch=1), num_micro_batch=4)
  assert trainer.compilations == {'fit': 0, 'loss': 0}  # no compiled step to count


@pytest.mark.long  # the long suite (--long): README suite time
def test_monitors_reach_the_loss_per_micro_batch():
  def loss_with_monitor(predicts, targets):
    outs, mons = predicts
    return bp.losses.mean_squared_error(outs, targets), {'mean_V': mons['V'].mean()}

  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, {'num_micro_batch': 3})):
    model = make_model('snn')
    trainer = cls(model, loss_with_monitor, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True,
                  monitors={'V': model.lif.V}, progress_bar=False, **kwargs)
    trainer.fit(make_batches((10, 7)), num_epoch=2)
    results.append((params_of(model), trainer.get_hist_metric('fit', 'mean_V', 'detailed')))
  assert_trees_close(results[1], results[0])


def test_stateful_training_carries_each_samples_state():
  """reset_state=False: consecutive chunks of long sequences, the state carried sample by sample."""
  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, {'num_micro_batch': 4})):
    model = make_model('snn')
    trainer = cls(model, mse_with_aux, optimizer=bp.optim.Adam(lr=0.05), loss_has_aux=True,
                  progress_bar=False, **kwargs)
    model.reset(10)
    trainer.fit(make_batches((10, 10, 10)), num_epoch=1, reset_state=False)
    state = [np.asarray(model.lif.V), np.asarray(model.lif.t_last_spike)]
    results.append((params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed'), state))
  assert_trees_close(results[1], results[0])


def test_model_state_after_a_step_is_the_whole_batchs():
  scenario = Scenario(model='snn', num_epoch=1)
  _, _, trainer = run(scenario, AccumBPTT, num_micro_batch=4)
  _, _, ref_trainer = run(scenario)
  assert trainer.target.lif.V.shape == ref_trainer.target.lif.V.shape == (9, 8)
  assert_trees_close(np.asarray(trainer.target.lif.V), np.asarray(ref_trainer.target.lif.V))


@pytest.mark.long  # the long suite (--long): README suite time
def test_predict_on_a_full_batch_after_fit():
  scenario = Scenario(model='snn')
  _, _, trainer = run(scenario, AccumBPTT, num_micro_batch=4)
  _, _, ref_trainer = run(scenario)
  x = make_batches((12,), seed=3)[0][0]
  bm.random.seed(5)
  out = trainer.predict(x, reset_state=True)
  bm.random.seed(5)
  ref_out = ref_trainer.predict(x, reset_state=True)
  assert out.shape == (12, 5, 2)
  assert_trees_close(np.asarray(out), np.asarray(ref_out))
