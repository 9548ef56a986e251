"""``python -m brainpy_accum.bench.streaming``: the largest batch within a memory budget, and beyond it.

Three figures for one workload and budget, all from XLA's compile-time memory analysis (deterministic):

1. the largest batch whose ``bp.BPTT`` train step fits the budget;
2. the largest batch whose ``AccumBPTT(num_micro_batch=8)`` step fits, with the whole batch's data still an
   argument of the step (target: at least 0.9 x 8 times the first);
3. streaming: ``AccumBPTT(num_micro_batch='auto', memory_budget=...)`` on a batch whose data alone is several
   times the budget, cut on the host into chunks whose step fits; two updates on it, compared with
   ``bp.BPTT`` on the whole batch (which this CPU machine can still run). Random data: this checks the
   steps, not learning.

:func:`measure_host_copy` (``python -m brainpy_accum.bench.accelerator --host-copy 4 8 16``) measures, in plain
JAX, a piece's copy to the device out of host arrays of several sizes: the limit that streamed pieces meet.
"""

import argparse
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, List, Optional, Sequence, Tuple

import brainpy as bp
import jax
import numpy as np

from ..memory import format_memory, parse_memory
from ..trainer import AccumBPTT
from .measure import largest_batch_within
from .workloads import Shape, make_batch, make_brainpy_model

__all__ = ['COPY_WAYS', 'measure_host_copy', 'stream_check', 'streaming_section', 'main']

SHAPE = Shape(batch=64, time=100, hidden=128, inputs=64)


def _relative_error(actual, expected) -> float:
  a = np.concatenate([np.ravel(x) for x in actual])
  e = np.concatenate([np.ravel(x) for x in expected])
  return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def _params(model):
  return [np.asarray(v.value) for v in model.train_vars().unique().values()]


def stream_check(workload: str, shape: Shape, budget: int, batch: int, steps: int = 2) -> dict:
  """Train ``steps`` updates on one batch of ``batch`` samples with streaming and with ``bp.BPTT``."""
  data = [make_batch(shape._replace(batch=batch), seed=s) for s in range(steps)]
  reference = bp.BPTT(make_brainpy_model(workload, shape), bp.losses.mean_squared_error,
                      optimizer=bp.optim.Adam(lr=1e-3), progress_bar=False)
  reference.fit(data, num_epoch=1)
  trainer = AccumBPTT(make_brainpy_model(workload, shape), bp.losses.mean_squared_error,
                      optimizer=bp.optim.Adam(lr=1e-3), progress_bar=False, num_micro_batch='auto',
                      memory_budget=budget)
  started = time.time()
  trainer.fit(data, num_epoch=1)
  chunk = trainer.stream_chunks.get(batch)
  return {'batch': batch, 'data_bytes': int(sum(a.nbytes for a in data[0])), 'chunk': chunk,
          'plan': None if chunk is None else trainer.memory_plans[chunk][0].describe(),
          'chunk_step_bytes': None if chunk is None else trainer.memory_plans[chunk][1],
          'error': _relative_error(_params(trainer.target), _params(reference.target)),
          'loss_error': float(np.max(np.abs(trainer.train_losses - reference.train_losses))),
          'seconds': time.time() - started}


