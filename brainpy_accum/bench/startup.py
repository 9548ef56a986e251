"""How long until the first epoch is done: bp.BPTT and AccumBPTT's plans, each in a fresh process.

``python -m brainpy_accum.bench.startup`` runs every trainer of :data:`TRAINERS` in its own Python process
(imports excluded), timed from building the trainer to the end of its first epoch, on the issue's workload: a
rate RNN (``bp.dyn.RNNCell`` + ``bp.dnn.Dense`` read-out), batch 256, T=100, 64 inputs, 256 hidden, 10 classes,
cross-entropy of the last step, Adam, 2 batches. Each trainer runs twice on its own cache folder: the first run
starts with an empty one, the rerun finds what the first run left (JAX's persistent compilation cache, for
bp.BPTT too, and AccumBPTT's plan cache). Runs alternate between trainers and repeat, so that the machine's
drift falls on all alike; the ratios are medians of per-round ratios to bp.BPTT, quartiles beside them.

``--client`` times a client-sized whole run instead: the same network, 3 batches, 2 epochs, from building the
trainer to the end of ``fit`` (the third-party clients' runs are of that size: a notebook's short training), with
issue 55's target for it (every AccumBPTT trainer's first run at most 1.5 times bp.BPTT's). Each table names
the device it ran on.

``--against TREE`` compares two versions instead: each trainer's first run with this checkout's package and with
the one at ``TREE`` (``git worktree add TREE COMMIT``), back to back in every round, and the median of the paired
differences: whether a change made the first fit slower, where separate runs of the table move by more than that.
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ['TRAINERS', 'TARGETS', 'CLIENT_SHAPE', 'CLIENT_TARGETS', 'STARTUP_HEADER', 'run_one', 'measure_startup',
           'startup_section', 'measure_against', 'against_section']

TRAINERS: Dict[str, dict] = {
  'bp.BPTT': {},
  'AccumBPTT(num_micro_batch=4)': {'num_micro_batch': 4},
  "'auto', memory_budget='24MiB'": {'num_micro_batch': 'auto', 'memory_budget': '24MiB'},
  "'auto', remat='auto', 24MiB": {'num_micro_batch': 'auto', 'memory_budget': '24MiB', 'remat': 'auto'},
  "'auto', remat='auto', 8MiB (streamed)": {'num_micro_batch': 'auto', 'memory_budget': '8MiB', 'remat': 'auto'},
}
# first run, rerun; the first run's are issue 55's ("no worse than" the ratios measured before it on this CPU)
TARGETS = {'AccumBPTT(num_micro_batch=4)': (1.4, None), "'auto', memory_budget='24MiB'": (1.6, 1.5),
           "'auto', remat='auto', 24MiB": (2.4, 1.5), "'auto', remat='auto', 8MiB (streamed)": (2.6, None)}
SHAPE = dict(batch=256, time=100, inputs=64, hidden=256, classes=10, batches=2, epochs=1)
CLIENT_SHAPE = dict(SHAPE, batches=3, epochs=2)  # a client-sized whole run
CHILD_PLATFORMS = 'BRAINPY_ACCUM_CHILD_PLATFORMS'  # the timed processes' JAX_PLATFORMS, where set
CLIENT_TARGETS = {name: (1.5, None) for name in TRAINERS if name != 'bp.BPTT'}
STARTUP_HEADER = (
  '## Start-up: time to the first epoch\n\n'
  'Made by `python -m brainpy_accum.bench.startup` (also the `startup` part of `python -m brainpy_accum.bench`). '
  'Rate RNN (`bp.dyn.RNNCell` + `bp.dnn.Dense` read-out), batch 256, T=100, 64 inputs, 256 hidden, 10 classes, '
  'cross-entropy of the last step, Adam, 2 batches; each run a fresh process, timed from building the trainer '
  'to the end of the first epoch (imports and data excluded). Each trainer has its own cache folder: its first '
  'run starts with the folder empty, its rerun finds what the first left. Both runs have JAX\'s persistent '
  'compilation cache on, bp.BPTT\'s too (`JAX_COMPILATION_CACHE_DIR`, every compilation kept: '
  '`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`), and AccumBPTT its plan cache (`BRAINPY_ACCUM_CACHE_DIR`). '
  'Trainers alternate within a round (order reversed every other round); ratios are medians of per-round '
  'ratios to bp.BPTT, quartiles in brackets; "CPU seconds" is the process\'s CPU time over the same span '
  '(all its threads), steadier than wall time on a shared machine; "compilations" counts every XLA '
  'compilation in the timed span (cache hits included), bp.BPTT\'s included. The first runs are also given by '
  'phase (`brainpy_accum.diagnostics._phases`): the planner\'s quick probes, its compilations for training (the '
  'kept one is the step\'s own), trial steps, other planning, the wait for the first-batch check, the steps\' '
  'compilations outside planning, and the runs with the rest.')


def _child(options: dict, shape: dict) -> dict:
  """In the fresh process: build the trainer, fit ``shape['epochs']`` epochs; seconds and XLA compilations since
  the build, by phase, the plans and the device."""
  import brainpy as bp
  import brainpy.math as bm
  import jax
  import numpy as np

  from ..diagnostics._compiles import count_compilations
  from ..diagnostics._phases import record_phases
  from ..trainer import AccumBPTT

  bm.random.seed(0)
  with bm.training_environment():
    model = bp.Sequential(bp.dyn.RNNCell(shape['inputs'], shape['hidden']),
                          bp.dnn.Dense(shape['hidden'], shape['classes']))
  rng = np.random.RandomState(0)
  data = [(rng.rand(shape['batch'], shape['time'], shape['inputs']).astype('float32'),
           rng.randint(0, shape['classes'], shape['batch'])) for _ in range(shape['batches'])]

  def last_step_cross_entropy(predicts, targets):
    return bp.losses.cross_entropy_loss(predicts[:, -1], targets)

  with count_compilations() as compiled, record_phases() as phases:
    start, cpu_start = time.perf_counter(), time.process_time()
    if options:
      trainer = AccumBPTT(model, last_step_cross_entropy, bp.optim.Adam(lr=1e-3), progress_bar=False, **options)
    else:
      trainer = bp.BPTT(model, last_step_cross_entropy, bp.optim.Adam(lr=1e-3), progress_bar=False)
    trainer.fit(data, num_epoch=shape.get('epochs', 1))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
  return {'seconds': seconds, 'cpu_seconds': cpu_seconds, 'compilations': compiled(), 'phases': phases.table(),
          'events': [list(event) for event in phases.events],
          'device': f'{jax.devices()[0].device_kind} ({jax.default_backend()})',
          'plan': {str(k): v[0].describe() for k, v in getattr(trainer, 'memory_plans', {}).items()}}


def run_one(name: str, cache: str, shape: dict = SHAPE, tree: Optional[str] = None) -> dict:
  """One fresh process for trainer ``name`` with its caches in the folder ``cache``; ``tree``: the package
  imported from that checkout (another commit's, for :func:`measure_against`) instead of this one. The process
  gets ``JAX_PLATFORMS`` from ``BRAINPY_ACCUM_CHILD_PLATFORMS`` where that is set (see ``--child-platforms``)."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(cache, 'jax'), BRAINPY_ACCUM_CACHE_DIR=cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  if CHILD_PLATFORMS in env:
    env['JAX_PLATFORMS'] = env.pop(CHILD_PLATFORMS)
  if tree is not None:
    env['PYTHONPATH'] = os.pathsep.join([tree] + [p for p in [env.get('PYTHONPATH')] if p])
  request = json.dumps({'options': TRAINERS[name], 'shape': shape})
  done = subprocess.run([sys.executable, '-m', 'brainpy_accum.bench.startup', '--child', request], env=env,
                        capture_output=True, text=True, check=False, cwd=tree)
  if done.returncode != 0:
    held = ('\nThe device is held by this process: run it with JAX_PLATFORMS=cpu and --child-platforms set to the '
            "device's platform (only one process can open a TPU)." if 'already in use' in done.stderr else '')
    raise RuntimeError(f'{name}: the child process failed:\n{done.stderr[-3000:]}{held}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def measure_startup(names: Sequence[str] = tuple(TRAINERS), rounds: int = 3, shape: dict = SHAPE,
                    reruns: bool = True, save: Optional[Callable[[dict], None]] = None) -> dict:
  """``{name: {'first': [runs], 'rerun': [runs]}}``: per round, each trainer's first run on an empty cache
  folder, then its rerun on that folder (``reruns=False``: no reruns, their lists empty); trainers alternate within
  a round, in reversed order every other round. ``save(results)`` is called after every run, with what is measured
  so far (a run cut short keeps it)."""
  results = {name: {'first': [], 'rerun': []} for name in names}
  for round_ in range(rounds):
    order = list(names) if round_ % 2 == 0 else list(reversed(names))
    folders = {name: tempfile.mkdtemp(prefix='brainpy_accum_startup_') for name in order}
    try:
      for kind in ('first', 'rerun') if reruns else ('first',):
        for name in order:
          results[name][kind].append(run_one(name, folders[name], shape))
          done = results[name][kind][-1]
          print(f'round {round_} {kind:5} {name:40} {done["seconds"]:6.2f} s  {done["cpu_seconds"]:6.2f} CPU s  '
                f'{done["compilations"]} compilations', flush=True)
          if save is not None:
            save(results)
    finally:
      for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)
  return results


