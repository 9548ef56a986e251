"""BrainPy's own gallery examples (github.com/brainpy/examples), trained by bp.BPTT and by AccumBPTT.

Each example of ``gallery_models.py`` is built twice from the same seed and trained on the same
batches, once by ``bp.BPTT`` on the whole batch and once by ``AccumBPTT(num_micro_batch=3)`` on
micro-batches (the batch sizes are not multiples of 3, so every batch is cut unevenly). Trainable
parameters, the recorded losses and metrics (per batch and per report), ``train_losses``,
``test_losses`` and the calls ``fun_after_report`` received must agree to float32 round-off.

What each example covers beyond the others:

* integrator RNN: ``num_report`` whose windows straddle the end of an epoch, in training and in
  evaluation (``bp.BPTT`` starts every epoch's window afresh and drops its unreported losses);
* e-prop and the surrogate-gradient LIF network: spiking networks whose firing-rate regularisers
  couple the samples of a batch (``whole_batch_loss=True``); the default mode warns and trains
  another objective;
* Masse STP RNN: model states declared as plain ``bm.Variable((batch_size, n))`` without
  ``batch_axis``;
* liquid time-constant network: time-first data, ``fun_after_report`` that changes parameters;
* Song E/I RNN: time-first data, tuple outputs, Dale's-law masks.
"""

import dataclasses
import functools
import re
import warnings
from typing import Any, Dict, List, Tuple

import brainpy as bp
import brainpy.math as bm
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from gallery_models import EXAMPLES, EpochData, Example, eprop_loss_without_regulariser
from helpers import assert_trees_close, params_of

pytestmark = pytest.mark.long  # the long suite (--long): CI runs it on one long leg (tests/conftest.py)

NUM_MICRO_BATCH = 3


@dataclasses.dataclass
class Outcome:
  initial_params: List[np.ndarray]
  params: List[np.ndarray]
  detailed: Dict[str, Dict[str, np.ndarray]]   # phase -> metric -> one value per batch
  report: Dict[str, Dict[str, np.ndarray]]     # phase -> metric -> one value per report
  train_losses: Any
  test_losses: Any
  reports: List[Tuple[int, str, Dict[str, float]]]  # what fun_after_report received
  batch_sizes: List[int]                            # of every training and test batch


def _metric_names(trainer, phase):
  return sorted(trainer._detailed_train_metrics if phase == 'fit' else trainer._detailed_test_metrics)


def train(example: Example, trainer_cls=bp.BPTT, **accum_kwargs) -> Outcome:
  """Build ``example`` from its seed and train it with ``trainer_cls`` as the gallery does."""
  with bm.environment(**example.env):
    bm.random.seed(example.seed)
    model = example.build()
    initial = params_of(model)
    reports = []
    after = example.after_report(model) if example.after_report else None

    def fun_after_report(idx, metrics, phase):
      reports.append((idx, phase, {k: np.asarray(v) for k, v in metrics.items()}))
      if after is not None:
        after(idx, metrics, phase)

    kwargs = dict(optimizer=example.optimizer(), **example.trainer_kwargs(model), **accum_kwargs)
    trainer = trainer_cls(model, example.loss(model), **kwargs)
    train_data = example.train_data()
    test_data = example.test_data() if example.test_data else None
    bm.random.seed(example.seed + 1)  # the same global key for any random draw during training
    trainer.fit(train_data, test_data=test_data, fun_after_report=fun_after_report, **example.fit_kwargs)
  batch_axis = 1 if kwargs.get('data_first_axis', 'B') == 'T' else 0
  batches = [b for epoch in train_data.epochs for b in epoch]
  batches += [b for epoch in test_data.epochs for b in epoch] if isinstance(test_data, EpochData) else test_data or []
  sizes = [np.shape(x)[batch_axis] for x, _ in batches]
  phases = ('fit', 'test')
  detailed = {p: {k: trainer.get_hist_metric(p, k, 'detailed') for k in _metric_names(trainer, p)} for p in phases}
  report = {p: {k: trainer.get_hist_metric(p, k, 'report') for k in _metric_names(trainer, p)} for p in phases}
  return Outcome(initial, params_of(model), detailed, report, trainer.train_losses, trainer.test_losses, reports,
                 sizes)


