"""``python -m brainpy_accum.bench``: every method and N in its own subprocess; table and plot to docs/."""

import argparse
import json
import os
import platform
import time
from typing import List, Optional, Sequence

import jax

from .._planner import parse_memory
from .measure import largest_batch_within, measure_in_subprocess
from .report import markdown_report, plot
from .workloads import Shape

FULL = Shape(batch=512, time=200, hidden=512, inputs=64)
QUICK = Shape(batch=128, time=50, hidden=64, inputs=16)


def configs(workload: str, shape: Shape, quick: bool) -> List[dict]:
  base = {'workload': workload, 'shape': list(shape)}
  ns = (1, 2, 4) if quick else (1, 2, 4, 8, 16)
  out = [dict(base, method='bptt', num_micro_batch=1)]
  out += [dict(base, method='accum', num_micro_batch=n) for n in ns]
  out += [dict(base, method='accum', num_micro_batch=4, remat=True)]
  out += [dict(base, method='recipe', num_micro_batch=n) for n in (4,) + (() if quick else (16,))]
  out += [dict(base, method='jax', num_micro_batch=n) for n in (1, 4) + (() if quick else (16,))]
  return out


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench', description=__doc__)
  parser.add_argument('--quick', action='store_true', help=f'small workload {tuple(QUICK)} instead of {tuple(FULL)}')
  parser.add_argument('--workloads', nargs='+', default=['rnn', 'snn'], choices=['rnn', 'snn'])
  parser.add_argument('--steps', type=int, default=7, help='timed steps per configuration (median reported)')
  parser.add_argument('--budget', default='512MiB', help='memory budget for the largest-batch search')
  parser.add_argument('--out', default='docs', help='folder for benchmark.md, benchmark.png, benchmark.json')
  args = parser.parse_args(argv)
  shape = QUICK if args.quick else FULL
  budget = parse_memory(args.budget)
  results, largest = [], {}
  started = time.time()
  for workload in args.workloads:
    for config in configs(workload, shape, args.quick):
      result = measure_in_subprocess(config, steps=args.steps)
      print(f"{workload:4} {config['method']:7} N={config['num_micro_batch']:<3} remat={bool(config.get('remat'))!s:5} "
            f"temp {result['memory']['temp'] / 2 ** 20:9.1f} MiB  step {result['step_s']:.3f} s  "
            f"rss {result['peak_rss'] / 2 ** 20:7.0f} MiB  compilations {result['compilations']}", flush=True)
      results.append(result)
    sizes = {'bptt': largest_batch_within(budget, 'bptt', workload, shape)}
    for n in (4, 8):
      sizes[f'accum N={n}'] = largest_batch_within(budget, 'accum', workload, shape, n)
    print(f'{workload}: largest effective batch within {args.budget}: {sizes}', flush=True)
    largest[workload] = sizes
  header = (f'# Benchmark\n\nMade by `python -m brainpy_accum.bench{" --quick" if args.quick else ""}` on '
            f'{platform.machine()} CPU ({os.cpu_count()} cores), jax {jax.__version__}, in '
            f'{time.time() - started:.0f} s. Each configuration ran in its own process: XLA compile-time '
            f'memory analysis of the train step (deterministic), peak resident memory of that process, median '
            f'of {args.steps} steps after one warm-up, XLA compilations of the step. Inputs are random: this '
            f'measures steps, not learning. Largest batch: bisection with ahead-of-time compilations under a '
            f'{args.budget} budget (arguments + outputs + temporaries).')
  os.makedirs(args.out, exist_ok=True)
  report = markdown_report(results, largest, header)
  with open(os.path.join(args.out, 'benchmark.md'), 'w') as f:
    f.write(report + '\n')
  with open(os.path.join(args.out, 'benchmark.json'), 'w') as f:
    json.dump({'results': results, 'largest': largest}, f, indent=1)
  plot(results, os.path.join(args.out, 'benchmark.png'))
  print(report)


if __name__ == '__main__':
  main()