def measure_against(tree: str, names: Sequence[str] = tuple(TRAINERS), rounds: int = 3,
                    shape: dict = SHAPE) -> Dict[str, Dict[str, List[float]]]:
  """``{name: {'here': [seconds], 'there': [seconds]}}``: each trainer's first run (an empty cache folder of its
  own) with this checkout's package and with the one at ``tree`` (another commit's worktree), one right after
  the other, the pairs in reversed order every other round: two versions compared where the machine's drift
  falls on both alike (the start-up figures of separate runs move by more than a change's effect)."""
  results = {name: {'here': [], 'there': []} for name in names}
  for round_ in range(rounds):
    pairs = [(name, where) for name in names for where in ('here', 'there')]
    for name, where in pairs if round_ % 2 == 0 else reversed(pairs):
      folder = tempfile.mkdtemp(prefix='brainpy_accum_startup_')
      try:
        seconds = run_one(name, folder, shape, tree=tree if where == 'there' else None)['seconds']
      finally:
        shutil.rmtree(folder, ignore_errors=True)
      results[name][where].append(seconds)
      print(f'round {round_} {where:5} {name:40} {seconds:6.2f} s', flush=True)
  return results


def against_section(results: Dict[str, Dict[str, List[float]]], tree: str) -> str:
  """The markdown table of :func:`measure_against`: medians of each version's first runs, and the median of
  the paired differences (this checkout minus ``tree``'s) with how many pairs were slower here."""
  lines = [f'First runs, this checkout against `{tree}` (seconds, medians; pairs run back to back):', '',
           '| trainer | here | there | here - there (median of pairs) | pairs slower here |', '|---|---|---|---|---|']
  for name, runs in results.items():
    differences = [a - b for a, b in zip(runs['here'], runs['there'])]
    lines.append(f'| {name} | {statistics.median(runs["here"]):.2f} | {statistics.median(runs["there"]):.2f} | '
                 f'{statistics.median(differences):+.2f} | {sum(d > 0 for d in differences)} of {len(differences)} |')
  return '\n'.join(lines)


