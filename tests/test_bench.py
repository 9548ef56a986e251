"""The benchmark and soak scripts run (tiny sizes); their figures live in docs/, not in assertions on speed."""

from brainpy_accum.bench import soak
from brainpy_accum.bench.measure import largest_batch_within, measure
from brainpy_accum.bench.report import markdown_report
from brainpy_accum.bench.workloads import Shape

TINY = Shape(batch=16, time=6, hidden=8, inputs=4)


def test_every_method_measures_and_reports():
  configs = [dict(method='bptt', num_micro_batch=1), dict(method='accum', num_micro_batch=4),
             dict(method='accum', num_micro_batch=4, remat=True), dict(method='recipe', num_micro_batch=4),
             dict(method='jax', num_micro_batch=4)]
  results = [measure(dict(c, workload='snn', shape=list(TINY)), steps=1) for c in configs]
  for r in results:
    assert r['compilations'] == 1 and r['memory']['temp'] > 0 and r['step_s'] > 0
  # Memory is deterministic: four micro-batches need less working memory than the whole batch.
  assert results[1]['memory']['temp'] < results[0]['memory']['temp']
  text = markdown_report(results, {'snn': {'bptt': 8, 'accum N=4': 32}}, '# Benchmark')
  assert '| AccumBPTT | 4 | 4 |' in text and 'Targets:' in text


def test_largest_batch_grows_with_micro_batches():
  budget = 300_000
  whole = largest_batch_within(budget, 'bptt', 'rnn', TINY._replace(time=40, hidden=32))
  four = largest_batch_within(budget, 'accum', 'rnn', TINY._replace(time=40, hidden=32), num_micro_batch=4)
  assert four > whole > 0


def test_soak_runs_without_recompiling(capsys):
  growth = soak.main(['--steps', '300', '--warmup', '100', '--every', '100'])
  assert 'XLA compilations of the train step: 2' in capsys.readouterr().out
  assert growth < 0.05  # the soak target, over a shorter run
