"""The benchmark and soak scripts run (tiny sizes); their figures live in docs/, not in assertions on speed."""

import json
import os

import pytest

from brainpy_accum import compiled_step_bytes
from brainpy_accum.bench import __main__ as bench_main
from brainpy_accum.bench import soak
from brainpy_accum.bench.measure import largest_batch_within, measure_all, per_round_ratio, time_in_rounds
from brainpy_accum.bench.measure import Step, build_step
from brainpy_accum.bench.report import markdown_report, plot
from brainpy_accum.bench.workloads import Shape

TINY = Shape(batch=16, time=6, hidden=8, inputs=4)

@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended

def test_every_method_measures_and_reports(tmp_path):
  configs = [dict(method='bptt', num_micro_batch=1), dict(method='accum', num_micro_batch=2),
             dict(method='accum', num_micro_batch=2, remat=True), dict(method='recipe', num_micro_batch=2),
             dict(method='jax', num_micro_batch=2)]
  results = measure_all([dict(c, workload='snn', shape=list(TINY)) for c in configs], rounds=2)
  for r in results:
    assert r['compilations'] == 1 and r['memory']['temp'] > 0 and len(r['step_times']) == 2
  # Memory is deterministic: two micro-batches need less working memory than the whole batch.
  assert results[1]['memory']['temp'] < results[0]['memory']['temp']
  text = markdown_report(results, {'snn': {'bptt': 8, 'accum N=4': 32}}, '# Benchmark')
  assert '| AccumBPTT | 2 | 8 |' in text and 'Targets:' in text
  assert '| 2 | ' in text.split('medians of per-round ratios')[1]  # the ratios table has its N=2 row
  path = tmp_path / 'plans.png'
  plot(results, str(path), picks=[dict(workload='snn', num_micro_batch=2, remat=True, label='planner')])
  assert path.stat().st_size > 0


def test_rounds_alternate_order_and_ratios_are_per_round():
  calls = []
  steps = [Step(lambda i=i: calls.append(i), lambda: None, lambda: 1) for i in range(3)]
  times = time_in_rounds(steps, rounds=2)
  assert calls == [0, 1, 2, 0, 1, 2, 2, 1, 0] and [len(t) for t in times] == [2, 2, 2]
  # A round twice as slow for both sides leaves the ratio alone; a ratio of medians would not.
  assert per_round_ratio([1., 2., 4.], [1., 2., 2.]) == 1.


@pytest.mark.extended  # CI leaves it out for its time budget (python -m pytest -q --long -m extended)
@pytest.mark.long
def test_quick_run_writes_report_json_and_figure(tmp_path):
  bench_main.main(['--quick', '--workloads', 'rnn', '--rounds', '1', '--parts', 'steps', '--out', str(tmp_path)])
  text = (tmp_path / 'benchmark.md').read_text()
  assert 'load average' in text and 'brainstate' in text and 'AccumBPTT / plain JAX + optax at N=2' in text
  assert len(json.loads((tmp_path / 'benchmark.json').read_text())['results']) == len(
    bench_main.configs('rnn', bench_main.QUICK, quick=True))
  assert (tmp_path / 'benchmark.png').stat().st_size > 0


@pytest.mark.extended  # a benchmark's command at a quick size: minutes (CI leaves it out)
@pytest.mark.long
def test_largest_batch_grows_with_micro_batches():
  shape = TINY._replace(time=40, hidden=32)
  budget = 2 * compiled_step_bytes(build_step('bptt', 'rnn', shape, abstract_data=True).compile())  # on this device
  whole = largest_batch_within(budget, 'bptt', 'rnn', shape)
  four = largest_batch_within(budget, 'accum', 'rnn', shape, num_micro_batch=4)
  assert four > whole >= shape.batch

@pytest.mark.long  # the long suite (--long): README suite time
@pytest.mark.extended

def test_soak_runs_without_recompiling(capsys):
  growth = soak.main(['--steps', '300', '--warmup', '100', '--every', '100'])
  assert 'XLA compilations of the train step: 2' in capsys.readouterr().out
  assert growth < 0.05  # the soak target, over a shorter run


