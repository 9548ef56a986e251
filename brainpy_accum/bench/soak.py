"""``python -m brainpy_accum.bench.soak``: resident memory and compilations over a long run.

Trains a small rate RNN with ``AccumBPTT`` through :meth:`fit` for 2,000
steps (random batches: this checks the process, not learning) and samples the
process's current resident memory every 100 steps. After warm-up it must stop
growing: the growth between step 200 and the last step is reported against
the 5% target, with the XLA compilations of the step (one per batch shape).
"""

import argparse
import resource
from typing import Optional, Sequence

import brainpy as bp

from ..trainer import AccumBPTT
from .workloads import Shape, make_batch, make_brainpy_model


def resident_bytes() -> int:
  """Current resident set size of this process (Linux ``/proc``; peak RSS elsewhere)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * resource.getpagesize()
  except OSError:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: Optional[Sequence[str]] = None) -> float:
  """Run the soak; return the relative growth of resident memory after warm-up."""
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.soak', description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=2000)
  parser.add_argument('--warmup', type=int, default=200)
  parser.add_argument('--every', type=int, default=100)
  args = parser.parse_args(argv)
  shape = Shape(batch=64, time=20, hidden=64, inputs=16)
  batches = [make_batch(shape, seed=i) for i in range(args.every)]
  batches[-1] = tuple(a[:-7] for a in batches[-1])  # a short last batch, as real epochs have
  trainer = AccumBPTT(make_brainpy_model('rnn', shape), bp.losses.mean_squared_error, num_micro_batch=4,
                      progress_bar=False)
  samples = {}
  record = lambda idx, metrics, phase: samples.setdefault(idx, resident_bytes())
  trainer.fit(batches, num_epoch=args.steps // args.every, num_report=args.every, fun_after_report=record)
  print('step   resident MiB')
  for step, size in samples.items():
    print(f'{step:5d}  {size / 2 ** 20:10.1f}')
  growth = samples[args.steps] / samples[args.warmup] - 1.
  verdict = 'met' if growth < 0.05 else 'MISSED'
  print(f'growth from step {args.warmup} to {args.steps}: {100 * growth:+.2f}% (target < 5%: {verdict}); '
        f'XLA compilations of the train step: {trainer.compilations["fit"]} (2 batch shapes)')
  return growth


if __name__ == '__main__':
  main()
