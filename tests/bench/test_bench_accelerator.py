"""The benchmark's device part runs (tiny shapes, on the CPU) and reports what it measured; its figures live in
docs/accelerator.md, not in assertions on speed."""

import copy
import json

import jax
import numpy as np
import pytest

from brainpy_accum.bench import __main__ as bench_main
from brainpy_accum.bench import accelerator as device
from brainpy_accum.bench import report as device_report
from brainpy_accum.bench import streaming
from brainpy_accum.bench.workloads import make_batch
from brainpy_accum.trainer._feed import Sender, overlapping

REFUSAL = ('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 17.38G '
           'of 15.75G hbm. Exceeded hbm capacity by 1.63G.')


def _refuse_bptt_above(monkeypatch, batch):
  """bp.BPTT's step refused by XLA for memory (simulated) at batches above ``batch``."""
  epoch = device._Trainer.epoch

  def refusing(self, batches, quiet=False):
    if self.name == 'bp.BPTT' and self.batch > batch:
      raise jax.errors.JaxRuntimeError(REFUSAL)
    return epoch(self, batches, quiet)

  monkeypatch.setattr(device._Trainer, 'epoch', refusing)


def _rows(folder):
  data = json.loads((folder / 'accelerator.json').read_text())
  run, = data['runs'].values()
  return data, run, {(r['workload'], r['batch'], r['trainer']): r for r in run['rows']}


def _check_trained(rows, workload, batch):
  mine = rows[workload, batch, 'AccumBPTT']
  assert mine['fits'] and mine['bytes'] > 0 and 'batch' in mine['plan'] and mine['first_epoch_s'] > 0
  assert set(mine['samples_per_s']) == {device_report.AHEAD, device_report.WITH_STEP, device_report.DEVICE}
  assert rows[workload, batch, 'plain JAX + optax']['samples_per_s']['device'] > 0


@pytest.mark.extended  # CI leaves it out for its time budget (python -m pytest -q --long -m extended)
@pytest.mark.long  # the long suite (--long): a small run of the device part
def test_device_part_records_a_refused_step_as_not_fitting_and_writes_its_files(tmp_path, monkeypatch):
  """bp.BPTT refused for memory (XLA's compile-time refusal, simulated): "does not fit" in the table, and the
  run goes on; AccumBPTT is timed on NumPy and device batches, plain JAX on device batches."""
  _refuse_bptt_above(monkeypatch, 0)
  device.main(['--quick', '--workloads', 'rnn_ce', '--batches', '8', '--out', str(tmp_path)])
  data, run, rows = _rows(tmp_path)
  assert run['facts']['platform'] == 'cpu' and run['budget'] == device.QUICK['budget']
  refused = rows['rnn_ce', 8, 'bp.BPTT']
  assert refused['fits'] is False and 'Ran out of memory' in refused['error'] and not refused['samples_per_s']
  _check_trained(rows, 'rnn_ce', 8)
  report = (tmp_path / 'accelerator.md').read_text()
  assert 'No accelerator figures yet' in report and 'CPU figures' in report and '| 8 | bp.BPTT | **no** |' in report
  assert (tmp_path / 'accelerator.png').stat().st_size > 0

  # a chip's run joins the CPU's: reported first, and the note on missing figures goes
  chip = copy.deepcopy(run)
  chip['facts'].update(platform='tpu', kind='TPU v5 lite', memory_limit=15.75 * 2 ** 30)
  data['runs']['tpu: TPU v5 lite'] = chip
  report = device_report.device_report(data)
  assert 'No accelerator figures yet' not in report
  assert report.index('## TPU v5 lite (TPU)') < report.index('## CPU') and "vendor's dense bf16 figure is 197" in report


def test_the_benchmark_runs_the_device_part_only_when_named(tmp_path, monkeypatch):
  called = []
  monkeypatch.setattr(bench_main, 'device_main', called.append)
  bench_main.main(['--quick', '--parts', 'device', '--out', str(tmp_path)])
  assert called == [['--quick', '--out', str(tmp_path)]] and not (tmp_path / 'benchmark.md').exists()
  assert 'device' not in bench_main.PARTS  # not in the default run


@pytest.mark.extended  # a benchmark's command at a quick size: minutes (CI leaves it out)
@pytest.mark.long  # the long suite (--long): both networks, two batch sizes
def test_quick_device_part_times_bptt_where_it_fits_and_stops_it_where_it_does_not(tmp_path, monkeypatch):
  _refuse_bptt_above(monkeypatch, 8)
  device.main(['--quick', '--out', str(tmp_path)])
  _, _, rows = _rows(tmp_path)
  for workload in device.WORKLOADS:
    assert rows[workload, 8, 'bp.BPTT']['fits'] and set(rows[workload, 8, 'bp.BPTT']['samples_per_s']) == {
      device_report.WITH_STEP, device_report.DEVICE}
    assert rows[workload, 16, 'bp.BPTT']['fits'] is False
    for batch in (8, 16):
      _check_trained(rows, workload, batch)


