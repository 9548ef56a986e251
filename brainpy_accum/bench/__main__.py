"""``python -m brainpy_accum.bench``: every plan and method in one process, timed in interleaved rounds; to docs/.

Four parts, each rerunnable alone with ``--parts`` (the others are then kept from ``benchmark.json``):
``startup`` (time to the first epoch of bp.BPTT and AccumBPTT's plans in fresh processes, first run and
rerun, :mod:`.startup`), ``steps`` (step time and memory of every method and plan, the largest batch within
a budget; ``--column``: only what the column [AccumBPTT(N) / bp.BPTT] / [plain JAX(N) / plain JAX(1)]
needs, and bp.BPTT and plain JAX at each N's micro-batch, which tell its factors apart), ``planner``
(``remat='auto'`` against every plan timed, :mod:`.planner`) and ``streaming`` (a batch several times the
budget streamed from the host, :mod:`.streaming`). A fifth, ``device``, runs only when named
(``--parts device``): training on a GPU or TPU, batch size by batch size, into ``accelerator.md``, ``.png`` and
``.json`` (:mod:`.accelerator`; on a CPU small and labelled as such).
"""

import argparse
import json
import os
import platform
import time
from typing import List, Optional, Sequence

import brainpy
import brainstate
import jax

from ..memory import parse_memory
from .accelerator import main as device_main
from .measure import largest_batch_within, measure_all
from .planner import measure_planner, planner_section, plot_planner
from .report import markdown_report, plot
from .startup import STARTUP_HEADER, measure_startup, startup_section
from .streaming import streaming_section
from .workloads import WORKLOADS, Shape

DEFAULT = Shape(batch=256, time=100, hidden=512, inputs=64)
DEFAULT_NOTE = (' (half the batch and time steps of the earlier B=512, T=200: with 18 plans and methods per '
                'workload, compiled and timed in rounds, that shape took well over 15 minutes on this shared '
                '2-core CPU)')
QUICK = Shape(batch=64, time=20, hidden=32, inputs=8)
PARTS = ('startup', 'steps', 'planner', 'streaming')  # the default: benchmark.md
OTHER_PARTS = ('device',)  # run when named: accelerator.md


