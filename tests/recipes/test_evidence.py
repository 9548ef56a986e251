"""``python -m brainpy_accum.recipes.evidence``: e-prop's evidence-accumulation task at a small size (32 neurons or
fewer, trials of 86 to 270 steps): ``AccumBPTT`` trains this network as ``bp.BPTT`` does, training lifts held-out
accuracy well above chance, and a run cut into calls continues the straight run's curve exactly."""

import json

import brainpy as bp
import numpy as np
import pytest

from brainpy_accum import AccumBPTT
from brainpy_accum.recipes import evidence
from brainpy_accum.checkpoint._file import read_tree
from helpers import assert_trees_close, params_of

pytest.importorskip('brainpy_datasets', reason='the evidence benchmark needs brainpy-datasets (the evidence extra)')

TINY = evidence.Config(neurons=16, batch=8, periods=evidence.Periods(4, 6, 10, 6), updates=6, eval_every=2,
                       test_trials=16)
TINY_ARGS = ['--neurons', '16', '--batch', '8', '--periods', '4', '6', '10', '6', '--updates', '6', '--eval-every', '2',
             '--test-trials', '16']


def _trained_params(trainer, batches):
  batches.epoch = 0
  trainer.fit(batches, num_epoch=1)
  return params_of(trainer.target)


@pytest.mark.long  # about 15 s: two trainers' compilations and the planner's
def test_accum_bptt_with_whole_batch_loss_matches_bptt_on_the_evidence_network():
  """Three updates of the coupled (rate-regularised) loss: the micro-batched parameters are bp.BPTT's."""
  config = TINY._replace(updates=3, eval_every=3)
  batches = evidence.TrainingBatches(evidence.load_task(config.periods), config.batch, config.seed, 3, 3)
  bptt_bytes = evidence.bptt_step_memory(config, batches.batch_of(0))['bytes']
  accum = evidence.make_trainer(config._replace(budget=int(bptt_bytes * 0.6)), evidence.build_model(config))
  accum_params = _trained_params(accum, batches)
  plan, step_bytes = accum.memory_plans[config.batch]
  assert plan.num_micro_batches > 1 and step_bytes < bptt_bytes  # the batch was cut
  bptt = evidence.make_trainer(config._replace(trainer='bptt'), evidence.build_model(config))
  assert type(bptt) is bp.BPTT and isinstance(accum, AccumBPTT) and accum.whole_batch_loss
  assert_trees_close(accum_params, _trained_params(bptt, batches))


