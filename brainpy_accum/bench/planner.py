"""Does ``remat='auto'`` pick the fastest plan that fits? Every (micro-batches, remat) plan, timed.

``python -m brainpy_accum.bench.planner`` compiles the rate RNN's train step for every plan of a grid
(1, 2, 4, ... micro-batches, remat off and every ``sqrt(T)`` steps) plus the plans the planners pick, times
them all in interleaved rounds in one process (medians), and for each budget compares the time-aware
planner's pick with the fastest fitting plan and with the memory-only planner's pick (``remat=False``).
:func:`measure_planner` returns the measurements as data (for a plot), :func:`planner_section` the markdown.
"""

import argparse
import contextlib
import io
from typing import Dict, Optional, Sequence

import brainpy as bp

from ..core import describe_remat, plan_micro_batches
from ..memory import format_memory, time_steps
from ..trainer import AccumBPTT
from .measure import FIT, LEARNING_RATE
from .workloads import Shape, make_batch, make_brainpy_model

__all__ = ['measure_planner', 'planner_section', 'plot_planner']

SHAPE = Shape(batch=128, time=200, hidden=64, inputs=16)
FRACTIONS = (0.8, 0.4, 0.2)  # budgets as fractions of the whole batch's step without remat


def _trainer(workload: str, shape: Shape, **options) -> AccumBPTT:
  model = make_brainpy_model(workload, shape)
  model.reset(shape.batch)
  return AccumBPTT(model, bp.losses.mean_squared_error, bp.optim.Adam(lr=LEARNING_RATE), progress_bar=False,
                   **options)


def _pick(workload: str, shape: Shape, budget: int, remat) -> tuple:
  """The planner's ``(micro_batch_size, remat, trial seconds or None)`` for ``budget``; its printout kept quiet."""
  trainer = _trainer(workload, shape, num_micro_batch='auto', memory_budget=budget, remat=remat)
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    plan = trainer.plan_memory(*make_batch(shape))
  estimate = [c.seconds for c in trainer.planner.weighed_plans.get(shape.batch, ())
              if (c.micro_batch_size, c.remat) == (plan.micro_batch_size, plan.remat)]
  return plan.micro_batch_size, bool(plan.remat), (estimate or [None])[0]


