"""Measuring one configuration: compiled memory, step time, compilations, peak resident memory."""

import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

from .._planner import compiled_step_bytes
from .methods import build_step
from .workloads import Shape

__all__ = ['measure', 'measure_in_subprocess', 'largest_batch_within']


def _memory(compiled) -> Dict[str, int]:
  stats = compiled.memory_analysis()
  return {'temp': stats.temp_size_in_bytes, 'argument': stats.argument_size_in_bytes,
          'output': stats.output_size_in_bytes, 'total': compiled_step_bytes(compiled)}


def measure(config: dict, steps: int = 5) -> dict:
  """Compile and time one configuration in this process.

  ``config`` holds ``method``, ``workload``, ``shape`` (a :class:`Shape` as a
  list), ``num_micro_batch`` and ``remat``. Step time is the median of
  ``steps`` steps after one warm-up step.
  """
  shape = Shape(*config['shape'])
  step = build_step(config['method'], config['workload'], shape, config.get('num_micro_batch', 1),
                    config.get('remat', False))
  start = time.perf_counter()
  memory = _memory(step.compile())
  compile_time = time.perf_counter() - start
  step.run()  # warm-up: the real call compiles (or reuses) the step
  times: List[float] = []
  for _ in range(steps):
    start = time.perf_counter()
    step.run()
    times.append(time.perf_counter() - start)
  return {**config, 'memory': memory, 'compile_s': compile_time, 'step_s': statistics.median(times),
          'step_times': times, 'compilations': step.compilations(),
          'peak_rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure_in_subprocess(config: dict, steps: int = 5, timeout: Optional[float] = None) -> dict:
  """:func:`measure` in a fresh Python process, so that its peak resident memory is its own."""
  code = ('import json, sys; from brainpy_accum.bench.measure import measure; '
          f'print("RESULT" + json.dumps(measure(json.loads(sys.argv[1]), {steps})))')
  done = subprocess.run([sys.executable, '-c', code, json.dumps(config)], capture_output=True, text=True,
                        timeout=timeout)
  for line in done.stdout.splitlines():
    if line.startswith('RESULT'):
      return json.loads(line[len('RESULT'):])
  raise RuntimeError(f'benchmark worker failed for {config}:\n{done.stderr[-3000:]}')


def largest_batch_within(budget: int, method: str, workload: str, shape: Shape, num_micro_batch: int = 1,
                         precision: float = 0.01) -> int:
  """Largest effective batch (a multiple of ``num_micro_batch``) whose compiled step fits ``budget`` bytes.

  Doubling from the benchmark's batch, then bisection down to ``precision``
  (relative); every probe is an ahead-of-time compilation on abstract inputs,
  so nothing is allocated or run. Returns the largest batch verified to fit.
  """
  def fits(multiple: int) -> bool:
    probe = shape._replace(batch=multiple * num_micro_batch)
    step = build_step(method, workload, probe, num_micro_batch, abstract_data=True)
    return compiled_step_bytes(step.compile()) <= budget

  low, high = 0, max(1, shape.batch // num_micro_batch)  # in multiples of num_micro_batch
  while fits(high):
    low, high = high, 2 * high
  while high - low > max(1, precision * low):
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low * num_micro_batch