def _quartiles(values: List[float]) -> str:
  if len(values) < 3:
    return ' - '.join(f'{v:.2f}' for v in sorted(values))
  q = statistics.quantiles(values, n=4)
  return f'{q[0]:.2f}-{q[2]:.2f}'


def _phase_lines(results: dict) -> List[str]:
  """The first runs by phase (:mod:`~brainpy_accum.diagnostics._phases`): medians of seconds on the fitting thread,
  XLA compilations in brackets; "beside": the first-batch check's thread (not waited for)."""
  from ..diagnostics._phases import PHASES
  if not all(r.get('phases') for runs in results.values() for r in runs['first']):
    return []
  columns = PHASES + ('beside',)
  lines = ['', 'First runs by phase (medians, seconds on the thread that calls `fit`; XLA compilations in brackets; '
           '"beside": the first-batch check compiling on its own thread, not waited for):', '',
           '| trainer | total | ' + ' | '.join(columns) + ' |', '|---|---|' + '---|' * len(columns)]
  for name, runs in results.items():
    first = runs['first']
    lines.append(f'| {name} | {_median(first, "total", "seconds"):.2f} | ' + ' | '.join(
      f'{_median(first, c, "seconds"):.2f} ({_median(first, c, "compilations"):g})' for c in columns) + ' |')
  return lines


def _median(runs: List[dict], phase: str, field: str) -> float:
  return statistics.median(r['phases'][phase][field] for r in runs)


