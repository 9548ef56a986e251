"""``python -m brainpy_accum.bench.feed``: where a NumPy epoch loses time against device data, on an accelerator.

AccumBPTT's ``fit`` sends each NumPy batch (or each piece of a streamed one) to the device while the step before
it runs (:mod:`~brainpy_accum.trainer._feed`). On a TPU v5e such epochs ran at 0.88-0.91 of the same trainer on
device data although a piece's copy (about 50 ms for 512 MiB on 8 threads) is shorter than the step it hides
behind (about 61 ms). For the bench's spiking network at ``--batch`` (a batch that runs whole on the device) this
times, in the same rounds:

- ``device``: an epoch on device batches (no copy);
- ``device, copies beside``: the same while another thread copies pieces of the same size out of a host array the
  way ``fit`` does (slices on threads, joined on the device), back to back: whether a copy slows the step that
  runs beside it (then the feed cannot hide it whatever the loop does);
- ``numpy, sent ahead``: the epoch ``fit`` gives a user, with each unit's time in the loop's two waits: for the
  step before to end (``wait``: the device is the bound) and in sending the next unit (``send``: the host is);

and the join of a piece's slices alone on the device. ``--stream B`` adds the NumPy epoch of a batch streamed in
pieces (its units are pieces). Prints a markdown section; ``--json`` writes the measurements.
"""

import argparse
import contextlib
import json
import statistics
import threading
import time
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..memory import parse_memory
from ..trainer import _feed
from .accelerator import ACCELERATOR, QUICK, _Trainer
from .workloads import Shape, make_batch

__all__ = ['feed_timeline', 'measure_feed', 'feed_section', 'main']

WORKLOAD = 'snn_ce'


@contextlib.contextmanager
def feed_timeline():
  """Within the ``with``, every unit ``fit`` dispatches is recorded: ``{'wait': [...], 'send': [...], 'period':
  [...]}`` in seconds: the time in waiting for the step before, in sending the next unit, and between dispatches.

  Examples
  --------
  >>> import jax.numpy as jnp
  >>> from brainpy_accum.trainer._feed import Sender, overlapping
  >>> with overlapping(True), feed_timeline() as units:
  ...   sender = Sender()
  ...   for _ in range(3):
  ...     sender.dispatched(jnp.zeros(2))
  >>> len(units['wait']), len(units['period'])
  (3, 2)
  """
  units: Dict[str, List[float]] = {'wait': [], 'send': [], 'period': []}
  dispatched, send, last = _feed.Sender.dispatched, _feed.Sender.send, [None]

  def timed_dispatched(self, outputs):
    start = time.perf_counter()
    if last[0] is not None:
      units['period'].append(start - last[0])
    last[0] = start
    dispatched(self, outputs)
    units['wait'].append(time.perf_counter() - start)

  def timed_send(self, data):
    start = time.perf_counter()
    try:
      return send(self, data)
    finally:
      units['send'].append(time.perf_counter() - start)

  _feed.Sender.dispatched, _feed.Sender.send = timed_dispatched, timed_send
  try:
    yield units
  finally:
    _feed.Sender.dispatched, _feed.Sender.send = dispatched, send


class _Copier:
  """A thread copying pieces of ``rows`` rows of ``host`` to the device as ``fit`` does, back to back, while
  open; ``gb_per_s()`` afterwards."""

  def __init__(self, host: np.ndarray, rows: int):
    self.host, self.rows, self.copied, self.seconds = host, rows, 0, 0.
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    start, at = time.perf_counter(), 0
    while not self._stop.is_set():
      piece = self.host[at:at + self.rows]
      jax.block_until_ready(_feed._put(piece))
      self.copied += piece.nbytes
      at = (at + self.rows) % (len(self.host) - self.rows + 1)
    self.seconds = time.perf_counter() - start

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()

  def gb_per_s(self) -> float:
    return self.copied / self.seconds / 1e9 if self.seconds else 0.


def _epoch_seconds(trainer: _Trainer, batches: list, overlap: Optional[bool] = None) -> float:
  with _feed.overlapping(overlap):
    start = time.perf_counter()
    trainer.epoch(batches, quiet=True)
    return time.perf_counter() - start


def _join_seconds(piece: np.ndarray, repeats: int = 5) -> float:
  """The median time of joining a piece's slices, already on the device, into one array there."""
  rows = np.linspace(0, len(piece), _feed.PUT_THREADS + 1).astype(int)
  slices = jax.block_until_ready([jax.device_put(piece[a:b]) for a, b in zip(rows[:-1], rows[1:])])
  jax.block_until_ready(jnp.concatenate(slices, axis=0))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(jnp.concatenate(slices, axis=0))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _medians(units: Dict[str, List[float]]) -> Dict[str, float]:
  return {key: statistics.median(values) if values else None for key, values in units.items()}