@functools.lru_cache(maxsize=None)
def reference(name: str) -> Outcome:
  """``bp.BPTT`` on the whole batch, once per example."""
  out = train(EXAMPLES[name])
  # Every batch is cut unevenly by num_micro_batch=3.
  assert out.batch_sizes and all(size % NUM_MICRO_BATCH for size in out.batch_sizes), (name, out.batch_sizes)
  # The reference itself must be a real training run: finite losses, parameters that moved.
  assert len(out.detailed['fit']['loss']) > 0
  assert np.all(np.isfinite(out.detailed['fit']['loss']))
  assert any(not np.allclose(p, q) for p, q in zip(out.params, out.initial_params))
  return out


def accumulated(name: str, **kwargs) -> Outcome:
  return train(EXAMPLES[name], AccumBPTT, num_micro_batch=NUM_MICRO_BATCH, **kwargs)


def assert_same_training(out: Outcome, ref: Outcome):
  assert_trees_close(out.initial_params, ref.initial_params, rtol=0, atol=0)
  assert_trees_close(out.params, ref.params)
  assert_trees_close(out.detailed, ref.detailed)
  assert_trees_close(out.report, ref.report)
  assert_trees_close(out.train_losses, ref.train_losses)
  assert_trees_close(out.test_losses, ref.test_losses)
  assert [(i, p, sorted(m)) for i, p, m in out.reports] == [(i, p, sorted(m)) for i, p, m in ref.reports]
  assert_trees_close([m for _, _, m in out.reports], [m for _, _, m in ref.reports])


# ------------------------------------------------------------------------------------ the ports


def test_integrator_rnn_reports_straddling_epoch_ends_match_bptt():
  """recurrent_networks/integrator_rnn.ipynb: 3 batches per epoch, num_report=2, 3 epochs.

  bp.BPTT reports after global steps 2, 4, 6, 8 with windows [1, 2], [4], [5, 6], [7, 8]: batches
  3 and 9 are dropped at their epoch's end and the window of step 4 holds one batch. The test
  set (3 batches per epoch) is reported the same way.
  """
  ref = reference('integrator_rnn')
  assert [(i, p) for i, p, _ in ref.reports] == [
    (2, 'fit'), (2, 'test'), (4, 'fit'), (6, 'fit'), (4, 'test'), (6, 'test'), (8, 'fit'), (8, 'test')]
  assert len(ref.detailed['fit']['loss']) == 7 and len(ref.detailed['test']['loss']) == 7  # 9 batches, 2 dropped
  assert_same_training(accumulated('integrator_rnn'), ref)


def test_eprop_spiking_net_with_coupling_rate_regulariser_matches_whole_batch():
  """recurrent_networks/Bellec_2020_eprop_evidence_accumulation.ipynb: sum_n (mean_{b,t} z - f0)^2."""
  ref = reference('eprop_evidence_accumulation')
  assert set(ref.detailed['fit']) == {'loss', 'loss reg', 'accuracy'}
  assert_same_training(accumulated('eprop_evidence_accumulation', whole_batch_loss=True), ref)


def test_surrogate_grad_lif_with_spike_count_regularisers_matches_whole_batch():
  """brain_inspired_computing/SurrogateGrad_lif_fashion_mnist.py: 1e-5 * mean_n (sum_{b,t} z)^2 + 1e-5 * sum z."""
  ref = reference('surrogate_grad_lif_fashion_mnist')
  assert_same_training(accumulated('surrogate_grad_lif_fashion_mnist', whole_batch_loss=True), ref)


