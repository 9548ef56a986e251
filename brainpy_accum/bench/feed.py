"""``python -m brainpy_accum.bench.feed``: where a NumPy epoch loses time against device data, on an accelerator.

AccumBPTT's ``fit`` sends each NumPy batch (or each piece of a streamed one) to the device while the step before
it runs (:mod:`~brainpy_accum.trainer._feed`). On a TPU v5e such epochs ran at 0.89-0.90 of the same trainer on
device data at a batch of 2,048, and at 0.83-0.85 streamed at 32,768, although a piece's copy (about 52 ms for
512 MiB) is shorter than the step it hides behind (about 61 ms). For the bench's spiking network at ``--batch`` (a
batch that runs whole on the device) this times, in the same rounds:

- ``device``: an epoch on device batches (no copy);
- ``device, copies beside``: the same while another thread copies arrays of the same size to the device the way
  ``fit`` does, back to back: whether a copy slows the step that runs beside it (then the feed cannot hide it
  whatever the loop does);
- ``numpy, sent ahead``: the epoch ``fit`` gives a user, with each unit's time in the loop's two waits: for the
  step before to end (``wait``) and in sending the next unit (``send``: the host's part of starting the copy),
  the time between dispatches (``period``), how long each copy took to arrive (``arrival``: from its send until
  its arrays are ready on the device, timed on a thread of its own), how many sends found no room on the device
  (the step then copies its own data) and the device's memory free before each send (``free``).

``--stream B`` adds the NumPy epoch of a batch streamed in pieces (its units are pieces), measured after the first
part's arrays are freed, with the periods of each batch's first piece apart from the others'. Prints a markdown
section (medians, and the mean period: the median hides units that wait long); ``--json`` writes the
measurements, every unit's included.
"""

import argparse
import contextlib
import json
import statistics
import threading
import time
from typing import Dict, List, Optional, Sequence

import jax
import numpy as np

from ..memory import parse_memory
from ..memory._device import device_memory
from ..trainer import _feed
from .accelerator import ACCELERATOR, QUICK, _Trainer
from .workloads import Shape, make_batch

__all__ = ['feed_timeline', 'measure_feed', 'feed_section', 'main']

WORKLOAD = 'snn_ce'
UNITS = ('wait', 'send', 'period', 'arrival', 'refused', 'free')  # what feed_timeline records of each unit


@contextlib.contextmanager
def feed_timeline():
  """Within the ``with``, every unit ``fit`` dispatches is recorded: ``{'wait': [...], 'send': [...], 'period':
  [...], 'arrival': [...], 'refused': [...]}``, in seconds: the time in waiting for the step before, in sending the
  next unit, between dispatches, and from each send until the copy is ready on the device (in the order the copies
  arrive; waited for on leaving the ``with``); ``refused``: 1.0 for a send that found no room, else 0.0; ``free``:
  the device's bytes free for it before each send (none recorded where the device reports no memory: a CPU).

  Examples
  --------
  >>> import numpy as np, jax.numpy as jnp
  >>> from brainpy_accum.trainer._feed import Sender, overlapping
  >>> with overlapping(True), feed_timeline() as units:
  ...   sender = Sender()
  ...   for _ in range(3):
  ...     sender.dispatched(jnp.zeros(2))
  ...     _ = sender.send(np.ones(2, np.float32))
  >>> len(units['wait']), len(units['period']), len(units['arrival'])
  (3, 2, 3)
  """
  units: Dict[str, List[float]] = {key: [] for key in UNITS}
  dispatched, send, last, watchers = _feed.Sender.dispatched, _feed.Sender.send, [None], []

  def timed_dispatched(self, outputs):
    start = time.perf_counter()
    if last[0] is not None:
      units['period'].append(start - last[0])
    last[0] = start
    dispatched(self, outputs)
    units['wait'].append(time.perf_counter() - start)

  def arrived(sent, start):
    jax.block_until_ready(sent)
    units['arrival'].append(time.perf_counter() - start)

  def timed_send(self, data):
    memory = device_memory() if self.enabled else None
    if memory is not None:
      units['free'].append(float(memory.limit - memory.in_use - memory.reserved))
    start = time.perf_counter()
    sent = send(self, data)
    units['send'].append(time.perf_counter() - start)
    units['refused'].append(float(self.enabled and sent is None))
    if sent is not None:
      watchers.append(threading.Thread(target=arrived, args=(sent, start), daemon=True))
      watchers[-1].start()
    return sent

  _feed.Sender.dispatched, _feed.Sender.send = timed_dispatched, timed_send
  try:
    yield units
  finally:
    _feed.Sender.dispatched, _feed.Sender.send = dispatched, send
    for watcher in watchers:
      watcher.join()


