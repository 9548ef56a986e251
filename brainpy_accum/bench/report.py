"""Turning benchmark results into the markdown tables, the target checks and the figure.

Every speed ratio is the median over rounds of the per-round ratio of step times (see :mod:`.measure`);
medians of separately measured times would carry the machine's drift into the ratio.
"""

import statistics
from typing import Dict, List, Optional, Sequence

from .measure import per_round_ratio

__all__ = ['markdown_report', 'plot']

MiB = 2 ** 20
RATIO_NS = (2, 4, 8)
JAX_LIMIT, RECIPE_LIMIT = 1.05, 1.00


def _label(r: dict) -> str:
  names = {'bptt': 'bp.BPTT', 'accum': 'AccumBPTT', 'recipe': 'hand-written bm.scan recipe', 'jax': 'plain JAX + optax'}
  return names[r['method']] + (' + remat' if r.get('remat') else '')


def _find(results, workload, method, n=1, remat=False):
  for r in results:
    if (r['workload'], r['method'], r.get('num_micro_batch', 1), bool(r.get('remat'))) == (workload, method, n, remat):
      return r
  return None


def _ratio(r: dict, base: dict) -> float:
  return per_round_ratio(r['step_times'], base['step_times'])


def _spread(r: dict, base: dict) -> str:
  """The median per-round ratio with its quartiles: how far the machine's noise reaches in that ratio."""
  ratios = sorted(t / b for t, b in zip(r['step_times'], base['step_times']))
  if len(ratios) < 4:
    return f'{_ratio(r, base):.3f}'
  low, _, high = statistics.quantiles(ratios, n=4)
  return f'{_ratio(r, base):.3f} ({low:.2f}-{high:.2f})'


def _plan_bytes(r: dict) -> int:
  """What the figure puts on the memory axis: compile-time temporaries plus arguments."""
  return r['memory']['temp'] + r['memory']['argument']


def table(results: List[dict], workload: str) -> List[str]:
  base = _find(results, workload, 'bptt')
  lines = ['| method | N | micro-batch | temp MiB | temp / BPTT | args + outputs MiB | step s | step / BPTT | '
           'compilations |', '|---|---|---|---|---|---|---|---|---|']
  for r in (r for r in results if r['workload'] == workload):
    n = r.get('num_micro_batch', 1)
    mem = r['memory']
    lines.append(f"| {_label(r)} | {n} | {r['shape'][0] // n} | {mem['temp'] / MiB:.1f} | "
                 f"{mem['temp'] / base['memory']['temp']:.3f} | {(mem['argument'] + mem['output']) / MiB:.1f} | "
                 f"{r['step_s']:.3f} | {_ratio(r, base):.2f} | {r['compilations']} |")
  return lines


COLUMN_LIMIT = 1.03  # [AccumBPTT(N) / bp.BPTT] / [plain JAX(N) / plain JAX(1)]


def _column_ratios(mine: dict, bptt: dict, jax_n: dict, jax_1: dict) -> List[float]:
  return sorted((a / b) / (j / j1) for a, b, j, j1 in zip(mine['step_times'], bptt['step_times'],
                                                         jax_n['step_times'], jax_1['step_times']))


def _cost_of_micro_batching_divided_out(mine: dict, bptt: dict, jax_n: dict, jax_1: dict) -> str:
  """[AccumBPTT(N) / bp.BPTT] / [plain JAX(N) / plain JAX(1)] per round: median (quartiles)."""
  ratios = _column_ratios(mine, bptt, jax_n, jax_1)
  middle = statistics.median(ratios)
  if len(ratios) < 4:
    return f'{middle:.3f}'
  low, _, high = statistics.quantiles(ratios, n=4)
  return f'{middle:.3f} ({low:.2f}-{high:.2f})'


def ratios(results: List[dict], workload: str) -> List[str]:
  """AccumBPTT against plain JAX + optax and against the hand-written recipe, N by N, and AccumBPTT's own
  cost over bp.BPTT with what micro-batching itself costs (plain JAX's N against its 1) divided out."""
  lines = ['| N | AccumBPTT / plain JAX + optax | AccumBPTT / recipe | recipe / plain JAX | '
           '[AccumBPTT(N) / bp.BPTT] / [plain JAX(N) / plain JAX(1)] |', '|---|---|---|---|---|']
  bptt, jax_1 = _find(results, workload, 'bptt'), _find(results, workload, 'jax', 1)
  for n in sorted({r['num_micro_batch'] for r in results if r['workload'] == workload and r['method'] == 'jax'}):
    mine, jax_, recipe = (_find(results, workload, m, n) for m in ('accum', 'jax', 'recipe'))
    if mine and jax_:
      cells = [_spread(mine, jax_), _spread(mine, recipe) if recipe else '-', _spread(recipe, jax_) if recipe else '-',
               _cost_of_micro_batching_divided_out(mine, bptt, jax_, jax_1) if bptt and jax_1 and n > 1 else '-']
      lines.append(f'| {n} | ' + ' | '.join(cells) + ' |')
  return lines


def _check(ok: bool) -> str:
  return 'met' if ok else '**missed**'