@pytest.mark.long  # about 40 s on one core: 100 updates of 32 neurons on 270-step trials, and the compilations
def test_training_lifts_held_out_accuracy_well_above_chance(tmp_path):
  """The script's AccumBPTT run, batch 32 cut to fit a budget under bp.BPTT's step: 200 held-out trials."""
  config = evidence.Config(neurons=32, batch=32, periods=evidence.Periods(10, 20, 40, 20))
  sample = evidence.TrainingBatches(evidence.load_task(config.periods), 32, 0, 1, 1).batch_of(0)
  budget = int(evidence.bptt_step_memory(config, sample)['bytes'] * 0.6)
  out = tmp_path / 'runs.json'
  record = evidence.main(['--neurons', '32', '--batch', '32', '--periods', '10', '20', '40', '20', '--updates', '100',
                          '--eval-every', '50', '--test-trials', '200', '--budget', budget, '--out', out])
  curve = record['curve']
  assert [p['updates'] for p in curve] == [0, 50, 100] and record['finished']
  # chance is 0.5 (+- 0.035 for 200 trials); here 0.835, and bp.BPTT's runs of seeds 0-2 at this size 0.805-0.875
  assert curve[-1]['test_accuracy'] >= 0.7, curve
  memory = record['memory']
  assert memory['bptt_step']['bytes'] > budget >= memory['plan']['step_bytes']
  assert memory['plan']['num_micro_batches'] > 1
  assert json.loads(out.read_text()) == [json.loads(json.dumps(record))]
  example = record['example']
  assert example['updates'] == 100 and example['label'] in (0, 1) and example['lif_shown'] == 16
  assert len(example['probability_1']) == -(-config.periods.steps // example['probability_every'])


@pytest.mark.long  # about 25 s: each trainer trained straight and in three calls, in this process
@pytest.mark.parametrize('trainer', ['accum', 'bptt'])
def test_run_cut_into_calls_continues_the_straight_run_exactly(trainer, tmp_path):
  """``--seconds 0`` stops every call after one epoch: three calls end with the straight run's parameters and
  curve (checkpoints: AccumBPTT's fit(checkpoint=...); bp.BPTT's saved by the script)."""
  args = TINY_ARGS + ['--trainer', trainer, '--budget', '1MiB']
  straight = evidence.main(args + ['--checkpoint', tmp_path / 'straight.ckpt'])
  calls = [evidence.main(args + ['--checkpoint', tmp_path / 'cut.ckpt', '--seconds', '0']) for _ in range(3)]
  cut = calls[-1]
  assert [c['finished'] for c in calls] == [False, False, True]
  assert [(c['updates_before'], c['updates_after']) for c in cut['calls']] == [(0, 2), (2, 4), (4, 6)]
  keys = ('updates', 'test_accuracy', 'test_rate_hz', 'train_loss', 'train_acc')
  assert [[p.get(k) for k in keys] for p in cut['curve']] == [[p.get(k) for k in keys] for p in straight['curve']]
  params = {n: read_tree(str(tmp_path / f'{n}.ckpt'))['values']['params'] for n in ('straight', 'cut')}
  assert_trees_close(params['cut'], params['straight'], rtol=0, atol=0)  # bit for bit
  assert evidence.main(args + ['--checkpoint', tmp_path / 'cut.ckpt'])['curve'] == cut['curve']  # finished: no more


def test_a_checkpoint_of_other_settings_is_refused_with_the_difference(tmp_path):
  run = evidence.Run('r', TINY, str(tmp_path / 'r.ckpt'))
  (tmp_path / 'r.ckpt').write_bytes(b'')
  run.save(None)
  with pytest.raises(ValueError, match=r"neurons 16 there, 32 asked.*only --updates may grow"):
    evidence.Run('r', TINY._replace(neurons=32, updates=60), str(tmp_path / 'r.ckpt'))
  assert evidence.Run('r', TINY._replace(updates=60), str(tmp_path / 'r.ckpt')).epochs_done == 0


def test_a_checkpoint_without_its_record_is_refused(tmp_path):
  (tmp_path / 'r.ckpt').write_bytes(b'')
  with pytest.raises(ValueError, match='Remove the checkpoint to start afresh'):
    evidence.Run('r', TINY, str(tmp_path / 'r.ckpt'))


def test_training_batches_depend_on_seed_and_update_only():
  """A fresh task, another order of draws: the same trials for the same (seed, update); the held-out stream is
  another one; each cue lies on the 25 channels of its side."""
  periods = TINY.periods
  first = evidence.TrainingBatches(evidence.load_task(periods), 8, 0, 2, 6)
  second = evidence.TrainingBatches(evidence.load_task(periods), 8, 0, 2, 6)
  second.batch_of(5)
  for a, b in zip(first.batch_of(3), second.batch_of(3)):
    np.testing.assert_array_equal(a, b)
  held_out = evidence.draw_trials(evidence.load_task(periods), (0, evidence.HELD_OUT_STREAM), 8)
  assert not np.array_equal(held_out.inputs, first.batch_of(0).inputs)
  second.epoch = 2
  assert len(list(second())) == 2 and len(list(evidence.TrainingBatches(first.task, 8, 0, 4, 6)())) == 4
  long_cues = evidence.Periods(10, 40, 10, 10)
  trials = evidence.draw_trials(evidence.load_task(long_cues), (1, 2), 64)
  cues = trials.inputs[:, :7 * (long_cues.interval + long_cues.cue)]
  left, right = cues[..., :25].sum(axis=(1, 2)), cues[..., 25:50].sum(axis=(1, 2))
  assert np.mean((left > right) == (trials.labels == 1)) > 0.9  # label 1: more left cues (spike counts are noisy)


def _refused(config, sample, log=print):
  return {'bytes': 2 ** 40, 'refused': True, 'error': 'RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm'}


def test_bptt_at_a_batch_the_device_refuses_stops_before_training(monkeypatch):
  """On a TPU, bp.BPTT at a batch whose step it refused: a message instead of a fit that runs out of memory."""
  monkeypatch.setattr(evidence, 'bptt_step_memory', _refused)
  with pytest.raises(ValueError, match='does not fit this device: pass a smaller --batch'):
    evidence.main(TINY_ARGS + ['--trainer', 'bptt'])


def test_missing_brainpy_datasets_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(__import__('sys').modules, 'brainpy_datasets.cognitive', None)
  with pytest.raises(ImportError, match=r'pip install "brainpy-accum\[evidence\]"'):
    evidence.load_task(TINY.periods)


@pytest.mark.parametrize('argv, message', [([], '--budget is needed on a CPU'), (['--neurons', '0'], 'at least 1'),
                                           (['--trainer', 'gru'], 'invalid choice'),
                                           (['--periods', '1', '2', '3'], 'expected 4 arguments')])
def test_bad_arguments_are_refused_with_a_message(argv, message, capsys):
  if argv == [] and evidence.device_memory() is not None:
    pytest.skip('a GPU or TPU reports its memory limit: no --budget needed there')
  with pytest.raises(SystemExit):
    evidence.main(argv)
  assert message in capsys.readouterr().err