def configs(workload: str, shape: Shape, quick: bool, column: bool = False) -> List[dict]:
  """Every plan of AccumBPTT (N micro-batches, with and without remat) and the methods it is compared with;
  ``column``: only bp.BPTT, AccumBPTT and plain JAX at N = 2, 4, 8 and plain JAX at 1, and bp.BPTT and plain
  JAX at each N's micro-batch (one step of the batch divided by N: the model's own cost at that size)."""
  base = {'workload': workload, 'shape': list(shape)}
  if column:
    out = [dict(base, method='bptt', num_micro_batch=1), dict(base, method='jax', num_micro_batch=1)]
    for n in ((2,) if quick else (2, 4, 8)):
      out += [dict(base, method='accum', num_micro_batch=n, remat=False), dict(base, method='jax', num_micro_batch=n)]
      out += [dict(base, shape=list(shape._replace(batch=shape.batch // n)), method=method, num_micro_batch=1,
                   at_micro_batch=n) for method in ('bptt', 'jax')]
    return out
  ns = (1, 2) if quick else (1, 2, 4, 8, 16)
  compared = (2,) if quick else (2, 4, 8)
  out = [dict(base, method='bptt', num_micro_batch=1)]
  for n in ns:  # the methods compared at one N side by side, so that a round's drift hits them alike
    out += [dict(base, method='accum', num_micro_batch=n, remat=False)]
    out += [dict(base, method=method, num_micro_batch=n) for method in ('recipe', 'jax')
            if n in compared or (method, n) == ('jax', 1)]
  out += [dict(base, method='accum', num_micro_batch=n, remat=True) for n in ns]
  return out


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      return next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def _load() -> str:
  return ', '.join(f'{v:.2f}' for v in os.getloadavg()) if hasattr(os, 'getloadavg') else 'unknown'


def header(args, shape: Shape, seconds: float, load_before: str) -> str:
  quick = ' --quick' if args.quick else ''
  return (f'# Benchmark\n\nMade by `python -m brainpy_accum.bench{quick}` (the step part in {seconds:.0f} s).\n\n'
          f'- Machine: {_cpu_model()} ({platform.machine()}), {os.cpu_count()} cores, jax backend '
          f'{jax.default_backend()}; load average (1, 5, 15 min) {load_before} before, {_load()} after.\n'
          f'- Versions: Python {platform.python_version()}, brainpy {brainpy.__version__}, brainstate '
          f'{brainstate.__version__}, jax {jax.__version__}.\n'
          f'- Shape: batch {shape.batch}, T={shape.time}, hidden {shape.hidden}, {shape.inputs} inputs'
          f'{"" if args.quick else DEFAULT_NOTE}. '
          f'Adam; random inputs: this measures steps, not learning.\n'
          f'- Speed: all configurations of a workload live in one process and run one step each per round, '
          f'{args.rounds} rounds in alternating order after a warm-up step; "step s" is the median of the '
          f'rounds, and every ratio is the median of per-round ratios, so the machine\'s drift cancels.\n'
          f'- Memory: XLA\'s compile-time analysis of the train step (deterministic): temporaries, arguments, '
          f'outputs. Largest batch' + (' (not searched with --quick)' if args.quick else '') +
          f': bisection with ahead-of-time compilations under a {args.budget} budget (arguments + outputs + '
          f'temporaries).')


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench', description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true', help=f'small workload {tuple(QUICK)} instead of {tuple(DEFAULT)}')
  parser.add_argument('--workloads', nargs='+', default=list(WORKLOADS), choices=list(WORKLOADS))
  parser.add_argument('--column', action='store_true',
                      help='steps part: only the configurations of the column [AccumBPTT(N) / bp.BPTT] / '
                           '[plain JAX(N) / plain JAX(1)] and its factors (bp.BPTT and plain JAX at each N\'s '
                           'micro-batch), no largest-batch search')
  parser.add_argument('--startup-rounds', type=int, default=3, help='rounds of the startup part')
  parser.add_argument('--rounds', type=int, default=None, help='interleaved timing rounds (default 11, --quick 3)')
  parser.add_argument('--budget', default='512MiB', help='memory budget for the largest-batch search (not with --quick)')
  parser.add_argument('--parts', nargs='+', default=list(PARTS), choices=list(PARTS + OTHER_PARTS),
                      help='parts to run; the others are kept from OUT/benchmark.json (device: on its own, into '
                           'OUT/accelerator.*)')
  parser.add_argument('--out', default='docs', help='folder for benchmark.md, benchmark.png, benchmark.json')
  return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
  args = _parser().parse_args(argv)
  args.rounds = args.rounds or (3 if args.quick else 11)
  shape = QUICK if args.quick else DEFAULT
  os.makedirs(args.out, exist_ok=True)
  if 'device' in args.parts:
    device_main((['--quick'] if args.quick else []) + ['--out', args.out])
    args.parts = [part for part in args.parts if part != 'device']
    if not args.parts:  # benchmark.* stay as they are
      return
  stored = os.path.join(args.out, 'benchmark.json')
  data = {}
  if set(args.parts) != set(PARTS) and os.path.exists(stored):
    with open(stored) as f:
      data = json.load(f)
  started, load_before = time.time(), _load()
  if 'startup' in args.parts:
    startup_load = _load()
    data['startup'] = {'results': measure_startup(rounds=args.startup_rounds), 'load': f'{startup_load} before, '
                       f'{_load()} after'}
  if 'steps' in args.parts:
    kept = [r for r in data.get('results', []) if r['workload'] not in args.workloads]  # workloads not rerun
    results, largest = _steps(args, shape, stored, data)
    data['results'], data['largest'] = kept + results, dict(data.get('largest', {}), **largest)
    if not kept:
      data['header'] = header(args, shape, time.time() - started, load_before)
    else:
      data['header'] = data.get('header', '# Benchmark') + (
        f'\n- Workloads {", ".join(args.workloads)}: measured in a later run (`--parts steps --workloads '
        f'{" ".join(args.workloads)}{" --column" if args.column else ""}`, {args.rounds} rounds, '
        f'{time.time() - started:.0f} s), load average {load_before} before, {_load()} after.')
  if 'planner' in args.parts:
    data['planner'] = measure_planner('rnn', rounds=3 if args.quick else 7,
                                      **({'shape': QUICK._replace(time=40), 'counts': (1, 2, 4)} if args.quick else {}))
  if 'streaming' in args.parts:
    data['streaming'] = streaming_section('rnn', **({'shape': QUICK, 'budget': parse_memory('256KiB'),
                                                     'stream_factor': 4} if args.quick else {}))
  with open(stored, 'w') as f:
    json.dump(data, f, indent=1)
  print(write_report(data, args.out))


def write_report(data: dict, out: str) -> str:
  """benchmark.md (and its figures) in ``out`` from the measurements ``data`` (benchmark.json's content)."""
  report = markdown_report(data.get('results', []), data.get('largest', {}), data.get('header', '# Benchmark'))
  if data.get('startup'):
    report += '\n' + STARTUP_HEADER + '\n\n' + startup_section(data['startup']['results'], data['startup']['load']) + '\n'
    report += ''.join(f'\n{note}\n' for note in data['startup'].get('notes', []))  # measured separately, as stated
  if data.get('planner'):
    report += '\n' + planner_section(data['planner']) + '\n\n![plans and picks](benchmark_planner.png)\n'
    plot_planner(data['planner'], os.path.join(out, 'benchmark_planner.png'))
  if data.get('streaming'):
    report += '\n' + data['streaming'] + '\n'
  with open(os.path.join(out, 'benchmark.md'), 'w') as f:
    f.write(report + '\n')
  if data.get('results'):
    plot(data['results'], os.path.join(out, 'benchmark.png'),
         title=f'{_cpu_model()}, {os.cpu_count()} cores; jax {jax.__version__}, brainpy {brainpy.__version__}')
  return report


def _steps(args, shape: Shape, stored: str, data: dict):
  """The ``steps`` part: every method and plan per workload; the JSON is written after each workload."""
  budget = parse_memory(args.budget)
  results, largest = [], {}
  for workload in args.workloads:
    done = measure_all(configs(workload, shape, args.quick, args.column), rounds=args.rounds)
    for r in done:
      print(f"{workload:4} {r['method']:7} N={r['num_micro_batch']:<3} batch {r['shape'][0]:<5} "
            f"remat={bool(r.get('remat'))!s:5} "
            f"temp {r['memory']['temp'] / 2 ** 20:9.1f} MiB  step {r['step_s']:.3f} s  "
            f"compilations {r['compilations']}", flush=True)
    results += done
    if not args.quick and not args.column:  # a dozen compilations per method: minutes, even at the quick shape
      sizes = {'bptt': largest_batch_within(budget, 'bptt', workload, shape, precision=0.02)}
      for n in (4, 8):
        sizes[f'accum N={n}'] = largest_batch_within(budget, 'accum', workload, shape, n, precision=0.02)
      print(f'{workload}: largest effective batch within {args.budget}: {sizes}', flush=True)
      largest[workload] = sizes
    with open(stored, 'w') as f:  # after each workload: a long run keeps its part (and the workloads not rerun)
      kept = [r for r in data.get('results', []) if r['workload'] not in args.workloads]
      json.dump(dict(data, results=kept + results, largest=dict(data.get('largest', {}), **largest)), f, indent=1)
  return results, largest


if __name__ == '__main__':
  main()
