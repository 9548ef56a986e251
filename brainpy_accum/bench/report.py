"""Turning benchmark results into the markdown table, the target checks and the plot."""

from typing import Dict, List

__all__ = ['markdown_report', 'plot']

MiB = 2 ** 20


def _label(r: dict) -> str:
  names = {'bptt': 'bp.BPTT', 'accum': 'AccumBPTT', 'recipe': 'hand-written bm.scan recipe', 'jax': 'plain JAX + optax'}
  return names[r['method']] + (' + remat' if r.get('remat') else '')


def _find(results, workload, method, n=1, remat=False):
  for r in results:
    if (r['workload'], r['method'], r.get('num_micro_batch', 1), bool(r.get('remat'))) == (workload, method, n, remat):
      return r
  return None


def table(results: List[dict], workload: str) -> List[str]:
  base = _find(results, workload, 'bptt')
  lines = ['| method | N | micro-batch | temp MiB | temp / BPTT | args + outputs MiB | peak RSS MiB | '
           'step s | step / BPTT | compilations |', '|---|---|---|---|---|---|---|---|---|---|']
  for r in (r for r in results if r['workload'] == workload):
    n = r.get('num_micro_batch', 1)
    mem = r['memory']
    lines.append(f"| {_label(r)} | {n} | {r['shape'][0] // n} | {mem['temp'] / MiB:.1f} | "
                 f"{mem['temp'] / base['memory']['temp']:.3f} | {(mem['argument'] + mem['output']) / MiB:.1f} | "
                 f"{r['peak_rss'] / MiB:.0f} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
                 f"{r['compilations']} |")
  return lines


def _check(ok: bool) -> str:
  return 'met' if ok else '**missed**'


def targets(results: List[dict], largest: Dict[str, Dict[str, int]], workload: str) -> List[str]:
  base = _find(results, workload, 'bptt')
  lines = []
  for n in (2, 4, 8):
    r = _find(results, workload, 'accum', n)
    if r:
      ratio = r['memory']['temp'] / base['memory']['temp']
      lines.append(f'- temp memory N={n}: {ratio:.3f} x BPTT (target <= {1.25 / n:.3f}): {_check(ratio <= 1.25 / n)}')
  for r in (r for r in results if r['workload'] == workload and r['method'] == 'accum' and not r.get('remat')):
    n = r['num_micro_batch']
    if r['shape'][0] // n >= 64:
      ratio = r['step_s'] / base['step_s']
      lines.append(f'- step time N={n} (micro-batch {r["shape"][0] // n}): {ratio:.2f} x BPTT (target <= 1.10): '
                   f'{_check(ratio <= 1.10)}')
  for other in ('recipe', 'jax'):
    for r in (r for r in results if r['workload'] == workload and r['method'] == other):
      mine = _find(results, workload, 'accum', r['num_micro_batch'])
      if mine:
        ratio = mine['step_s'] / r['step_s']
        limit = 1.0 if other == 'recipe' else 1.10
        lines.append(f"- AccumBPTT / {_label(r)} at N={r['num_micro_batch']}: {ratio:.2f} (target <= {limit:.2f}): "
                     f'{_check(ratio <= limit)}')
  plain, remat = _find(results, workload, 'accum', 4), _find(results, workload, 'accum', 4, True)
  if plain and remat:
    mem, step = remat['memory']['temp'] / plain['memory']['temp'], remat['step_s'] / plain['step_s']
    lines.append(f'- remat at N=4: temp {mem:.3f} x (target <= 0.5): {_check(mem <= 0.5)}; '
                 f'step {step:.2f} x (target <= 1.5): {_check(step <= 1.5)}')
  sizes = largest.get(workload, {})
  if 'bptt' in sizes:
    for key, value in sizes.items():
      if key.startswith('accum'):
        n = int(key.split('=')[1])
        ratio = value / max(sizes['bptt'], 1)
        lines.append(f'- largest effective batch within the budget, N={n}: {value} vs BPTT {sizes["bptt"]} = '
                     f'{ratio:.2f} x (target >= {0.8 * n:.1f}): {_check(ratio >= 0.8 * n)}')
  return lines


def markdown_report(results: List[dict], largest: Dict[str, Dict[str, int]], header: str) -> str:
  out = [header, '']
  for workload in dict.fromkeys(r['workload'] for r in results):
    shape = _find(results, workload, 'bptt')['shape']
    out += [f'## {workload}: batch {shape[0]}, T={shape[1]}, hidden {shape[2]}, {shape[3]} inputs', '']
    out += table(results, workload) + ['']
    if largest.get(workload):
      out += ['Largest effective batch whose compiled step fits the budget: ' +
              ', '.join(f'{k} {v}' for k, v in largest[workload].items()), '']
    out += ['Targets:', ''] + targets(results, largest, workload) + ['']
  return '\n'.join(out)


def plot(results: List[dict], path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  workloads = list(dict.fromkeys(r['workload'] for r in results))
  fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.8 * len(workloads)), squeeze=False)
  for row, workload in zip(axes, workloads):
    base = _find(results, workload, 'bptt')
    for method, style in (('accum', 'o-'), ('recipe', 's'), ('jax', '^')):
      rs = sorted((r for r in results if r['workload'] == workload and r['method'] == method and not r.get('remat')),
                  key=lambda r: r['num_micro_batch'])
      if not rs:
        continue
      ns = [r['num_micro_batch'] for r in rs]
      label = _label(rs[0])
      row[0].plot(ns, [r['memory']['temp'] / MiB for r in rs], style, label=label)
      row[1].plot(ns, [r['step_s'] for r in rs], style, label=label)
    remat = [r for r in results if r['workload'] == workload and r.get('remat')]
    for r in remat:
      row[0].plot([r['num_micro_batch']], [r['memory']['temp'] / MiB], 'P', ms=10, label='AccumBPTT + remat')
      row[1].plot([r['num_micro_batch']], [r['step_s']], 'P', ms=10, label='AccumBPTT + remat')
    row[0].axhline(base['memory']['temp'] / MiB, color='grey', ls='--', label='bp.BPTT')
    row[1].axhline(base['step_s'], color='grey', ls='--', label='bp.BPTT')
    row[0].set(xscale='log', yscale='log', xlabel='micro-batches N', ylabel='XLA temp MiB',
               title=f'{workload}: train-step working memory')
    row[1].set(xscale='log', xlabel='micro-batches N', ylabel='seconds (median)', title=f'{workload}: step time')
    row[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