class _Copier:
  """A thread copying ``host`` to the device as ``fit`` does, back to back, while open, each copy only where the
  device has room for it (else it waits: the step must not run out of memory and change its plan);
  ``gb_per_s()`` afterwards. An error of a copy is raised on leaving."""

  def __init__(self, host: np.ndarray):
    self.host, self.copied, self.seconds, self.error = host, 0, 0., None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    start = time.perf_counter()
    try:
      while not self._stop.is_set():
        if not _feed._room_for(_feed.prefetch_bytes(self.host, ())):
          time.sleep(0.001)
          continue
        jax.block_until_ready(_feed._put(self.host))
        self.copied += self.host.nbytes
    except Exception as error:  # noqa: BLE001 -- raised on the caller's thread
      self.error = error
    self.seconds = time.perf_counter() - start

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    if self.error is not None and exc[0] is None:
      raise RuntimeError('a copy beside the device epoch failed') from self.error

  def gb_per_s(self) -> float:
    return self.copied / self.seconds / 1e9 if self.seconds else 0.


def _epoch_seconds(trainer: _Trainer, batches: list, overlap: Optional[bool] = None) -> float:
  with _feed.overlapping(overlap):
    start = time.perf_counter()
    trainer.epoch(batches, quiet=True)
    return time.perf_counter() - start


def _summary(recorded: Sequence[Dict[str, List[float]]], pieces: int = 1) -> Dict[str, Optional[float]]:
  """Over the rounds' records: each of :data:`UNITS`' median (``refused``: the share of sends that found no room;
  ``None`` where none was recorded), and of the periods and arrivals the mean, the 90th percentile and the
  largest; with ``pieces`` units a batch, also the mean period before each batch's first unit (``period_first``:
  across a batch's end) and before the others."""
  values = {key: [value for units in recorded for value in units[key]] for key in UNITS}
  summary = {key: statistics.median(found) if found else None for key, found in values.items()}
  summary['refused'] = statistics.fmean(values['refused']) if values['refused'] else None  # a share, not a median
  summary['free_min'] = min(values['free']) if values['free'] else None
  for key in ('period', 'arrival'):
    found = np.asarray(values[key])
    summary.update({f'{key}_mean': float(found.mean()) if found.size else None,
                    f'{key}_p90': float(np.percentile(found, 90)) if found.size else None,
                    f'{key}_max': float(found.max()) if found.size else None})
  if pieces > 1:  # period i ends at unit i + 1's dispatch; the units of a round run from a batch's first piece
    first = [p for units in recorded for i, p in enumerate(units['period']) if (i + 1) % pieces == 0]
    rest = [p for units in recorded for i, p in enumerate(units['period']) if (i + 1) % pieces]
    summary.update(period_first=statistics.fmean(first) if first else None,
                   period_rest=statistics.fmean(rest) if rest else None)
  return summary


def measure_feed(shape: Shape, batch: int, epoch: int, rounds: int, budget: Optional[int],
                 stream: Optional[int] = None, spikes: bool = False) -> dict:
  """The measurements of the module's docstring: ``{'batch', 'epoch_s': {kind: [per round]}, 'copier_gb_per_s',
  'units': (:func:`_summary`; 'refused': the share of sends), 'records' (every unit's, a dict a round), 'plans'
  (the trainer's plan before and after the rounds: the same, or the copies beside changed it), 'stream': {...}
  or None}``. ``spikes``: the inputs as 0-or-1 ``uint8`` (a quarter of float32's bytes on the link; the device
  epochs are of uint8 batches too: set them against a float32 run's for the conversion's cost)."""
  result = _whole(shape._replace(batch=batch), epoch, rounds, budget, spikes)  # its arrays freed before the next
  result['stream'] = None if not stream else _streamed(shape._replace(batch=stream), epoch, rounds, budget, spikes)
  return dict(result, spikes=spikes)


def _batch(shape: Shape, spikes: bool):
  x, y = make_batch(shape, workload=WORKLOAD)
  return ((x < 0.3).astype(np.uint8) if spikes else x), y


def _whole(shape: Shape, epoch: int, rounds: int, budget: Optional[int], spikes: bool) -> dict:
  trainer = _Trainer('AccumBPTT', WORKLOAD, shape, budget)
  x, y = _batch(shape, spikes)
  host, source = [(x, y)] * epoch, np.array(x)  # the copier's own host array (written: a batch made before)
  on_device = [jax.block_until_ready(jax.device_put((x, y)))] * epoch
  _epoch_seconds(trainer, host[:2], overlap=True)  # planning, compilations
  _epoch_seconds(trainer, on_device[:2])
  plans = [trainer.plan()['plan']]
  times: Dict[str, List[float]] = {'device': [], 'device, copies beside': [], 'numpy, sent ahead': []}
  copier_rates, records = [], []
  for _ in range(rounds):
    times['device'].append(_epoch_seconds(trainer, on_device))
    with _Copier(source) as copier:
      times['device, copies beside'].append(_epoch_seconds(trainer, on_device))
    copier_rates.append(copier.gb_per_s())
    with feed_timeline() as recorded:
      times['numpy, sent ahead'].append(_epoch_seconds(trainer, host, overlap=True))
    records.append(recorded)
  del on_device
  return {'batch': shape.batch, 'epoch': epoch, 'piece_bytes': int(x.nbytes), 'epoch_s': times,
          'copier_gb_per_s': statistics.median(copier_rates), 'units': _summary(records), 'records': records,
          'plans': plans + [trainer.plan()['plan']]}


