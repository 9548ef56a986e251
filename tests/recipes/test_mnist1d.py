"""``python -m brainpy_accum.recipes.mnist1d``: its rows, its JSON and its errors, on tiny runs (learning is not asserted)."""

import json

import numpy as np
import pytest

from brainpy_accum.recipes import mnist1d

ROW_TYPES = {'model': str, 'kind': str, 'test_accuracy': float, 'trainer': str, 'memory_budget': int,
             'bptt_step_bytes': int, 'plan': str, 'bptt_step_fits_budget': bool, 'accum_step_bytes': int,
             'num_micro_batches': int, 'epochs': int, 'train_seconds': float}


def _check_row(row, kind):
  for key, kind_of_value in ROW_TYPES.items():
    assert isinstance(row[key], kind_of_value), (key, row[key])
  assert row['kind'] == kind and 0. <= row['test_accuracy'] <= 1.
  assert not row['bptt_step_fits_budget'] and row['bptt_step_bytes'] > row['memory_budget']
  assert row['num_micro_batches'] > 1 and row['accum_step_bytes'] <= row['memory_budget']
  assert len(row['train_accuracy_per_epoch']) == row['epochs']


def _tiny_data(n_train=48, n_test=20, seed=0):
  rng = np.random.RandomState(seed)
  return mnist1d.Mnist1d(rng.normal(size=(n_train, 40)).astype(np.float32), rng.randint(0, 10, n_train),
                         rng.normal(size=(n_test, 40)).astype(np.float32), rng.randint(0, 10, n_test))


@pytest.mark.extended  # CI leaves it out for its time budget (python -m pytest -q --long -m extended)
@pytest.mark.long  # about 10 s of compilations (bp.BPTT's step, the planner's candidates, the train step)
def test_tiny_recurrent_run_gives_a_row_whose_bptt_step_does_not_fit():
  """A tiny recurrent network on random signals: the budget set under bp.BPTT's step, the planner cuts the batch."""
  spec = mnist1d.MODELS['recurrent']._replace(build=lambda: mnist1d.RecurrentSNN(taps=4, hidden=8),
                                              encode=lambda x: mnist1d.delay_line(x, 4), batch=16, epochs=1)
  data = _tiny_data()
  bptt_bytes = mnist1d.bptt_step_bytes(spec, spec.encode(data.x_train[:16]), data.y_train[:16])
  spec = spec._replace(memory_budget=int(bptt_bytes * 0.6))
  row = mnist1d.train(spec, data, seed=0, log=lambda *a, **k: None).row
  _check_row(row, 'recurrent')
  assert row['bptt_step_bytes'] == bptt_bytes
  table = mnist1d.format_table([row])
  assert table.count('\n') == 2 and '| no |' in table


@pytest.mark.parametrize('argv, message', [(['--seeds', '-1'], 'non-negative'), (['--epochs', '0'], 'positive'),
                                           (['--models', 'gru'], 'invalid choice'),
                                           (['--models'], 'nothing to train')])
def test_bad_arguments_are_refused_with_a_message(argv, message, capsys):
  with pytest.raises(SystemExit):
    mnist1d.main(argv)
  assert message in capsys.readouterr().err


@pytest.mark.extended  # a benchmark's command at a quick size: minutes (CI leaves it out)
@pytest.mark.long
def test_cli_writes_json_rows_for_both_networks_and_the_rate_regulariser(tmp_path):
  """The benchmark's own models, budgets and batches, shortened to 1 epoch on 256 training signals."""
  pytest.importorskip('mnist1d', reason='the MNIST-1D benchmark needs the mnist1d package (the test extra has it)')
  out = tmp_path / 'rows.json'
  mnist1d.main(['--epochs', '1', '--train-size', '256', '--rate-regulariser', '--out', out])
  rows = json.loads(out.read_text())
  assert [r['kind'] for r in rows] == ['recurrent', 'conv', 'recurrent']
  for row in rows:
    _check_row(row, row['kind'])
    assert row['train_size'] == 256 and row['epochs'] == 1
  rate = rows[2]
  assert rate['trainer'] == 'AccumBPTT whole_batch_loss=True'
  assert rate['default_mode']['warned'] and 'whole_batch_loss=True' in rate['default_mode']['warning']
  assert rate['default_mode']['step_bytes'] <= rate['memory_budget']


def test_rows_of_several_seeds_merge_into_one_table_line():
  """What ``--seeds 0 1 2`` prints: one line per network, every seed's accuracy and time, their mean and spread."""
  row = dict(model='m', kind='recurrent', seed=0, test_accuracy=0.95, trainer='AccumBPTT', batch=32,
             memory_budget=2 ** 20, bptt_step_bytes=2 ** 21, bptt_step_fits_budget=False, plan='2 micro-batches (2 x 16)',
             accum_step_bytes=2 ** 19, epochs=3, train_seconds=10., train_accuracy_per_epoch=[.5, .6, .7],
             train_loss_per_epoch=[1., .9, .8])
  merged = mnist1d._merge_seeds([row, dict(row, seed=1, test_accuracy=0.93, train_seconds=12.)])
  assert merged['seed'] == [0, 1] and merged['test_accuracy'] == [0.95, 0.93]
  assert abs(merged['mean_test_accuracy'] - 0.94) < 1e-12 and abs(merged['std_test_accuracy'] - 0.02 ** 0.5 / 10) < 1e-12
  assert '| 0.950, 0.930 |' in mnist1d.format_table([merged]) and '| 10, 12 |' in mnist1d.format_table([merged])
