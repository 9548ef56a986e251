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
from brainpy_accum.trainer._feed import overlapping
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


@pytest.mark.long  # about 15 s each: two trainers' compilations and the planner's
@pytest.mark.parametrize('coupled', evidence.COUPLED)
def test_accum_bptt_matches_bptt_on_the_evidence_network(coupled):
  """Three updates of the coupled (rate-regularised) loss, its rate a batch statistic or with
  whole_batch_loss=True: the micro-batched parameters are bp.BPTT's."""
  config = TINY._replace(updates=3, eval_every=3, coupled=coupled)
  batches = evidence.TrainingBatches(evidence.load_task(config.periods), config.batch, config.seed, 3, 3)
  bptt_bytes = evidence.bptt_step_memory(config, batches.batch_of(0))['bytes']
  accum = evidence.make_trainer(config._replace(budget=int(bptt_bytes * 0.6)), evidence.build_model(config))
  accum_params = _trained_params(accum, batches)
  plan, step_bytes = accum.memory_plans[config.batch]
  assert plan.num_micro_batches > 1 and step_bytes < bptt_bytes  # the batch was cut
  bptt = evidence.make_trainer(config._replace(trainer='bptt'), evidence.build_model(config))
  assert type(bptt) is bp.BPTT and isinstance(accum, AccumBPTT) and accum.whole_batch_loss == (coupled == 'whole-batch')
  assert_trees_close(accum_params, _trained_params(bptt, batches))


@pytest.mark.long  # about 10 s: the planner's compilations
def test_the_record_of_a_batch_streamed_in_pieces_names_the_pieces_and_their_step():
  """On an accelerator a host batch whose step does not fit in one micro-batch streams in pieces (here forced on
  the CPU): the run's record gives the piece's plan and its step's memory, not nothing."""
  config = TINY._replace(updates=1)
  batches = evidence.TrainingBatches(evidence.load_task(config.periods), config.batch, config.seed, 1, 1)
  budget = int(evidence.bptt_step_memory(config, batches.batch_of(0))['bytes'] * 0.6)
  trainer = evidence.make_trainer(config._replace(budget=budget), evidence.build_model(config))
  with overlapping(True):
    _trained_params(trainer, batches)
  run = evidence.Run('streamed', config, None)
  evidence._record_memory(run, trainer)
  piece = trainer.stream_chunks[config.batch]
  plan = run.record['memory']['plan']
  assert plan['streamed'] == piece < config.batch and plan['step_bytes'] == trainer.memory_plans[piece][1] <= budget
  assert plan['text'].startswith(f'streamed in pieces of {piece}, each 1 micro-batch'), plan


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
                                           (['--periods', '1', '2', '3'], 'expected 4 arguments'),
                                           (['--budget', '1MiB', '--past', '5'], 'give --stop-at too'),
                                           (['--budget', '1MiB', '--lr', '0'], 'must be a positive number'),
                                           (['--trainer', 'bptt', '--largest-bptt-batch'], 'needs --budget on a CPU')])
def test_bad_arguments_are_refused_with_a_message(argv, message, capsys):
  if 'budget' in message and evidence.device_memory() is not None:
    pytest.skip('a GPU or TPU reports its memory limit: no --budget needed there')
  with pytest.raises(SystemExit):
    evidence.main(argv)
  assert message in capsys.readouterr().err


def test_the_learning_rate_follows_the_width():
  """e-prop's 0.005 at its 100 neurons, times 100 / neurons elsewhere; the command's default is the rule, and
  --lr overrides it (the scaled network diverged at 0.005 on a TPU v5e and learned at about 0.0005)."""
  assert evidence.RECIPE.lr_at(100) == 0.005
  assert evidence.RECIPE.lr_at(1024) == pytest.approx(0.005 * 100 / 1024, rel=1e-12)
  assert evidence.RECIPE.lr_at(50) == pytest.approx(0.01)
  assert evidence.Config(neurons=1024).learning_rate == evidence.RECIPE.lr_at(1024)
  assert evidence.Config(neurons=1024, lr=0.002).learning_rate == 0.002
  parser_default = evidence.Run('r', evidence.Config(neurons=1024), None).record['config']['lr']
  assert parser_default == pytest.approx(0.00048828125)
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match=f'neurons={bad!r}'):
      evidence.RECIPE.lr_at(bad)