def _streamed(shape: Shape, epoch: int, rounds: int, budget: Optional[int], spikes: bool) -> dict:
  """A NumPy epoch of a batch streamed in pieces, with its units' waits."""
  batch, trainer = shape.batch, _Trainer('AccumBPTT', WORKLOAD, shape, budget)
  x, y = _batch(shape, spikes)
  host = [(x, y)] * epoch
  _epoch_seconds(trainer, host[:1], overlap=True)
  times, records = [], []
  for _ in range(rounds):
    with feed_timeline() as recorded:
      times.append(_epoch_seconds(trainer, host, overlap=True))
    records.append(recorded)
  piece = trainer.trainer.stream_chunks.get(batch)
  return {'batch': batch, 'piece': piece, 'epoch_s': times, 'units': _summary(records, -(-batch // (piece or batch))),
          'records': records}


def _ms(seconds: Optional[float]) -> str:
  return '-' if seconds is None else f'{1e3 * seconds:.1f}'


def _units_text(units: dict) -> str:
  """A unit summary (:func:`_summary`) in words, in ms (``-`` for what was not recorded: no unit was sent, or a
  result of an older bench without it)."""
  ms = lambda key: _ms(units.get(key))  # noqa: E731
  refused = units.get('refused')
  text = (f'period {ms("period")} (mean {ms("period_mean")}, 90th percentile {ms("period_p90")}, longest '
          f'{ms("period_max")}), wait for the step before {ms("wait")}, send {ms("send")}, arrival {ms("arrival")} '
          f'(90th percentile {ms("arrival_p90")}, longest {ms("arrival_max")}); sends refused for room: '
          + ('-' if refused is None else f'{refused:.0%}'))
  if units.get('free_min') is not None:
    text += f'; least device memory free before a send {units["free_min"] / 2 ** 30:.2f} GiB'
  if units.get('period_first') is not None:
    text += (f'; mean period before a batch\'s first piece {ms("period_first")}, before the others '
             f'{ms("period_rest")}')
  return text


def feed_section(result: dict) -> str:
  """The measurements as markdown."""
  batch, epoch = result['batch'], result['epoch']
  rate = {kind: epoch * batch / statistics.median(ts) for kind, ts in result['epoch_s'].items()}
  inputs = 'uint8 spike' if result.get('spikes') else 'float32'
  lines = [f'Device: {jax.devices()[0].device_kind}. Batch {batch} ({result["piece_bytes"] / 2 ** 20:.0f} MiB of '
           f'{inputs} inputs), epochs of {epoch} batches, {len(result["epoch_s"]["device"])} rounds.', '',
           '| epoch | samples/s | / device |', '|---|---|---|']
  lines += [f'| {kind} | {value:,.0f} | {value / rate["device"]:.3f} |' for kind, value in rate.items()]
  step = statistics.median(result['epoch_s']['device']) / epoch
  lines += ['', f'The copies beside ran at {result["copier_gb_per_s"]:.2f} GB/s; the plan {result["plans"][0]}'
                + ('' if len(set(result['plans'])) == 1 else f', after the rounds {result["plans"][1]}')
                + f'; a device epoch\'s step {_ms(step)} ms. NumPy units (medians, ms): '
                + f'{_units_text(result["units"])}.']
  stream = result.get('stream')
  if stream:
    seconds = statistics.median(stream['epoch_s'])
    how = 'not streamed (it ran whole)'
    if stream['piece']:
      pieces = -(-stream['batch'] // stream['piece'])
      how = f'in pieces of {stream["piece"]}, {_ms(seconds / epoch / pieces)} ms a piece'
    lines += ['', f'Streamed: batch {stream["batch"]} {how}: {epoch * stream["batch"] / seconds:,.0f} samples/s; '
                  f'units (ms): {_units_text(stream["units"])}.']
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.feed', description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true', help='a tiny network (seconds; for tests)')
  parser.add_argument('--batch', type=int, default=None, help='a batch that runs whole (default 2048; --quick 16)')
  parser.add_argument('--stream', type=int, default=None, help='also a NumPy epoch of this batch, streamed')
  parser.add_argument('--epoch', type=int, default=None, help='batches per epoch (default 16; --quick 2)')
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--budget', default=None, help="memory_budget (default: none on an accelerator; --quick and on "
                                                     "a CPU: 1GiB)")
  parser.add_argument('--uint8-spikes', action='store_true',
                      help='inputs as 0-or-1 uint8 (a quarter of float32\'s bytes on the host link)')
  parser.add_argument('--json', default=None, help='also write the measurements to this file')
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else ACCELERATOR
  budget = args.budget or (None if jax.default_backend() != 'cpu' else '1GiB')
  result = measure_feed(preset['shape'], args.batch or (16 if args.quick else 2048),
                        args.epoch or (2 if args.quick else 16), args.rounds,
                        None if budget is None else parse_memory(budget), args.stream, args.uint8_spikes)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)
  print(feed_section(result))
  return result


if __name__ == '__main__':
  main()