def measure_feed(shape: Shape, batch: int, epoch: int, rounds: int, budget: Optional[int],
                 stream: Optional[int] = None) -> dict:
  """The measurements of the module's docstring: ``{'batch', 'epoch_s': {kind: [per round]}, 'copier_gb_per_s',
  'units': {'wait', 'send', 'period'} (medians), 'join_s', 'stream': {...} or None}``."""
  trainer = _Trainer('AccumBPTT', WORKLOAD, shape._replace(batch=batch), budget)
  x, y = make_batch(shape._replace(batch=batch), workload=WORKLOAD)
  host, source = [(x, y)] * epoch, np.array(x)  # the copier's own host array (written: a batch made before)
  on_device = [jax.block_until_ready(jax.device_put((x, y)))] * epoch
  _epoch_seconds(trainer, host[:2], overlap=True)  # planning, compilations
  _epoch_seconds(trainer, on_device[:2])
  times: Dict[str, List[float]] = {'device': [], 'device, copies beside': [], 'numpy, sent ahead': []}
  copier_rates, units = [], {'wait': [], 'send': [], 'period': []}
  for _ in range(rounds):
    times['device'].append(_epoch_seconds(trainer, on_device))
    with _Copier(source, batch) as copier:
      times['device, copies beside'].append(_epoch_seconds(trainer, on_device))
    copier_rates.append(copier.gb_per_s())
    with feed_timeline() as recorded:
      times['numpy, sent ahead'].append(_epoch_seconds(trainer, host, overlap=True))
    for key in units:
      units[key] += recorded[key]
  result = {'batch': batch, 'epoch': epoch, 'piece_bytes': int(x.nbytes), 'epoch_s': times,
            'copier_gb_per_s': statistics.median(copier_rates), 'units': _medians(units),
            'join_s': _join_seconds(x), 'stream': None}
  del on_device
  if stream:
    result['stream'] = _streamed(shape, stream, epoch, rounds, budget)
  return result


def _streamed(shape: Shape, batch: int, epoch: int, rounds: int, budget: Optional[int]) -> dict:
  """A NumPy epoch of a batch streamed in pieces, with its units' waits."""
  trainer = _Trainer('AccumBPTT', WORKLOAD, shape._replace(batch=batch), budget)
  x, y = make_batch(shape._replace(batch=batch), workload=WORKLOAD)
  host = [(x, y)] * epoch
  _epoch_seconds(trainer, host[:1], overlap=True)
  times, units = [], {'wait': [], 'send': [], 'period': []}
  for _ in range(rounds):
    with feed_timeline() as recorded:
      times.append(_epoch_seconds(trainer, host, overlap=True))
    for key in units:
      units[key] += recorded[key]
  return {'batch': batch, 'piece': trainer.trainer.stream_chunks.get(batch), 'epoch_s': times,
          'units': _medians(units)}


def feed_section(result: dict) -> str:
  """The measurements as markdown."""
  batch, epoch = result['batch'], result['epoch']
  rate = {kind: epoch * batch / statistics.median(ts) for kind, ts in result['epoch_s'].items()}
  ms = lambda s: '-' if s is None else f'{1e3 * s:.1f}'  # noqa: E731
  lines = [f'Device: {jax.devices()[0].device_kind}. Batch {batch} ({result["piece_bytes"] / 2 ** 20:.0f} MiB of '
           f'inputs), epochs of {epoch} batches, {len(result["epoch_s"]["device"])} rounds.', '',
           '| epoch | samples/s | / device |', '|---|---|---|']
  lines += [f'| {kind} | {value:,.0f} | {value / rate["device"]:.3f} |' for kind, value in rate.items()]
  units = result['units']
  lines += ['', f'The copies beside ran at {result["copier_gb_per_s"]:.2f} GB/s. NumPy units (medians, ms): period '
                f'{ms(units["period"])}, wait for the step before {ms(units["wait"])}, send {ms(units["send"])}; '
                f'the join of a piece\'s slices on the device alone {ms(result["join_s"])}; a device epoch\'s step '
                f'{ms(statistics.median(result["epoch_s"]["device"]) / epoch)}.']
  stream = result.get('stream')
  if stream:
    per_piece = statistics.median(stream['epoch_s']) / epoch / max(1, -(-stream['batch'] // (stream['piece'] or 1)))
    lines += ['', f'Streamed: batch {stream["batch"]} in pieces of {stream["piece"]}: '
                  f'{epoch * stream["batch"] / statistics.median(stream["epoch_s"]):,.0f} samples/s, '
                  f'{ms(per_piece)} ms a piece; units: period {ms(stream["units"]["period"])}, wait '
                  f'{ms(stream["units"]["wait"])}, send {ms(stream["units"]["send"])}.']
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
  parser.add_argument('--json', default=None, help='also write the measurements to this file')
  args = parser.parse_args(argv)
  preset = QUICK if args.quick else ACCELERATOR
  budget = args.budget or (None if jax.default_backend() != 'cpu' else '1GiB')
  result = measure_feed(preset['shape'], args.batch or (16 if args.quick else 2048),
                        args.epoch or (2 if args.quick else 16), args.rounds,
                        None if budget is None else parse_memory(budget), args.stream)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)
  print(feed_section(result))
  return result


if __name__ == '__main__':
  main()
