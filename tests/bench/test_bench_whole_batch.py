"""``python -m brainpy_accum.bench.whole_batch --quick`` writes its page with every row; speed is not asserted."""

import pytest

from brainpy_accum.bench import whole_batch

pytestmark = pytest.mark.long  # the long suite (--long): CI runs it on one long leg (tests/conftest.py)

@pytest.mark.extended  # CI leaves it out for its time budget (python -m pytest -q --long -m extended)

def test_quick_run_writes_the_page_with_every_row(tmp_path):
  measured = whole_batch.main(['--quick', '--out', tmp_path])
  page = (tmp_path / 'whole_batch_loss_benchmark.md').read_text()
  assert page.startswith('# whole_batch_loss=True') and 'jax ' in page and 'brainpy ' in page
  rows = [line for line in page.splitlines() if line.startswith('| ') and not line.startswith('| trainer')]
  assert len(rows) == len(whole_batch.CONFIGS) * len(measured)
  for config in whole_batch.CONFIGS:
    start = f'| {config.label} | {config.num_micro_batch} |'
    assert any(row.startswith(start) and ('| yes |' in row) == config.remat for row in rows), start
  for topic in ('- Memory: `whole', '- Compute: its', '- Exactness: its'):  # the interpretation, once per workload
    assert page.count(topic) == len(measured), topic
  for m in measured:
    for r in m['results']:
      assert r['memory']['total'] > 0 and r['step']['median'] > 0
      if r['config']['whole_batch_loss']:  # the two passes give bp.BPTT's gradient ...
        assert r['grad_rel_l2'] < 1e-5 and abs(r['loss_diff']) < 1e-5
      elif r['config']['method'] == 'accum':  # ... the default mode does not: the regulariser couples the samples
        assert r['grad_rel_l2'] > 1e-4