def targets(results: List[dict], largest: Dict[str, Dict[str, int]], workload: str) -> List[str]:
  base = _find(results, workload, 'bptt')
  lines = []
  for n in RATIO_NS:
    r = _find(results, workload, 'accum', n)
    if r:
      ratio = r['memory']['temp'] / base['memory']['temp']
      lines.append(f'- temp memory N={n}: {ratio:.3f} x BPTT (target <= {1.25 / n:.3f}): {_check(ratio <= 1.25 / n)}')
  jax_1 = _find(results, workload, 'jax', 1)
  for n in RATIO_NS:
    mine, jax_n = _find(results, workload, 'accum', n), _find(results, workload, 'jax', n)
    if mine and jax_n and jax_1 and n > 1:
      ratio = statistics.median(_column_ratios(mine, base, jax_n, jax_1))
      lines.append(f'- [AccumBPTT(N) / bp.BPTT] / [plain JAX(N) / plain JAX(1)] at N={n}: '
                   f'{_cost_of_micro_batching_divided_out(mine, base, jax_n, jax_1)} (target <= {COLUMN_LIMIT}): '
                   f'{_check(ratio <= COLUMN_LIMIT)}')
  for other, limit in (('jax', JAX_LIMIT), ('recipe', RECIPE_LIMIT)):
    for n in RATIO_NS:
      mine, theirs = _find(results, workload, 'accum', n), _find(results, workload, other, n)
      if mine and theirs:
        ratio = _ratio(mine, theirs)
        lines.append(f'- AccumBPTT / {_label(theirs)} at N={n}: {ratio:.3f} (target <= {limit:.2f}): '
                     f'{_check(ratio <= limit)}')
  plain, remat = _find(results, workload, 'accum', 4), _find(results, workload, 'accum', 4, True)
  if plain and remat:
    mem, step = remat['memory']['temp'] / plain['memory']['temp'], _ratio(remat, plain)
    lines.append(f'- remat at N=4: temp {mem:.3f} x (target <= 0.5): {_check(mem <= 0.5)}; '
                 f'step {step:.2f} x (target <= 1.5): {_check(step <= 1.5)}')
  sizes = largest.get(workload, {})
  if 'bptt' in sizes:
    for key, value in sizes.items():
      if key.startswith('accum'):
        n = int(key.split('=')[1])
        ratio = value / max(sizes['bptt'], 1)
        reason = ('' if ratio >= 0.9 * n else ': the whole batch\'s inputs and targets are arguments of the step and '
                  'grow with it; streaming them from the host removes that bound (see "Streaming" below)')
        lines.append(f'- largest effective batch within the budget with the data on the device, N={n}: {value} vs '
                     f'BPTT {sizes["bptt"]} = {ratio:.2f} x (target >= {0.9 * n:.1f}): {_check(ratio >= 0.9 * n)}'
                     f'{reason}')
  return lines


def markdown_report(results: List[dict], largest: Dict[str, Dict[str, int]], header: str) -> str:
  out = [header, '']
  for workload in dict.fromkeys(r['workload'] for r in results):
    shape = _find(results, workload, 'bptt')['shape']
    out += [f'## {workload}: batch {shape[0]}, T={shape[1]}, hidden {shape[2]}, {shape[3]} inputs', '']
    out += table(results, workload) + ['']
    out += ['Step-time ratios: medians of per-round ratios, their quartiles in brackets (the noise of this '
            'machine in that ratio):', ''] + ratios(results, workload) + ['']
    if largest.get(workload):
      out += ['Largest effective batch whose compiled step fits the budget: ' +
              ', '.join(f'{k} {v}' for k, v in largest[workload].items()), '']
    out += ['Targets:', ''] + targets(results, largest, workload) + ['']
  return '\n'.join(out)


def plot(results: List[dict], path: str, picks: Optional[Sequence[dict]] = None, title: str = '') -> None:
  """Step time against memory (compile-time temporaries + arguments), one point per plan, one panel per workload.

  ``picks``: configurations to mark with a ring, e.g. a planner's choices, each a dict with ``workload``,
  ``num_micro_batch``, ``remat`` and optionally ``label`` (e.g. ``'planner, 256 MiB'``); a pick that matches
  no measured result is left out.
  """
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  workloads = list(dict.fromkeys(r['workload'] for r in results))
  fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 5), squeeze=False)
  for ax, workload in zip(axes[0], workloads):
    mine = [r for r in results if r['workload'] == workload]
    for method, remat, style in (('accum', False, 'o-'), ('accum', True, 'P-'), ('recipe', False, 's:'),
                                 ('jax', False, '^:'), ('bptt', False, 'D')):
      rs = sorted((r for r in mine if r['method'] == method and bool(r.get('remat')) == remat),
                  key=lambda r: r['num_micro_batch'])
      if not rs:
        continue
      xs, ys = [_plan_bytes(r) / MiB for r in rs], [r['step_s'] for r in rs]
      ax.plot(xs, ys, style, label=_label(rs[0]), ms=7)
      if method == 'accum':
        for r, x, y in zip(rs, xs, ys):
          ax.annotate(f"N={r['num_micro_batch']}", (x, y), textcoords='offset points', xytext=(4, 4), fontsize=7)
    for pick in picks or ():
      r = _find(results, pick['workload'], 'accum', pick['num_micro_batch'], bool(pick.get('remat')))
      if r and pick['workload'] == workload:
        ax.plot([_plan_bytes(r) / MiB], [r['step_s']], 'o', ms=16, mfc='none', mec='red', mew=2,
                label=pick.get('label', 'picked'))
    shape = mine[0]['shape']
    ax.set(xscale='log', xlabel='compile-time temp + arguments, MiB', ylabel='step seconds (median of rounds)',
           title=f'{workload}: B={shape[0]}, T={shape[1]}, hidden {shape[2]}')
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=8)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