def streaming_section(workload: str = 'rnn', shape: Shape = SHAPE, budget: int = parse_memory('16MiB'),
                      stream_factor: int = 40) -> str:
  """The markdown section: largest batches within ``budget`` and a streamed batch of ``stream_factor`` x
  ``bp.BPTT``'s largest."""
  bptt = largest_batch_within(budget, 'bptt', workload, shape)
  accum8 = largest_batch_within(budget, 'accum', workload, shape, 8)
  streamed = stream_check(workload, shape, budget, stream_factor * bptt)
  ratio = accum8 / bptt
  lines = [
    f'## Streaming: the largest batch within {format_memory(budget)} ({workload}, T={shape.time}, {shape.hidden} hidden, '
    f'{shape.inputs} inputs; jax {jax.__version__})', '',
    '| method | largest batch | / bp.BPTT |', '|---|---|---|',
    f'| bp.BPTT | {bptt} | 1.0 |',
    f'| AccumBPTT N=8, data on the device | {accum8} | {ratio:.1f} (target >= {0.9 * 8:.1f}: '
    f'{"met" if ratio >= 0.9 * 8 else "MISSED"}) |',
    f'| AccumBPTT, streamed from the host | {streamed["batch"]} trained (bounded by host memory only) | '
    f'{streamed["batch"] / bptt:.0f} (target >= {0.9 * 8:.1f}: '
    f'{"met" if streamed["batch"] >= 0.9 * 8 * bptt and streamed["error"] < 1e-5 else "MISSED"}) |', '',
    f'The streamed batch of {streamed["batch"]} holds {format_memory(streamed["data_bytes"])} of inputs and '
    f'targets, {streamed["data_bytes"] / budget:.1f} times the budget. It ran in chunks of {streamed["chunk"]} '
    f'({streamed["plan"]}), whose train step needs {format_memory(streamed["chunk_step_bytes"] or 0)}. After '
    f'two updates its parameters differ from bp.BPTT\'s on the whole batch by {streamed["error"]:.1e} '
    f'(relative L2), its losses by {streamed["loss_error"]:.1e}; {streamed["seconds"]:.0f} s including '
    f'planning and compilation.']
  return '\n'.join(lines)


# How a piece is copied out of a host array (:func:`measure_host_copy`): (name, staging, threads)
COPY_WAYS = (('direct, one thread (fit\'s way)', None, 1), ('direct, 4 threads', None, 4),
             ('direct, 8 threads', None, 8),
             ('staged in a reused host buffer', 'reused', 1), ('staged in a fresh host buffer', 'fresh', 1),
             ('pinned host buffer, then the device', 'pinned', 1))


def _copy_piece(piece: np.ndarray, staging: Optional[str], threads: int, reused: np.ndarray, device) -> None:
  """One piece to the device, in one way of :data:`COPY_WAYS`, waited for."""
  if staging == 'reused':
    np.copyto(reused, piece)
    piece = reused
  elif staging == 'fresh':
    piece = np.array(piece)
  elif staging == 'pinned':  # JAX's pinned host memory, then the device's (where the device offers the kind)
    pinned = jax.device_put(piece, jax.sharding.SingleDeviceSharding(device, memory_kind='pinned_host'))
    jax.block_until_ready(jax.device_put(pinned, jax.sharding.SingleDeviceSharding(device)))
    return
  if threads == 1:
    jax.block_until_ready(jax.device_put(piece, device))
    return
  parts = np.array_split(piece, threads)
  with ThreadPoolExecutor(threads) as pool:
    jax.block_until_ready(list(pool.map(lambda part: jax.device_put(part, device), parts)))