def measure_planner(workload: str = 'rnn', shape: Shape = SHAPE, fractions: Sequence[float] = FRACTIONS,
                    counts: Sequence[int] = (1, 2, 4, 8, 16), rounds: int = 7) -> Dict[str, list]:
  """Time every plan of the grid and the planners' picks; return ``{'plans': [...], 'budgets': [...]}``.

  Each plan is a dict ``micro_batch_size, num_micro_batches, remat, bytes, step_s`` (median of ``rounds``
  interleaved rounds) and ``picked_at`` / ``memory_only_at`` (the budgets, in bytes, at which the
  time-aware / memory-only planner chose it). Each budget is a dict ``budget, pick, pick_estimate_s,
  memory_only, fastest`` (plans as ``(micro_batch_size, remat)``).
  """
  x, y = make_batch(shape)
  timer = _trainer(workload, shape, num_micro_batch='auto', memory_budget=2 ** 40, remat='auto')  # plans' own remat
  grid = {(plan_micro_batches(shape.batch, num_micro_batch=n).micro_batch_size, remat): None
          for n in counts for remat in (False, True)}
  whole = timer.compiled_step_bytes(plan_micro_batches(shape.batch, num_micro_batch=1), FIT, x, y)
  budgets = []
  for fraction in fractions:
    budget = int(fraction * whole)
    size, remat, estimate = _pick(workload, shape, budget, 'auto')
    memory_only = _pick(workload, shape, budget, False)[:2]
    budgets.append({'budget': budget, 'pick': (size, remat), 'pick_estimate_s': estimate,
                    'memory_only': memory_only})
    grid.update({(size, remat): None, memory_only: None})
  trials = {}
  for size, remat in grid:
    plan = plan_micro_batches(shape.batch, micro_batch_size=size)._replace(remat=remat)
    trials[size, remat] = timer.planner.compilers.trial(plan, FIT, x, y, False)  # a trial that changes nothing
  seconds = dict(zip(trials, time_steps([trial.run for trial in trials.values()], rounds)))
  plans = []
  for (size, remat), trial in sorted(trials.items(), key=lambda item: (item[0][1], -item[0][0])):
    plans.append({'workload': workload, 'micro_batch_size': size, 'num_micro_batches': -(-shape.batch // size),
                  'remat': remat, 'bytes': trial.memory.total,
                  'step_s': seconds[size, remat],
                  'picked_at': [b['budget'] for b in budgets if b['pick'] == (size, remat)],
                  'memory_only_at': [b['budget'] for b in budgets if b['memory_only'] == (size, remat)]})
  for entry in budgets:
    fitting = [p for p in plans if p['bytes'] <= entry['budget']]
    fastest = min(fitting, key=lambda p: p['step_s'])
    entry['fastest'] = (fastest['micro_batch_size'], fastest['remat'])
  return {'workload': workload, 'shape': list(shape), 'whole_bytes': whole, 'plans': plans, 'budgets': budgets}


def _time_of(measured: Dict[str, list], plan: tuple) -> float:
  return next(p['step_s'] for p in measured['plans'] if (p['micro_batch_size'], p['remat']) == tuple(plan))


def _name(measured: Dict[str, list], plan: tuple) -> str:
  size, remat = plan
  return f'{-(-measured["shape"][0] // size)} x {size}{", remat" if remat else ""}'


def planner_section(measured: Dict[str, list]) -> str:
  """A markdown section: per budget the pick, the fastest fitting plan, the memory-only pick; then every plan."""
  shape = Shape(*measured['shape'])
  lines = [f'## The planner: fastest plan that fits ({measured["workload"]}, batch {shape.batch}, T={shape.time}, '
           f'hidden {shape.hidden})', '',
           "`num_micro_batch='auto', remat='auto'` against every plan timed in interleaved rounds (medians). "
           "'memory-only' is `remat=False`: the fewest micro-batches that fit.", '',
           '| budget | pick | pick / fastest | fastest fitting | memory-only pick | memory-only / pick | '
           'pick: trial estimate / measured |', '|---|---|---|---|---|---|---|']
  for b in measured['budgets']:
    pick, fastest, memory_only = (_time_of(measured, b[k]) for k in ('pick', 'fastest', 'memory_only'))
    estimate = '-' if b['pick_estimate_s'] is None else f'{b["pick_estimate_s"] / pick:.2f}'
    lines.append(f'| {format_memory(b["budget"])} | {_name(measured, b["pick"])} | {pick / fastest:.3f}'
                 f'{" ok" if pick <= 1.05 * fastest else " MISSED"} | {_name(measured, b["fastest"])} | '
                 f'{_name(measured, b["memory_only"])} | {memory_only / pick:.2f} | {estimate} |')
  lines += ['', '| micro-batches | micro-batch | remat | memory | step | picked at |', '|---|---|---|---|---|---|']
  for p in measured['plans']:
    picked = ', '.join(format_memory(b) for b in p['picked_at']) or '-'
    lines.append(f'| {p["num_micro_batches"]} | {p["micro_batch_size"]} | {describe_remat(p["remat"])} | '
                 f'{format_memory(p["bytes"])} | {p["step_s"] * 1e3:.1f} ms | {picked} |')
  return '\n'.join(lines)


def plot_planner(measured: Dict[str, list], path: str) -> None:
  """Step time against memory of every plan timed, the budgets as vertical lines, the planner's picks ringed."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for remat, marker in ((False, 'o'), (True, 'P')):
    mine = [p for p in measured['plans'] if bool(p['remat']) == remat]
    ax.scatter([p['bytes'] / 2 ** 20 for p in mine], [p['step_s'] * 1e3 for p in mine], marker=marker,
               label='remat every sqrt(T) steps' if remat else 'no remat')
    for p in mine:
      ax.annotate(f'{p["num_micro_batches"]}', (p['bytes'] / 2 ** 20, p['step_s'] * 1e3), fontsize=7,
                  xytext=(3, 3), textcoords='offset points')
  picked = [p for p in measured['plans'] if p['picked_at']]
  ax.scatter([p['bytes'] / 2 ** 20 for p in picked], [p['step_s'] * 1e3 for p in picked], s=220,
             facecolors='none', edgecolors='red', label="remat='auto' pick")
  for b in measured['budgets']:
    ax.axvline(b['budget'] / 2 ** 20, color='grey', lw=0.8, ls='--')
  ax.set_xlabel('train step memory, MiB (XLA compile-time analysis)')
  ax.set_ylabel('step time, ms (median of interleaved rounds)')
  ax.set_title(f'{measured["workload"]}, batch {measured["shape"][0]}: plans (number = micro-batches), budgets dashed',
               fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.planner', description=__doc__)
  parser.add_argument('--workloads', nargs='+', default=['rnn'], choices=['rnn', 'snn'])
  parser.add_argument('--rounds', type=int, default=7, help='interleaved timing rounds (median reported)')
  args = parser.parse_args(argv)
  for workload in args.workloads:
    print(planner_section(measure_planner(workload, rounds=args.rounds)) + '\n', flush=True)


if __name__ == '__main__':
  main()
