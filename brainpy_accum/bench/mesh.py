"""``python -m brainpy_accum.bench.mesh``: AccumBPTT on 1, 2, 4 and 8 devices of one batch.

On a CPU-only machine the devices are simulated (``XLA_FLAGS=
--xla_force_host_platform_device_count=8``, set for a worker process that this
script starts): they share the same cores, so no speed-up is expected; what
the figures show is per-device memory (XLA's compile-time analysis) and the
cross-device communication in the compiled step (all-reduce instructions,
where they sit, and how many values they carry), for several devices and
micro-batch counts. Writes ``devices.md``, ``devices.png`` and ``devices.json``.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from .workloads import Shape

FULL = Shape(batch=256, time=100, hidden=256, inputs=64)
QUICK = Shape(batch=64, time=20, hidden=32, inputs=8)
DEVICES = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4, 8)


def measure_one(workload: str, shape: Shape, num_devices: Optional[int], num_micro_batch: int, steps: int) -> dict:
  """Compile and time one trainer; ``num_devices=None`` means no mesh at all."""
  import brainpy as bp
  import jax
  import numpy as np
  from jax.sharding import Mesh

  from brainpy_accum import AccumBPTT, count_all_reduces
  from .workloads import make_batch, make_brainpy_model

  model = make_brainpy_model(workload, shape)
  mesh = None if num_devices is None else Mesh(np.array(jax.devices()[:num_devices]), ('batch',))
  trainer = AccumBPTT(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=1e-3),
                      num_micro_batch=num_micro_batch, mesh=mesh, progress_bar=False)
  x, y = make_batch(shape)
  model.reset(shape.batch)
  trainer.place_on_mesh()
  compiled = trainer.compile_step(x, y)
  stats, reduces = compiled.memory_analysis(), count_all_reduces(compiled.as_text())
  shared = bp.tools.DotDict({'fit': True})
  times: List[float] = []
  for i in range(steps + 1):  # the first call compiles
    model.reset(shape.batch)
    trainer.place_on_mesh()
    start = time.perf_counter()
    jax.block_until_ready(trainer.f_train(shared, x, y))
    if i:
      times.append(time.perf_counter() - start)
  return {'workload': workload, 'devices': num_devices, 'num_micro_batch': num_micro_batch,
          'temp': stats.temp_size_in_bytes, 'argument': stats.argument_size_in_bytes,
          'all_reduce': reduces.total, 'all_reduce_in_loops': reduces.in_loops,
          'all_reduce_elements': reduces.elements, 'step_s': statistics.median(times)}


def measure_all(workloads: Sequence[str], shape: Shape, steps: int) -> List[dict]:
  """Every device count at N=4, and every N at 8 devices, plus the trainer without a mesh."""
  results = []
  for workload in workloads:
    configs = [(None, 4)] + [(d, 4) for d in DEVICES] + [(8, n) for n in MICRO_BATCHES if n != 4]
    for devices, n in configs:
      result = measure_one(workload, shape, devices, n, steps)
      print(f"{workload:4} devices={str(devices):4} N={n:<2} temp/device {result['temp'] / 2 ** 20:8.2f} MiB  "
            f"all-reduce {result['all_reduce']} ({result['all_reduce_in_loops']} in loops, "
            f"{result['all_reduce_elements']} values)  step {result['step_s']:.3f} s", flush=True)
      results.append(result)
  return results


def _row(r: dict, base: dict) -> str:
  devices = 'no mesh' if r['devices'] is None else r['devices']
  return (f"| {r['workload']} | {devices} | {r['num_micro_batch']} | {r['temp'] / 2 ** 20:.2f} | "
          f"{r['temp'] / base['temp']:.3f} | {r['all_reduce']} | {r['all_reduce_in_loops']} | "
          f"{r['all_reduce_elements']} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} |")


def markdown(results: List[dict], header: str) -> str:
  lines = [header, '', '![per-device memory, step time and all-reduce counts](devices.png)', '',
           '| model | devices (simulated) | N per device | temp MiB per device | temp / no mesh | '
           'all-reduce ops | in loops | values reduced | step s | step / no mesh |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for workload in dict.fromkeys(r['workload'] for r in results):
    rows = [r for r in results if r['workload'] == workload]
    base = next(r for r in rows if r['devices'] is None)
    lines += [_row(r, base) for r in rows]
  return '\n'.join(lines)


def plot(results: List[dict], path: str) -> None:
  import matplotlib
  import matplotlib.ticker
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  for workload in dict.fromkeys(r['workload'] for r in results):
    by_devices = [r for r in results if r['workload'] == workload and r['devices'] and r['num_micro_batch'] == 4]
    by_n = sorted([r for r in results if r['workload'] == workload and r['devices'] == 8],
                  key=lambda r: r['num_micro_batch'])
    counts = [r['devices'] for r in by_devices]
    axes[0].plot(counts, [r['temp'] / 2 ** 20 for r in by_devices], 'o-', label=workload)
    axes[1].plot(counts, [r['step_s'] for r in by_devices], 'o-', label=workload)
    axes[2].plot([r['num_micro_batch'] for r in by_n], [r['all_reduce'] for r in by_n], 'o-',
                 label=f'{workload}: all-reduce ops')
    axes[2].plot([r['num_micro_batch'] for r in by_n], [r['all_reduce_in_loops'] for r in by_n], 'x--',
                 label=f'{workload}: inside loops')
  axes[0].set(xlabel='simulated devices (N=4 each)', ylabel='temp memory per device (MiB)', xscale='log', yscale='log')
  axes[1].set(xlabel='simulated devices (N=4 each)', ylabel='step time (s), shared CPU cores', xscale='log')
  axes[2].set(xlabel='micro-batches per device (8 simulated devices)', ylabel='per compiled step', xscale='log')
  for ax in axes:
    ax.set_xticks(DEVICES)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
  axes[0].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  axes[2].set_ylim(-0.1, 2)
  fig.suptitle('AccumBPTT on SIMULATED CPU devices (one 2-core machine): memory and communication, not speed')
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.mesh', description=__doc__)
  parser.add_argument('--quick', action='store_true', help=f'{tuple(QUICK)} instead of {tuple(FULL)}')
  parser.add_argument('--workloads', nargs='+', default=['rnn', 'snn'], choices=['rnn', 'snn'])
  parser.add_argument('--steps', type=int, default=5, help='timed steps per configuration (median reported)')
  parser.add_argument('--out', default='docs', help='folder for devices.md, devices.png, devices.json')
  args = parser.parse_args(argv)
  if os.environ.get('BRAINPY_ACCUM_DEVICES_WORKER') != '1':
    # the devices are simulated on the host's CPU, whatever accelerator this machine has (JAX_PLATFORMS=tpu too)
    env = dict(os.environ, BRAINPY_ACCUM_DEVICES_WORKER='1', JAX_PLATFORMS='cpu',
               XLA_FLAGS=(os.environ.get('XLA_FLAGS', '') + f' --xla_force_host_platform_device_count={max(DEVICES)}'))
    sys.exit(subprocess.call([sys.executable, '-m', 'brainpy_accum.bench.mesh'] + list(argv or sys.argv[1:]),
                             env=env))
  import jax
  shape = QUICK if args.quick else FULL
  started = time.time()
  results = measure_all(args.workloads, shape, args.steps)
  header = (f'# Scaling over devices (simulated)\n\nMade by `python -m brainpy_accum.bench.mesh'
            f'{" --quick" if args.quick else ""}` on {platform.machine()} CPU ({os.cpu_count()} cores), '
            f'jax {jax.__version__}, in {time.time() - started:.0f} s, with {jax.device_count()} '
            f'{jax.devices()[0].platform.upper()} devices SIMULATED by XLA on the same cores: step times show the '
            f'cost of running D devices on shared cores, not a speed-up. Batch {shape.batch}, {shape.time} steps, '
            f'{shape.hidden} hidden units. Memory: XLA compile-time analysis per device (deterministic). '
            f'All-reduce: instructions in the optimised HLO of the train step, those inside a while loop (run once '
            f'per iteration), and the number of values they reduce.')
  os.makedirs(args.out, exist_ok=True)
  text = markdown(results, header)
  with open(os.path.join(args.out, 'devices.md'), 'w') as f:
    f.write(text + '\n')
  with open(os.path.join(args.out, 'devices.json'), 'w') as f:
    json.dump(results, f, indent=1)
  plot(results, os.path.join(args.out, 'devices.png'))
  print(text)


if __name__ == '__main__':
  main()