@pytest.mark.extended  # a benchmark's command at a quick size: minutes (CI leaves it out)
@pytest.mark.long
def test_quick_planner_and_streaming_parts_join_the_report(tmp_path):
  """The two other parts rerun alone, keeping the steps part from benchmark.json."""
  bench_main.main(['--quick', '--workloads', 'rnn', '--rounds', '1', '--parts', 'steps', '--out', str(tmp_path)])
  bench_main.main(['--quick', '--parts', 'planner', 'streaming', '--out', str(tmp_path)])
  report = (tmp_path / 'benchmark.md').read_text()
  assert '## rnn' in report and 'The planner: fastest plan that fits' in report and '## Streaming' in report
  assert (tmp_path / 'benchmark_planner.png').exists()


def test_column_divides_out_what_micro_batching_costs_plain_jax_round_by_round():
  from brainpy_accum.bench.report import ratios
  base = dict(workload='w', shape=list(TINY), remat=False)
  results = [dict(base, method='bptt', num_micro_batch=1, step_times=[1., 2., 1.]),
             dict(base, method='jax', num_micro_batch=1, step_times=[1., 1., 2.]),
             dict(base, method='accum', num_micro_batch=2, step_times=[1.5, 3., 1.5]),  # 1.5 x bp.BPTT each round
             dict(base, method='jax', num_micro_batch=2, step_times=[1.2, 1.2, 2.4])]  # 1.2 x plain JAX(1)
  row = [line for line in ratios(results, 'w') if line.startswith('| 2 |')][0]
  assert row.endswith('| 1.250 | - | - |')  # 1.5 / 1.2 in every round; no steps at the micro-batch measured


