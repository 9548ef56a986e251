"""BrainPy's own BPTT tests, taken from the installed brainpy, pass with ``bp.BPTT`` switched to ``AccumBPTT``.

They run in subprocesses started at collection (``background.start_brainpy_suite``),
one per ``num_micro_batch``; ``brainpy_switch.py`` does the switch and counts.
"""

import json

import pytest

import background


@pytest.mark.parametrize('num_micro_batch', [  # 3 splits BrainPy's batches of 2 and 3 unevenly; 2 is long
  pytest.param(n, marks=pytest.mark.long if n == 2 else ()) for n in background.NUM_MICRO_BATCH_FOR_BRAINPY_SUITE])
def test_brainpy_own_bptt_tests_pass_with_accum_bptt(num_micro_batch):
  assert background.brainpy_test_file().is_file(), 'the installed brainpy ships no train/back_propagation_test.py'
  job = background.finish(f'brainpy_suite_{num_micro_batch}',
                          lambda: background.start_brainpy_suite(num_micro_batch))
  text = background.output(job)
  report = json.loads((job.out_dir / 'report.json').read_text())
  assert job.processes[0].returncode == 0, text
  assert report['collected'] >= 27 and report['passed'] == report['collected'], (report, text)
  assert report['failed'] == 0 and report.get('skipped', 0) == 0, (report, text)
  assert report['accum_trainers'] >= 15, f'the switch to AccumBPTT did not hold: {report}'