def startup_section(results: dict, load: str = '', targets: Dict[str, tuple] = TARGETS) -> str:
  """The markdown table: wall and CPU seconds, their ratios to bp.BPTT (medians of per-round ratios, quartiles),
  compilations; the ``targets`` (first run, rerun; :data:`TARGETS` or :data:`CLIENT_TARGETS`) judged on the
  wall-clock ratio; the device the runs reported."""
  base = results['bp.BPTT']
  devices = sorted({r['device'] for runs in results.values() for r in runs['first'] if r.get('device')})
  lines = [f'Device: {", ".join(devices)}.', ''] if devices else []
  lines += ['| trainer | run | seconds | / bp.BPTT | CPU seconds | CPU / bp.BPTT | compilations | target |',
            '|---|---|---|---|---|---|---|---|']
  verdicts = []
  for name, runs in results.items():
    for kind in (kind for kind in ('first', 'rerun') if runs[kind]):  # (no reruns: --no-rerun)
      cells = [name if kind == 'first' else '', kind]
      for field in ('seconds', 'cpu_seconds'):
        values = [r.get(field, float('nan')) for r in runs[kind]]
        ratios = [r.get(field, float('nan')) / b.get(field, float('nan')) for r, b in zip(runs[kind], base[kind])]
        cells += [f'{statistics.median(values):.2f}', f'{statistics.median(ratios):.2f} ({_quartiles(ratios)})']
      cells.append('/'.join(sorted({str(r['compilations']) for r in runs[kind]})))
      target = targets.get(name, (None, None))[kind == 'rerun']
      cells.append('-' if target is None else f'<= {target}')
      lines.append('| ' + ' | '.join(cells) + ' |')
      if target is not None:
        wall = statistics.median([r['seconds'] / b['seconds'] for r, b in zip(runs[kind], base[kind])])
        verdicts.append(f'- {name}, {kind}: {wall:.2f} x bp.BPTT (target <= {target}): '
                        f'{"met" if wall <= target else "**missed**"}')
  lines += _phase_lines(results)
  plans = {name: runs['first'][0]['plan'] for name, runs in results.items()
           if runs['first'] and runs['first'][0].get('plan')}
  if plans:
    lines += ['', 'Plans chosen: ' + '; '.join(f'{name}: {plan}' for name, plan in plans.items())]
  lines += [''] + verdicts
  if load:
    lines += ['', f'Load average (1, 5, 15 min): {load}.']
  return '\n'.join(lines)


def _write_json(path: str, results: dict) -> None:
  """``results`` to ``path`` whole or not at all (a process killed while writing leaves the file before)."""
  with open(path + '.part', 'w') as f:
    json.dump(results, f, indent=1)
  os.replace(path + '.part', path)


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.startup', description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--trainers', nargs='+', default=list(TRAINERS), choices=list(TRAINERS))
  parser.add_argument('--client', action='store_true',
                      help='a client-sized whole run (3 batches, 2 epochs) instead of the first epoch of 2 batches')
  parser.add_argument('--against', default=None, metavar='TREE',
                      help='compare first runs with the package of another checkout (a worktree of another commit)')
  parser.add_argument('--json', default=None, help='also write the measurements to this file (after every run: a '
                                                    'run cut short keeps what it measured)')
  parser.add_argument('--no-rerun', action='store_true', help='first runs only (half the time; no rerun column)')
  parser.add_argument('--child-platforms', default=None, metavar='PLATFORMS',
                      help="the timed processes' JAX_PLATFORMS. On a TPU, which one process at a time can open, run "
                           'this one with JAX_PLATFORMS=cpu (importing brainpy opens the default device) and pass '
                           '--child-platforms tpu')
  parser.add_argument('--child', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child_platforms is not None:
    os.environ[CHILD_PLATFORMS] = args.child_platforms
  if args.child is not None:
    request = json.loads(args.child)
    print(json.dumps(_child(request['options'], request['shape'])))
    return
  before = ', '.join(f'{v:.2f}' for v in os.getloadavg())
  if args.against is not None:
    results = measure_against(args.against, args.trainers, args.rounds, CLIENT_SHAPE if args.client else SHAPE)
    if args.json:
      _write_json(args.json, results)
    print(against_section(results, args.against))
    return
  shape, targets = (CLIENT_SHAPE, CLIENT_TARGETS) if args.client else (SHAPE, TARGETS)
  results = measure_startup(args.trainers, args.rounds, shape, reruns=not args.no_rerun,
                            save=None if args.json is None else functools.partial(_write_json, args.json))
  after = ', '.join(f'{v:.2f}' for v in os.getloadavg())
  print(f'Timed: from building the trainer to the end of fit, {shape["batches"]} batches of {shape["batch"]}, '
        f'{shape["epochs"]} epoch(s).\n')
  print(startup_section(results, f'{before} before, {after} after', targets))


if __name__ == '__main__':
  main()