def test_masse_stp_rnn_states_without_batch_axis_match_bptt():
  """recurrent_networks/Masse_2019_STP_RNN.ipynb: h, u, x, y are bm.Variable((batch_size, n)) with no batch_axis.

  They must be cut along axis 0 like states with ``batch_axis=0``; AccumBPTT warns once per such
  state (not once per step), naming it. (y_hist, of shape (num_steps, batch_size, 3), and the
  (1,)-shaped loss Variables are not per-sample states: their axis 0 is not the batch.)
  """
  ref = reference('masse_stp_rnn')
  with pytest.warns(UserWarning, match='batch_axis') as record:
    out = accumulated('masse_stp_rnn')
  assert_same_training(out, ref)
  messages = [str(w.message) for w in record if 'batch_axis' in str(w.message)]
  assert len(messages) <= 4, messages  # once, not once per train or test step (6 + 2 here)
  assert any(re.search(rf'\b{name}\b', ' '.join(messages)) for name in ('h', 'u', 'x', 'y')), messages


def test_liquid_time_constant_network_matches_bptt():
  """brain_inspired_computing/liquid_time_constant_network.py: param_constrain() after every step."""
  ref = reference('liquid_time_constant')
  assert [p for _, p, _ in ref.reports].count('fit') == 6  # one constraint per train step
  assert_same_training(accumulated('liquid_time_constant'), ref)


def test_song_ei_rnn_matches_bptt():
  """recurrent_networks/Song_2016_EI_RNN.ipynb (recurrent noise set to 0)."""
  assert_same_training(accumulated('song_2016_ei_rnn'), reference('song_2016_ei_rnn'))


# ------------------------------------------------------------------------------------ guards


def _user_warnings(record, text):
  return [w for w in record if issubclass(w.category, UserWarning) and text in str(w.message)]


@pytest.mark.parametrize('name', ['eprop_evidence_accumulation', 'surrogate_grad_lif_fashion_mnist'])
def test_default_mode_warns_on_coupled_regulariser_and_trains_another_objective(name):
  """Without whole_batch_loss a coupling regulariser is computed per micro-batch: AccumBPTT says so,
  and the losses it records differ from bp.BPTT's (so the tests above would catch that objective)."""
  with pytest.warns(UserWarning, match='whole_batch_loss'):
    out = accumulated(name)
  ref = reference(name)
  assert not np.allclose(out.detailed['fit']['loss'], ref.detailed['fit']['loss'], rtol=1e-5, atol=1e-6)
  if name == 'eprop_evidence_accumulation':  # reg_f = 1: the parameters differ too
    assert any(not np.allclose(p, r, rtol=1e-5, atol=1e-6) for p, r in zip(out.params, ref.params))


def test_default_mode_does_not_warn_on_a_per_sample_mean_loss():
  """The same spiking network and data with the classification loss alone (a mean over samples)."""
  example = dataclasses.replace(EXAMPLES['eprop_evidence_accumulation'],
                                loss=eprop_loss_without_regulariser)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter('always')
    out = train(example, AccumBPTT, num_micro_batch=NUM_MICRO_BATCH)
  assert not _user_warnings(record, 'whole_batch_loss')
  assert_same_training(out, train(example))


def test_spiking_examples_spike_unevenly_across_micro_batches():
  """The regulariser tests mean something only if the rates differ between micro-batches."""
  for name in ('eprop_evidence_accumulation', 'surrogate_grad_lif_fashion_mnist'):
    example = EXAMPLES[name]
    with bm.environment(**example.env):
      bm.random.seed(example.seed)
      model = example.build()
      runner = bp.DSTrainer(model, monitors={'spike': model.r.spike}, progress_bar=False)
      x, _ = next(example.train_data()())
      runner.predict(x, reset_state=True)
      spikes = np.asarray(runner.mon['spike'])  # (batch, time, neurons)
    rates = [spikes[i:i + 3].mean() for i in range(0, spikes.shape[0], 3)]
    assert spikes.sum() > 0 and max(rates) > min(rates), (name, rates)