def _fake_batch(calls):
  """measure_batch's rows without running anything: bp.BPTT fits up to 8 samples (refused above), AccumBPTT
  everywhere; each call recorded as (batch, whether bp.BPTT was tried)."""

  def measure(workload, shape, epoch, rounds, budget, bptt_fits=True):
    calls.append((shape.batch, bptt_fits))
    rows = []
    for name in device.TRAINERS:
      fits = name != 'bp.BPTT' or (shape.batch <= 8 if bptt_fits else False)
      error = None if fits else REFUSAL if bptt_fits else device.BPTT_SKIPPED
      rows.append({'workload': workload, 'batch': shape.batch, 'trainer': name, 'fits': fits, 'error': error,
                   'epoch_s': {}, 'interleaved': True, 'model_flops': 1., 'first_epoch_s': 1.,
                   'samples_per_s': {device_report.DEVICE: 100. * shape.batch} if fits else {},
                   'plan': f'batch {shape.batch}', 'micro_batches': 1, 'bytes': shape.batch})
    return rows

  return measure


def test_calls_of_a_subset_add_their_rows_and_reuse_the_stored_bptt_refusal(tmp_path, monkeypatch):
  """A device whose calls are short measures its batch sizes in several calls (``--batches``): each adds its
  rows to the stored run of the same settings, and a call above the batch whose bp.BPTT step the device refused
  in an earlier call does not try bp.BPTT again (its reference is the stored one)."""
  calls = []
  monkeypatch.setattr(device, 'measure_batch', _fake_batch(calls))
  monkeypatch.setattr(device, 'measure_peak', lambda size=None: {'float32': 1e12, 'bfloat16': 2e12})
  for batches in (['8', '16'], ['32']):
    device.main(['--quick', '--workloads', 'rnn_ce', '--batches', *batches, '--out', str(tmp_path)])
    if batches == ['8', '16']:  # what other benches stored in the run (bench.feed's results) stays
      stored = json.loads((tmp_path / 'accelerator.json').read_text())
      next(iter(stored['runs'].values()))['feed'] = [{'label': 'a feed run'}]
      (tmp_path / 'accelerator.json').write_text(json.dumps(stored))
  assert calls == [(8, True), (16, True), (32, False)]
  _, run, rows = _rows(tmp_path)
  assert sorted({batch for _, batch, _ in rows}) == [8, 16, 32] and len(run['commands']) == 2
  assert run['feed'] == [{'label': 'a feed run'}]
  assert rows['rnn_ce', 32, 'bp.BPTT']['error'] == 'not tried: its step was refused at batch 16'
  device.main(['--quick', '--workloads', 'rnn_ce', '--batches', '16', '--out', str(tmp_path)])
  assert calls[-1] == (16, False)  # the refused batch itself: its row keeps the device's words, marked stored
  _, _, rows = _rows(tmp_path)
  assert rows['rnn_ce', 16, 'bp.BPTT']['error'] == 'stored: ' + REFUSAL
  device.main(['--quick', '--workloads', 'rnn_ce', '--batches', '32', '--out', str(tmp_path)])
  assert calls[-1] == (32, False)  # and a later call still finds the refusal
  device.main(['--quick', '--workloads', 'rnn_ce', '--batches', '16', '--rounds', '3', '--out', str(tmp_path)])
  assert calls[-1] == (16, True)  # other settings: nothing reused


def test_host_copy_alone_measures_every_way_from_each_kind_of_slices(tmp_path):
  """``--host-copy`` without ``--batches``: plain JAX's copies only (no trainer), every way of COPY_WAYS (pinned
  staging included: the CPU offers JAX's 'pinned_host' memory kind too), reported as a table."""
  device.main(['--quick', '--host-copy', '0.002', '--piece-mb', '0.1', '--out', str(tmp_path)])
  data, run, rows = _rows(tmp_path)
  assert rows == {}
  ways = {(c['way'], c['slices']) for c in run['host_copy']}
  assert ways == {(way, slices) for way, _, _ in streaming.COPY_WAYS
                  for slices in ('untouched', 'written earlier', 'touched')}
  sample = device.QUICK['shape'].time * device.QUICK['shape'].inputs * 4  # bytes: pieces are whole samples
  assert all(c['error'] is None and c['gb_per_s'] > 0 and c['piece_bytes'] == int(0.1 * 2 ** 20) // sample * sample
             for c in run['host_copy'])
  report = (tmp_path / 'accelerator.md').read_text()
  assert '### A piece copied to the device out of a host array' in report and '| 0.002 GB | direct, 4 threads |' in report


def _phases(**seconds):
  from brainpy_accum.diagnostics._phases import PHASES
  table = {name: {'seconds': seconds.get(name.split()[0], 0.), 'compile_seconds': 0., 'compilations': 0}
           for name in PHASES + ('beside', 'total')}
  table['total']['seconds'] = sum(seconds.values())
  return table