def measure_host_copy(host_gb: Sequence[float] = (4, 8, 16), piece_mb: float = 512, repeats: int = 5,
                      quiet: bool = False, sample: Sequence[int] = (500, 128)) -> List[dict]:
  """Plain JAX: a piece of about ``piece_mb`` MB copied to the default device out of a float32 host array of each
  of ``host_gb`` GB, in each way of :data:`COPY_WAYS`, from slices of three kinds: untouched (each way copies out
  of an array of its own never written since it was made: the copy faults its pages in), written earlier (the
  array written once, before any of these copies, as a batch made before training is: the feed's case) and
  touched (written just before the copy). The arrays are batches of samples of shape ``sample`` (the bench's
  spiking network's inputs: T=500, 128 inputs; a TPU lays out a multi-dimensional array in tiles, so a flat
  array's copy is another measurement) and a piece is whole samples, as ``fit``'s pieces are. Each copy takes
  the array's next slice, the ways of a kind one after another, again from the first once all were copied
  (``distinct_slices`` in a row: how many different slices its copies read; an array of fewer slices than a
  kind's copies has some read again); the median of ``repeats`` copies. A row per (host size, way, slices):
  ``seconds`` and ``gb_per_s`` (or ``error``), each also printed unless ``quiet``.

  Examples
  --------
  >>> rows = measure_host_copy(host_gb=(0.0005,), piece_mb=0.05, repeats=1, quiet=True, sample=(4, 8))
  >>> sorted({row['slices'] for row in rows}), all(row['gb_per_s'] > 0 for row in rows), rows[0]['piece_bytes']
  (['touched', 'untouched', 'written earlier'], True, 52352)
  """
  device, rows, per_sample = jax.devices()[0], [], int(np.prod(sample))
  for gb in host_gb:
    samples = int(gb * 2 ** 30) // (4 * per_sample)
    size = max(1, min(int(piece_mb * 2 ** 20) // (4 * per_sample), samples // 2))
    reused = np.empty((size, *sample), np.float32)
    host = np.ones((samples, *sample), np.float32)  # written once, before any copy (a batch made before training)
    starts = range(0, samples - size + 1, size)
    for slices in ('untouched', 'written earlier', 'touched'):
      taken = itertools.cycle(starts)  # the ways of a kind take the array's slices in turn, one after another
      for name, staging, threads in COPY_WAYS:
        source = host
        if slices == 'untouched':  # each way its own array never written (zero pages, mapped when read), from its start
          source, taken = np.zeros((samples, *sample), np.float32), itertools.cycle(starts)
        times, error = _copies(source, taken, size, repeats, (staging, threads, reused, device), slices == 'touched')
        seconds = float(np.median(times)) if times else None
        nbytes = size * per_sample * 4
        rows.append({'host_gb': gb, 'piece_bytes': nbytes, 'way': name, 'slices': slices, 'seconds': seconds,
                     'gb_per_s': None if seconds is None else nbytes / seconds / 1e9, 'error': error,
                     'distinct_slices': min(repeats, len(starts)), 'sample': list(sample)})
        if not quiet:
          print(f"host copy: {gb} GB array, piece {nbytes / 2 ** 20:.0f} MiB, {slices}, {name}: "
                + (error or f"{seconds * 1e3:.1f} ms, {rows[-1]['gb_per_s']:.2f} GB/s"), flush=True)
        del source
    del host, reused
  return rows


def _copies(source: np.ndarray, taken: Iterator[int], size: int, repeats: int, way: tuple,
            touch: bool) -> Tuple[List[float], Optional[str]]:
  """Seconds of ``repeats`` copies of slices of ``source`` (at the next starts ``taken``), each written just before
  its copy where ``touch``; the error of a way the device does not offer."""
  times = []
  for _ in range(repeats):
    start = next(taken)
    piece = source[start:start + size]
    if touch:
      piece.fill(1.)
    began = time.perf_counter()
    try:
      _copy_piece(piece, *way)
    except Exception as failure:  # noqa: BLE001 -- a way the device does not offer is a finding
      return times, f'{type(failure).__name__}: {str(failure)[:200]}'
    times.append(time.perf_counter() - began)
  return times, None


def main(argv: Optional[Sequence[str]] = None) -> str:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.streaming', description=__doc__.split('\n')[0])
  parser.add_argument('--budget', default='16MiB')
  parser.add_argument('--factor', type=int, default=40, help="streamed batch / bp.BPTT's largest batch")
  parser.add_argument('--quick', action='store_true', help='a small workload (seconds)')
  parser.add_argument('--out', default=None, help='write the section to this markdown file')
  args = parser.parse_args(argv)
  shape = Shape(batch=8, time=20, hidden=16, inputs=16) if args.quick else SHAPE
  text = streaming_section('rnn', shape, parse_memory(args.budget), args.factor)
  print(text)
  if args.out:
    os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
    with open(args.out, 'w') as f:
      f.write(f'# Streaming batches larger than the device\n\nMade by `python -m brainpy_accum.bench.streaming`. '
              f'{__doc__.split(chr(10), 2)[2].strip()}\n\n{text}\n')
  return text


if __name__ == '__main__':
  main()
