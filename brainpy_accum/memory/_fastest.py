"""Choosing the fastest (micro-batch size, remat) plan that fits a memory budget (``remat='auto'``).

A budget can be met by two levers: more micro-batches (smaller activations, but more, smaller sequential
steps) or remat (activations of ``sqrt(T)`` steps, for about one extra forward pass). Which is faster depends
on the model and the device, so the planner measures rather than guesses. For each remat option a
bisection (:func:`~brainpy_accum.memory._budget.largest_fitting`) finds the largest micro-batch that fits
(memory by ahead-of-time compilation), searching remat plans only above the largest micro-batch that fits
without remat (at or below it the same cut without remat is faster); a couple of finer cuts may be added (small
micro-batches can be faster on caches), and the fitting candidates are timed with a few trial steps,
interleaved round by round; the fastest wins. :func:`fastest_fitting` runs that choice for the planner: the
candidates compiled as training runs them, timed, and the winner's step kept for fit.

XLA's ``cost_analysis()`` is not used to estimate time: it counts the body of a loop once, not once per
iteration, so its flops fall with the micro-batch size although the step's work does not.
"""

import functools
import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from tqdm import tqdm

from ..core._cut import describe_remat, plan_micro_batches
from ..diagnostics._phases import phase
from ._budget import (PlannedStep, StepMemory, TooSmall, memory_parts, candidate_micro_batch_sizes, format_memory,
                      first_probe_trains, largest_fitting)

__all__ = ['Candidate', 'REMAT_OPTIONS', 'choose_fastest_plan', 'fastest_fitting', 'time_steps', 'describe_choice']

Remat = Union[bool, int]
REMAT_OPTIONS: Tuple[Remat, ...] = (False, True)  # other segment lengths keep more than sqrt(T) for the same compute


class Candidate(NamedTuple):
  """One (micro-batch size, remat) plan the planner weighed: its memory and, if it fits, its trial step time."""
  micro_batch_size: int
  remat: Remat
  bytes: int
  fits: bool
  seconds: Optional[float] = None


