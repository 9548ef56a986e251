"""Measuring configurations in one process: compiled memory, and step times in interleaved rounds.

A shared machine's speed drifts by tens of percent within minutes, so timing each method in a block of
its own compares the load of one minute with the load of the next. Instead every configuration runs one
step per round, in alternating order (forwards, then backwards), and methods are compared by the median of
their per-round ratios: what the load does to a round, it does to both sides of the ratio.
"""

import statistics
import time
from typing import Dict, List, NamedTuple, Sequence

from ..memory import compiled_step_bytes
from .methods import Step, build_step
from .workloads import Shape

__all__ = ['Prepared', 'prepare', 'time_in_rounds', 'measure_all', 'per_round_ratio', 'largest_batch_within']


class Prepared(NamedTuple):
  config: dict
  step: Step
  memory: Dict[str, int]
  compile_s: float


def _memory(compiled) -> Dict[str, int]:
  stats = compiled.memory_analysis()
  return {'temp': stats.temp_size_in_bytes, 'argument': stats.argument_size_in_bytes,
          'output': stats.output_size_in_bytes, 'total': compiled_step_bytes(compiled)}


def prepare(config: dict) -> Prepared:
  """Build ``config``'s step and read its memory from XLA's compile-time analysis (deterministic).

  ``config`` holds ``method``, ``workload``, ``shape`` (a :class:`Shape` as a list), ``num_micro_batch``
  and ``remat``.
  """
  step = build_step(config['method'], config['workload'], Shape(*config['shape']), config.get('num_micro_batch', 1),
                    config.get('remat', False))
  start = time.perf_counter()
  memory = _memory(step.compile())
  return Prepared(config, step, memory, time.perf_counter() - start)


def time_in_rounds(steps: Sequence[Step], rounds: int, warm_up: bool = True) -> List[List[float]]:
  """Seconds of one step of each of ``steps`` in each of ``rounds`` rounds, after one warm-up step each
  (``warm_up=False``: none, the steps have run already).

  Round ``r`` runs the steps forwards when ``r`` is even and backwards when it is odd, so that no step
  always follows the same neighbour.
  """
  for step in steps if warm_up else ():
    step.run()  # the real call compiles (or reuses) the step
  times: List[List[float]] = [[] for _ in steps]
  order = list(range(len(steps)))
  for r in range(rounds):
    for i in (order if r % 2 == 0 else order[::-1]):
      start = time.perf_counter()
      steps[i].run()
      times[i].append(time.perf_counter() - start)
  return times


def per_round_ratio(times: Sequence[float], base: Sequence[float]) -> float:
  """The median over rounds of ``times[r] / base[r]``: the drift of the machine's speed cancels."""
  return statistics.median(t / b for t, b in zip(times, base))


def measure_all(configs: Sequence[dict], rounds: int = 5) -> List[dict]:
  """Compile every configuration, then time them all in ``rounds`` interleaved rounds in this process.

  Each result is its config with ``memory`` (bytes: ``temp``, ``argument``, ``output``, ``total``),
  ``compile_s``, ``step_times`` (one per round, aligned across results), ``step_s`` (their median) and
  ``compilations`` (XLA executables behind the step, 1 when nothing recompiled).
  """
  prepared = [prepare(config) for config in configs]
  times = time_in_rounds([p.step for p in prepared], rounds)
  return [{**p.config, 'memory': p.memory, 'compile_s': p.compile_s, 'step_s': statistics.median(t),
           'step_times': t, 'compilations': p.step.compilations()} for p, t in zip(prepared, times)]


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