def test_startup_table_sets_each_first_epoch_against_bptts_at_the_same_batch_or_its_largest():
  rows = [{'batch': 8, 'trainer': 'bp.BPTT', 'first_epoch_s': 2., 'first_fit_phases': _phases(step=1., runs=1.)},
          {'batch': 8, 'trainer': 'AccumBPTT', 'first_epoch_s': 3., 'first_fit_phases': _phases(planning=1., step=2.)},
          {'batch': 16, 'trainer': 'bp.BPTT', 'first_epoch_s': None, 'fits': False},
          {'batch': 16, 'trainer': 'AccumBPTT', 'first_epoch_s': 5., 'first_fit_phases': _phases(runs=5.)}]
  table = device_report._startup_table(rows)
  assert '| 8 | AccumBPTT | 3.00 | 1.50 | 1.00 (0) |' in '\n'.join(table)
  assert '| 16 | AccumBPTT | 5.00 | 2.50 * (at 8) |' in '\n'.join(table)
  assert not any('| 16 | bp.BPTT' in line for line in table)


@pytest.mark.long  # about 7 s: README suite time
def test_feed_bench_times_device_copies_beside_and_numpy_units(tmp_path):
  """bench.feed: each kind of epoch timed every round, the NumPy epoch's units recorded (one a batch: the waits,
  sends and arrivals the loop made), the copier measured; on a CPU also a batch streamed in pieces (a 40 KiB
  budget is one of the CPU's byte figures), its periods apart by a piece's place in its batch."""
  from brainpy_accum.bench import feed
  cpu = jax.default_backend() == 'cpu'
  path = tmp_path / 'feed.json'
  result = feed.main(['--quick', '--rounds', '2', '--json', str(path)] + (['--stream', '32', '--budget', '40KiB']
                                                                         if cpu else []))
  assert json.loads(path.read_text())['batch'] == 16
  assert all(len(times) == 2 for times in result['epoch_s'].values()) and len(result['epoch_s']) == 3
  free = {key: result['units'].pop(key) for key in ('free', 'free_min')}  # (only where the device reports memory)
  assert all(value is not None and value >= 0 for value in result['units'].values())
  assert (free['free_min'] is None) == cpu and (cpu or 0 < free['free_min'] <= free['free'])
  assert result['copier_gb_per_s'] > 0 and [len(r['wait']) for r in result['records']] == [2, 2]
  assert [len(r['arrival']) for r in result['records']] == [1, 1]  # the epoch's second batch, sent ahead
  if cpu:
    stream = result['stream']
    pieces = -(-32 // stream['piece'])
    assert 1 < pieces and len(stream['epoch_s']) == 2 and len(stream['records'][0]['wait']) == 2 * pieces
    assert stream['units']['period_first'] > 0 and stream['units']['period_rest'] > 0
  assert 'samples/s' in feed.feed_section(result)
  spikes = feed.measure_feed(feed.QUICK['shape'], 16, 2, 1, 2 ** 30 if cpu else None, spikes=True)
  assert spikes['spikes'] and spikes['piece_bytes'] * 4 == result['piece_bytes']


def test_feed_timeline_records_each_dispatched_unit(monkeypatch):
  from brainpy_accum.bench import feed
  from brainpy_accum.memory._device import DeviceMemory
  originals = (Sender.dispatched, Sender.send)
  memory = DeviceMemory(limit=2 ** 30, in_use=2 ** 20, kind='tpu', reserved=2 ** 29)  # (the room the send checks)
  monkeypatch.setattr(feed, 'device_memory', lambda: memory)
  with overlapping(True), feed.feed_timeline() as units:
    sender = Sender()
    for _ in range(4):
      sender.dispatched(jax.numpy.zeros(2))
      sender.send((np.ones((2, 3), np.float32),))
  assert len(units['wait']) == 4 and len(units['send']) == 4 and len(units['period']) == 3
  assert units['refused'] == [0., 0., 0., 0.] and (Sender.dispatched, Sender.send) == originals  # put back
  assert units['free'] == [2 ** 29 - 2 ** 20] * 4 and feed._summary([units])['free_min'] == 2 ** 29 - 2 ** 20
  assert 'least device memory free before a send 0.50 GiB' in feed._units_text(feed._summary([units]))


@pytest.mark.long  # about 8 s: README suite time
def test_warm_up_leaves_each_first_epoch_its_own_compilations():
  """The first fits at a batch size start after a throwaway model of the workload was built and reset there: the
  trainer measured first compiles what a second one of its kind compiles, no more (bp.BPTT measured first held
  the process's first programs of the model: 22 compilations against AccumBPTT's 8 on the TPU v5e)."""
  from brainpy_accum.diagnostics._compiles import count_compilations
  shape = device.QUICK['shape']._replace(batch=23, time=5)  # a shape no other test compiles
  host = [make_batch(shape, workload='snn_ce')] * 2
  with count_compilations() as warm_up:
    device._warm_up('snn_ce', shape)
  counts = []
  for _ in range(2):
    row = {}
    device._first_epoch(lambda: device._Trainer('bp.BPTT', 'snn_ce', shape, None), host, row)
    counts.append(row['first_fit_phases']['total']['compilations'])
  assert warm_up() > 0 and counts[0] == counts[1]