def test_steps_at_the_micro_batch_tell_the_models_cost_from_accumulations():
  """With bp.BPTT and plain JAX timed at N's micro-batch (``--column``): the ratio of the two there is the
  BrainPy model's own cost at that size, and AccumBPTT against N of bp.BPTT's steps there is accumulation's; a
  miss against plain JAX (and of the column) gives its factors, whose product is the missed ratio."""
  from brainpy_accum.bench.__main__ import configs
  from brainpy_accum.bench.report import ratios, table, targets
  small = list(TINY._replace(batch=TINY.batch // 2))
  base = dict(workload='w', shape=list(TINY), remat=False, memory={'temp': 1, 'argument': 1, 'output': 1}, step_s=1,
              compilations=1)
  results = [dict(base, method='bptt', num_micro_batch=1, step_times=[1., 1., 1.]),
             dict(base, method='jax', num_micro_batch=1, step_times=[1., 1., 1.]),
             dict(base, method='accum', num_micro_batch=2, step_times=[2.2, 2.2, 2.2]),
             dict(base, method='jax', num_micro_batch=2, step_times=[2., 2., 2.]),  # AccumBPTT 1.1 x plain JAX
             dict(base, shape=small, method='bptt', num_micro_batch=1, at_micro_batch=2, step_times=[1.2, 1.2, 1.2]),
             dict(base, shape=small, method='jax', num_micro_batch=1, at_micro_batch=2, step_times=[1., 1., 1.])]
  row = [line for line in ratios(results, 'w') if line.startswith('| 2 |')][0]
  assert row.endswith('| 1.200 | 0.917 |')  # the model 1.2 x plain JAX there; 2.2 / (2 x 1.2)
  lines = targets(results, {}, 'w')
  missed = [line for line in lines if 'plain JAX + optax at N=2' in line][0]
  factors = (f'its factors: AccumBPTT against 2 bp.BPTT steps at batch {small[0]} 0.917 (accumulation\'s own), '
             'bp.BPTT against plain JAX there 1.200 (the BrainPy model), 2 plain JAX steps there against plain '
             'JAX\'s 2 micro-batches 1.000 (its scan)')  # 0.917 x 1.2 x 1.0 = 1.1, the missed ratio
  assert '1.100 (target <= 1.05): **missed**; ' + factors in missed
  column = [line for line in lines if line.startswith('- [AccumBPTT(N) / bp.BPTT]')][0]
  assert column.endswith(factors + ', over bp.BPTT against plain JAX at the whole batch 1.000')
  assert f'| bp.BPTT at batch {small[0]} (N=2\'s micro-batch) | 1 |' in '\n'.join(table(results, 'w'))
  references = [c for c in configs('w', TINY, quick=False, column=True) if c.get('at_micro_batch')]
  assert [(c['method'], c['at_micro_batch'], c['shape'][0]) for c in references] == [
    (m, n, TINY.batch // n) for n in (2, 4, 8) for m in ('bptt', 'jax')]


def test_last_step_workload_in_plain_jax_is_the_cross_entropy_of_the_last_read_out():
  import jax.numpy as jnp
  import numpy as np
  from brainpy_accum.bench.workloads import jax_loss, jax_params, make_batch
  shape = TINY._replace(outputs=3)
  x, y = make_batch(shape, workload='rnn_ce')
  assert y.shape == (shape.batch,) and y.dtype == np.int32
  p = {k: np.asarray(v, np.float64) for k, v in jax_params(shape).items()}
  h = np.zeros((shape.batch, shape.hidden))
  for t in range(shape.time):  # the tanh RNN by hand, in float64
    h = np.tanh(x[:, t] @ p['wi'] + h @ p['wh'] + p['b'])
  logits = h @ p['wo'] + p['bo']
  log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  expected = -log_p[np.arange(shape.batch), y].mean()
  got = float(jax_loss('rnn_ce', jax_params(shape), jnp.asarray(x), jnp.asarray(y)))
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_startup_table_states_ratios_compilations_and_targets():
  from brainpy_accum.bench.startup import startup_section
  run = lambda s, c=11: {'seconds': s, 'cpu_seconds': s / 2, 'compilations': c, 'plan': {}}
  results = {'bp.BPTT': {'first': [run(2.), run(4.)], 'rerun': [run(1.), run(1.)]},
             "'auto', memory_budget='24MiB'": {'first': [run(3., 14), run(8., 14)], 'rerun': [run(1.4), run(1.6)]}}
  text = startup_section(results, 'load')
  assert "| 'auto', memory_budget='24MiB' | first | 5.50 | 1.75 (1.50 - 2.00) | 2.75 | 1.75 (1.50 - 2.00) | 14 |" in text
  assert '|  | rerun | 1.50 | 1.50 (1.40 - 1.60) | 0.75 | 1.50 (1.40 - 1.60) | 11 | <= 1.5 |' in text
  assert 'first: 1.75 x bp.BPTT (target <= 1.6): **missed**' in text
  assert 'rerun: 1.50 x bp.BPTT (target <= 1.5): met' in text


def test_startup_client_run_is_judged_by_its_own_target_and_names_the_device():
  from brainpy_accum.bench.startup import CLIENT_TARGETS, startup_section
  run = lambda s: {'seconds': s, 'cpu_seconds': s, 'compilations': 11, 'plan': {}, 'device': 'TPU v5 lite (tpu)'}
  results = {'bp.BPTT': {'first': [run(2.), run(2.)], 'rerun': [run(1.), run(1.)]},
             "'auto', memory_budget='24MiB'": {'first': [run(3.2), run(2.8)], 'rerun': [run(1.), run(1.)]}}
  text = startup_section(results, targets=CLIENT_TARGETS)
  assert text.startswith('Device: TPU v5 lite (tpu).')
  assert "'auto', memory_budget='24MiB', first: 1.50 x bp.BPTT (target <= 1.5): met" in text
  assert 'rerun: 1.00 x' not in text  # no target for the client's rerun


def test_startup_table_gives_the_first_runs_by_phase():
  from brainpy_accum.bench.startup import startup_section
  from brainpy_accum.diagnostics._phases import PHASES
  phases = lambda probes: {name: {'seconds': probes if name == 'planning probes' else 0.5, 'compile_seconds': 0.,  # noqa
                                  'compilations': 1} for name in PHASES + ('beside', 'total')}
  run = lambda probes: {'seconds': 4., 'cpu_seconds': 4., 'compilations': 11, 'plan': {}, 'phases': phases(probes)}
  results = {'bp.BPTT': {'first': [run(0.), run(0.)], 'rerun': [run(0.), run(0.)]},
             "'auto', memory_budget='24MiB'": {'first': [run(1.), run(2.)], 'rerun': [run(0.), run(0.)]}}
  text = startup_section(results)
  assert "| 'auto', memory_budget='24MiB' | 0.50 | 1.50 (1) | 0.50 (1) |" in text


def test_startup_against_another_checkout_pairs_runs_back_to_back(monkeypatch):
  """--against: each trainer's first run here and from the other checkout one after the other (the pairs in
  reversed order every other round), each on an empty cache folder, the other's package imported from its tree;
  the table gives the median of the paired differences and how many pairs were slower here."""
  from brainpy_accum.bench import startup
  calls, seconds = [], iter([3., 2., 5., 4., 2., 2.5, 9., 7.])
  monkeypatch.setattr(startup, 'run_one', lambda name, cache, shape, tree=None: calls.append(
    (name, tree, os.listdir(cache))) or {'seconds': next(seconds)})
  results = startup.measure_against('/old', ['bp.BPTT', 'AccumBPTT(num_micro_batch=4)'], rounds=2)
  assert [(name, tree) for name, tree, _ in calls] == [
    ('bp.BPTT', None), ('bp.BPTT', '/old'), ('AccumBPTT(num_micro_batch=4)', None),
    ('AccumBPTT(num_micro_batch=4)', '/old'), ('AccumBPTT(num_micro_batch=4)', '/old'),
    ('AccumBPTT(num_micro_batch=4)', None), ('bp.BPTT', '/old'), ('bp.BPTT', None)]
  assert all(folder == [] for _, _, folder in calls)
  assert results == {'bp.BPTT': {'here': [3., 7.], 'there': [2., 9.]},
                     'AccumBPTT(num_micro_batch=4)': {'here': [5., 2.5], 'there': [4., 2.]}}
  text = startup.against_section(results, '/old')
  assert '| bp.BPTT | 5.00 | 5.50 | -0.50 | 1 of 2 |' in text
  assert '| AccumBPTT(num_micro_batch=4) | 3.75 | 3.00 | +0.75 | 2 of 2 |' in text


def test_startup_child_platforms_reach_the_timed_processes_and_a_held_device_is_named(monkeypatch):
  """--child-platforms: the timed processes get it as JAX_PLATFORMS (the parent, which imports brainpy and so opens
  the default device, runs on the CPU: a TPU opens in one process at a time); a child that finds the device held
  fails with the fix named."""
  import subprocess
  from brainpy_accum.bench import startup
  seen = []

  def fake_run(command, env, **kwargs):
    seen.append(env.get('JAX_PLATFORMS'))
    return subprocess.CompletedProcess(command, 1, '', 'ABORTED: The TPU is already in use by process with pid 1')

  monkeypatch.setattr(subprocess, 'run', fake_run)
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv(startup.CHILD_PLATFORMS, 'tpu')
  with pytest.raises(RuntimeError, match='--child-platforms'):
    startup.run_one('bp.BPTT', '/nowhere')
  assert seen == ['tpu']


def test_startup_saves_after_every_run_and_can_skip_reruns(monkeypatch, tmp_path):
  """A start-up run cut short (a chip call's time limit) keeps what it measured: ``--json`` is written after every
  run; ``--no-rerun`` makes first runs only, and the table then has no rerun rows."""
  from brainpy_accum.bench import startup
  seconds = iter([2., 3., 4., 5.])
  monkeypatch.setattr(startup, 'run_one', lambda name, cache, shape, tree=None: {
    'seconds': next(seconds), 'cpu_seconds': 1., 'compilations': 11, 'plan': {}})
  path = tmp_path / 'start.json'
  saved = []
  results = startup.measure_startup(['bp.BPTT', 'AccumBPTT(num_micro_batch=4)'], rounds=2, reruns=False,
                                    save=lambda r: saved.append(json.loads(json.dumps(r))))
  assert [len(s['bp.BPTT']['first']) + len(s['AccumBPTT(num_micro_batch=4)']['first']) for s in saved] == [1, 2, 3, 4]
  assert results['bp.BPTT'] == {'first': [{'seconds': 2., 'cpu_seconds': 1., 'compilations': 11, 'plan': {}},
                                          {'seconds': 5., 'cpu_seconds': 1., 'compilations': 11, 'plan': {}}],
                                'rerun': []}
  text = startup.startup_section(results)
  assert '| first |' in text and '| rerun |' not in text
  seconds = iter([2.])  # the second run fails, as one cut short by a time limit would not return
  with pytest.raises(StopIteration):
    startup.main(['--rounds', '1', '--no-rerun', '--trainers', 'bp.BPTT', 'AccumBPTT(num_micro_batch=4)',
                  '--json', str(path)])
  assert json.loads(path.read_text()) == {'bp.BPTT': {'first': [{'seconds': 2., 'cpu_seconds': 1., 'compilations': 11,
                                                                 'plan': {}}], 'rerun': []},
                                          'AccumBPTT(num_micro_batch=4)': {'first': [], 'rerun': []}}
