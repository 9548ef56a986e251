"""``python -m brainpy_accum.bench.streaming``: the largest batch within a memory budget, and beyond it.

Three figures for one workload and budget, all from XLA's compile-time memory analysis (deterministic):

1. the largest batch whose ``bp.BPTT`` train step fits the budget;
2. the largest batch whose ``AccumBPTT(num_micro_batch=8)`` step fits, with the whole batch's data still an
   argument of the step (target: at least 0.9 x 8 times the first);
3. streaming: ``AccumBPTT(num_micro_batch='auto', memory_budget=...)`` on a batch whose data alone is several
   times the budget, cut on the host into chunks whose step fits; two updates on it, compared with
   ``bp.BPTT`` on the whole batch (which this CPU machine can still run). Random data: this checks the
   steps, not learning.
"""

import argparse
import os
import time
from typing import Optional, Sequence

import brainpy as bp
import jax
import numpy as np

from ..memory import format_memory, parse_memory
from ..trainer import AccumBPTT
from .measure import largest_batch_within
from .workloads import Shape, make_batch, make_brainpy_model

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