def finer_sizes(batch_size: int, size: int, finer: int) -> List[int]:
  """``size`` and the micro-batch sizes of ``2, 4, ... 2**finer`` times as many micro-batches, largest first."""
  count = -(-batch_size // size)
  sizes = [size] + [-(-batch_size // (count * 2 ** k)) for k in range(1, finer + 1)]
  return sorted({s for s in sizes if s <= size}, reverse=True)


def choose_fastest_plan(batch_size: int, budget: int, measure: Callable[[int, Remat], Union[int, StepMemory]],
                        step_time: Callable[[Sequence[Tuple[int, Remat]]], Sequence[float]], *,
                        remat_options: Sequence[Remat] = REMAT_OPTIONS, finer: int = 2,
                        measure_pick: Optional[Callable[[int, Remat], Union[int, StepMemory]]] = None,
                        guess: Optional[Callable[[int, Remat], float]] = None
                        ) -> Tuple[Candidate, List[Candidate]]:
  """Return ``(chosen, weighed)``: the fastest fitting candidate and every candidate weighed.

  ``measure(size, remat)`` gives the bytes of the step compiled for micro-batches of ``size`` with that
  remat (``measure_pick`` those of the sizes the search predicts to be the answer, see
  :func:`~brainpy_accum.memory._budget.largest_fitting`); each size is measured once. ``step_time(pairs)``
  gives the step time of each ``(size, remat)`` pair (called once, with all the fitting ones, so that they
  can be timed in interleaved rounds). ``finer``: also weigh 2, 4, ... ``2**finer`` times the micro-batches.
  ``guess(size, remat)``, given, predicts the bytes from other measurements: each search starts where it
  predicts the answer (see :func:`~brainpy_accum.memory._budget.largest_fitting`).

  Raises
  ------
  ValueError
    If no remat option fits even at one sample per micro-batch, naming the smallest budget that would.

  Examples
  --------
  >>> need = lambda size, remat: size * (1 if remat else 4)  # remat keeps a quarter of the bytes
  >>> cost = lambda pairs: [(64 // size) * (1.3 if remat else 1.) for size, remat in pairs]
  >>> chosen, weighed = choose_fastest_plan(64, 100, need, cost)
  >>> chosen.micro_batch_size, chosen.remat, chosen.seconds
  (64, True, 1.3)
  """
  weighed, largest, one_sample, measured, kept = [], {}, [], {}, {}  # measured: totals; kept: as measure gave them

  def recorded(measure_):
    def measure_one(size, remat):
      if (size, remat) not in kept:
        kept[size, remat] = measure_(size, remat)
        measured[size, remat] = memory_parts(kept[size, remat])[0]
      return kept[size, remat]
    return measure_one

  for remat in remat_options:
    # remat plans only matter above the largest micro-batch that fits without remat: at or below it, that is faster
    sizes = [size for size in candidate_micro_batch_sizes(batch_size) if not remat or size > largest.get(False, 0)]
    of_remat = lambda measure_, remat=remat: (lambda size: recorded(measure_)(size, remat))
    found = largest_fitting(sizes, budget, of_remat(measure),
                            measure_pick=None if measure_pick is None else of_remat(measure_pick),
                            guess=None if guess is None else (lambda size, remat=remat: guess(size, remat))
                            ) if sizes else None
    if found is not None:
      largest[remat] = found[0]
    elif (1, remat) in measured:
      one_sample.append(measured[1, remat])
    too_big = [size for (size, r), used in measured.items() if r == remat and used > budget]
    if too_big:  # the boundary: the smallest micro-batch that did not fit
      weighed.append(Candidate(min(too_big), remat, measured[min(too_big), remat], False))
  if not largest:
    raise _too_small(budget, batch_size, min(one_sample))
  without_remat = largest.get(False, 0)
  pairs = [(size, remat) for remat, top in largest.items() for size in finer_sizes(batch_size, top, finer)
           if not remat or size > without_remat]  # a cut that fits without remat is faster without it
  used = [memory_parts(recorded(measure)(size, remat))[0] for size, remat in pairs]
  fitting = [pair for pair, bytes_ in zip(pairs, used) if bytes_ <= budget]
  # one fitting candidate wins untimed: trial steps would only cost time
  seconds = dict(zip(fitting, step_time(fitting))) if len(fitting) > 1 else {fitting[0]: None}
  weighed += [Candidate(size, remat, bytes_, (size, remat) in seconds, seconds.get((size, remat)))
              for (size, remat), bytes_ in zip(pairs, used)]
  weighed.sort(key=lambda c: (bool(c.remat), -c.micro_batch_size))
  return min((c for c in weighed if c.fits), key=lambda c: c.seconds or 0.), weighed


def _too_small(budget: int, batch_size: int, need: int) -> TooSmall:
  """The error of a budget that no plan fits, naming what one sample per micro-batch needs."""
  return TooSmall(f'memory_budget={format_memory(budget)} ({budget} bytes) is too small: even micro-batches of '
                  f'one sample with remat need {format_memory(need)} ({need} bytes) for a batch of '
                  f'{batch_size}. Raise memory_budget to at least {need}.', need)


def fastest_fitting(share: int, budget: int, compilers, batch: tuple, via_window: bool, *, named: str,
                    weighed_plans: Dict[int, List[Candidate]], step_time: Optional[Callable] = None,
                    whole: Optional[PlannedStep] = None) -> Tuple[int, int, Remat, Optional[PlannedStep]]:
  """``remat='auto'``: ``(micro_batch_size, bytes, remat, compiled step)`` of the fastest plan of a share of
  ``share`` samples that fits ``budget`` (``named`` so in errors), measured and timed by the planner's
  ``compilers`` (:class:`~brainpy_accum.memory._planner.Compilers`) on ``batch`` (``shared_args, inputs,
  targets``); its table printed, the candidates weighed recorded in ``weighed_plans[share]``.

  Only the largest fitting micro-batch of each remat option is weighed: those are the candidates that can
  win, since a finer cut of the same remat does the same work in more, smaller sequential steps. The
  search compiles the sizes it predicts to be the answer as training runs them, so the candidates timed are
  already compiled, their compilation's memory is the figure that must fit, and training runs the winner's
  executable (where :func:`~brainpy_accum.memory._budget.compiles_whole_first`, the first probe, the share in one
  micro-batch without remat, too; ``whole``: that step, compiled for training already). ``step_time(plans) ->
  seconds`` replaces the trial steps (timing by a model).
  """
  compiled = {} if whole is None else {(share, False): whole}
  plan_of = lambda size, remat: plan_micro_batches(share, micro_batch_size=size)._replace(remat=remat)

  def compile_(size, remat):
    if (size, remat) not in compiled:
      compiled[size, remat] = compilers.trial(plan_of(size, remat), *batch, via_window)
    return compiled[size, remat]

  if first_probe_trains(compilers, via_window) and whole is None:  # the first probe, for training
    compile_(share, False)

  def probe(size, remat):
    if (size, remat) in compiled:
      return compiled[size, remat].memory
    return compilers.step_bytes(plan_of(size, remat), *batch, via_window)
  timed = functools.partial(_timed, budget, compilers, step_time, plan_of, compile_)
  guess = None if compilers.guess(plan_of(share, False)) is None else (
    lambda size, remat: compilers.guess(plan_of(size, remat)))
  chosen, weighed = choose_fastest_plan(share, budget, probe, timed, finer=0, guess=guess,
                                        measure_pick=lambda size, remat: compile_(size, remat).memory)
  if chosen.seconds == float('inf'):
    raise ValueError(f'{named}: no plan fits when compiled for training, although quick compilations said so. '
                     f'Raise memory_budget.')
  weighed_plans[share] = weighed
  tqdm.write(describe_choice(share, budget, chosen, weighed))
  planned = compiled.get((chosen.micro_batch_size, chosen.remat))
  if planned is None and compilers.keepable(via_window):  # measured by a quick probe: compile it for training
    planned = compile_(chosen.micro_batch_size, chosen.remat)
    if planned.memory.total > budget:
      raise ValueError(f'{named}: the chosen plan needs {format_memory(planned.memory.total)} compiled for '
                       f'training, although a quick compilation measured {format_memory(chosen.bytes)}. Raise '
                       f'memory_budget.')
  used = chosen.bytes if planned is None else planned.memory.total
  return chosen.micro_batch_size, used, chosen.remat, planned


def _timed(budget: int, compilers, step_time: Optional[Callable], plan_of: Callable, compile_: Callable,
           pairs) -> List[float]:
  """Seconds of a trial step of each ``(size, remat)`` of ``pairs`` (``step_time``'s, if given); a candidate
  that does not fit once compiled for training (the quick probe measured otherwise) is never chosen."""
  if step_time is not None:
    return step_time([plan_of(s, r) for s, r in pairs])
  steps = [compile_(*pair) for pair in pairs]
  fitting = [step for step in steps if step.memory.total <= budget]  # (a refused one is never run)
  compilers.before_timing()
  # two interleaved runs each, the faster kept: the first run of a new executable is the slow one (about
  # 20% on CPU), so this is the second's time, for one run less per candidate than a warm-up and two rounds
  with phase('trial runs'):
    seconds = iter(time_steps([step.run for step in fitting], rounds=2, warm_up=False, estimate=min))
  return [next(seconds) if step.memory.total <= budget else float('inf') for step in steps]


def time_steps(runs: Sequence[Callable[[], object]], rounds: int = 3, warm_up: bool = True,
               estimate: Callable[[Sequence[float]], float] = statistics.median) -> List[float]:
  """Seconds of each ``run()`` (which must block until done): one warm-up each (unless not ``warm_up``), then
  ``rounds`` interleaved rounds, so that a slow moment of the machine slows every candidate alike; ``estimate``
  of each one's rounds (the median; ``min`` for two rounds without warm-up, where the first run of a new
  executable is the slow one).

  Examples
  --------
  >>> from brainpy_accum.memory import time_steps
  >>> order = []
  >>> seconds = time_steps([lambda: order.append('a'), lambda: order.append('b')], rounds=2, warm_up=False,
  ...                      estimate=min)
  >>> order, len(seconds)
  (['a', 'b', 'a', 'b'], 2)
  """
  for run in runs if warm_up else ():
    run()
  times = [[] for _ in runs]
  for _ in range(rounds):
    for run, spent in zip(runs, times):
      start = time.perf_counter()
      run()
      spent.append(time.perf_counter() - start)
  return [estimate(spent) for spent in times]


def describe_choice(batch_size: int, budget: int, chosen: Candidate, weighed: Sequence[Candidate]) -> str:
  """The table of the candidates weighed and a line saying why ``chosen`` won."""
  lines = [f'memory plan for batch {batch_size}, memory_budget {format_memory(budget)}, remat=\'auto\' '
           f'(step times: timed trial steps):',
           f'  {"micro-batch":>11}  {"remat":<20} {"memory":>10}  {"step time":>9}  fits']
  for c in weighed:
    shown = '-' if c.seconds is None else f'{c.seconds * 1e3:.1f} ms'
    mark = '  <- chosen' if c == chosen else ''
    lines.append(f'  {c.micro_batch_size:>11}  {describe_remat(c.remat):<20} {format_memory(c.bytes):>10}  '
                 f'{shown:>9}  {"yes" if c.fits else "no"}{mark}')
  memory_only = max((c for c in weighed if c.fits and not c.remat), key=lambda c: c.micro_batch_size, default=None)
  why = f'chose micro-batches of {chosen.micro_batch_size}, remat {describe_remat(chosen.remat)}: ' + (
    'the only candidate that fits' if chosen.seconds is None else 'the fastest that fits')
  if memory_only is not None and memory_only != chosen and chosen.seconds:
    why += (f'; the fewest micro-batches without remat ({memory_only.micro_batch_size} each) take '
            f'{memory_only.seconds / chosen.seconds:.2f}x as long')
  return '\n'.join(lines + [why])