def test_the_command_trains_at_the_rule_unless_lr_is_given(monkeypatch):
  seen = []
  monkeypatch.setattr(evidence, 'train', lambda config, **kw: seen.append((config, kw['name'])) or _empty_record(config))
  evidence.main(['--neurons', '1024', '--budget', '1GiB'])
  evidence.main(['--neurons', '1024', '--budget', '1GiB', '--lr', '0.002'])
  (rule, rule_name), (given, given_name) = seen
  assert rule.lr is None and rule.learning_rate == pytest.approx(0.00048828125) and 'lr' not in rule_name
  assert given.learning_rate == 0.002 and given_name.endswith(', lr 0.002')


def _empty_record(config):
  return {'name': 'r', 'curve': [], 'memory': {}, 'device': {'kind': 'cpu', 'platform': 'cpu', 'memory_limit': None},
          'calls': [], 'finished': True, 'config': {}}


def _run_with_curve(config, accuracies):
  run = evidence.Run('r', config, None)
  run.record['curve'] = [{'updates': i * config.eval_every, 'test_accuracy': a, 'seconds': 10. * i, 'fit_seconds': 10.}
                         for i, a in enumerate(accuracies)]
  return run


@pytest.mark.parametrize('accuracies, past, finished', [
  ([0.5, 0.9, 0.96], 0, True),                # --stop-at alone: the first evaluation at or above it ends the run
  ([0.5, 0.96, 0.7], 0, True),
  ([0.5, 0.96, 0.7], 50, False),              # 25 updates past it, 50 asked
  ([0.5, 0.96, 0.7, 0.97], 50, True),         # 50 past: finished whatever came after
  ([0.5, 0.9, 0.94, 0.9], 1000, False),       # never reached: on until --updates
])
def test_past_trains_on_after_the_first_evaluation_at_stop_at(accuracies, past, finished):
  run = _run_with_curve(evidence.Config(updates=1000, eval_every=25, stop_at=0.95, past=past), accuracies)
  assert run.finished is finished
  assert _run_with_curve(evidence.Config(updates=75, eval_every=25, stop_at=0.95, past=past), accuracies).finished \
      is (finished or len(accuracies) > 3)


def test_the_table_gives_the_seconds_to_95_and_the_lowest_after():
  record = _run_with_curve(evidence.Config(stop_at=0.95), [0.5, 0.96, 0.7, 0.97]).record
  record.update(device={'kind': 'TPU v5 lite', 'platform': 'tpu', 'memory_limit': 2 ** 34}, calls=[])
  assert evidence.first_reaching(record, 0.95) == 25 and evidence.seconds_to(record, 0.95) == 10.
  assert evidence.lowest_after(record, 0.95) == 0.7 and evidence.lowest_after(record, 0.99) is None
  row = evidence.format_table([record]).splitlines()[-1]
  assert '| 25 | 10 | 0.700 | 0.970 | 0.970 |' in row


@pytest.mark.long  # about 10 s: a handful of bp.BPTT step compilations
def test_largest_bptt_batch_is_the_last_multiple_whose_step_fits_the_budget():
  """The search's answer fits the budget by XLA's analysis and the next multiple does not; the step grows with
  the batch, so every probe below the answer fits and every one above does not."""
  config = TINY._replace(batch=64)
  sizes = {b: evidence.bptt_step_memory(config._replace(batch=b), _zeros(config, b))['bytes'] for b in (40, 48)}
  budget = (sizes[40] + sizes[48]) // 2
  found = evidence.largest_bptt_batch(config._replace(budget=budget), multiple=8)
  assert found['batch'] == 40 and found['refused_batch'] == 48 and found['bytes'] == sizes[40] <= budget
  assert found['refused_bytes'] == sizes[48] > budget
  assert all((p['bytes'] <= budget) == (p['batch'] <= 40) for p in found['probes'])
  nothing = evidence.largest_bptt_batch(config._replace(budget=1), multiple=8)
  assert nothing['batch'] is None and nothing['refused_batch'] == 8


def test_largest_bptt_batch_needs_a_limit_on_a_cpu():
  if evidence.device_memory() is not None:
    pytest.skip('a GPU or TPU reports its memory limit')
  with pytest.raises(ValueError, match='needs a memory limit.*--budget'):
    evidence.largest_bptt_batch(TINY)


def _zeros(config, batch):
  return evidence.Trials(np.zeros((batch, config.periods.steps, evidence.FEATURES_IN), np.float32),
                         np.zeros(batch, np.int32))
