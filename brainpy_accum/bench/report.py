"""Turning benchmark results into the markdown tables, the target checks and the figures.

The ``steps`` part: :func:`markdown_report` and :func:`plot` (``benchmark.md``, ``benchmark.png``). The ``device``
part: :func:`device_report` and :func:`plot_device` (``accelerator.md``: every run measured, by device,
accelerators first, and what is still missing; ``accelerator.png``: samples/s and bytes against the batch size),
from the runs that :mod:`.device` measures and keeps in ``accelerator.json``.

Every speed ratio is the median over rounds of the per-round ratio of step times (see :mod:`.measure`);
medians of separately measured times would carry the machine's drift into the ratio.
"""

import functools
import statistics
from typing import Dict, List, Optional, Sequence

from ..memory import parse_memory
from .measure import per_round_ratio
from .workloads import Shape

__all__ = ['AHEAD', 'DEVICE', 'NAMES', 'NOMINAL_PEAK', 'WITH_STEP', 'device_report', 'markdown_report', 'plot',
           'plot_device']

MiB = 2 ** 20
RATIO_NS = (2, 4, 8)
JAX_LIMIT, RECIPE_LIMIT = 1.05, 1.00


def _label(r: dict) -> str:
  names = {'bptt': 'bp.BPTT', 'accum': 'AccumBPTT', 'recipe': 'hand-written bm.scan recipe', 'jax': 'plain JAX + optax'}
  at = f" at batch {r['shape'][0]} (N={r['at_micro_batch']}'s micro-batch)" if r.get('at_micro_batch') else ''
  return names[r['method']] + (' + remat' if r.get('remat') else '') + at


def _find(results, workload, method, n=1, remat=False, at=None):
  """The result of ``method`` at ``n`` micro-batches; ``at=N``: the reference of one step at N's micro-batch
  (the whole batch divided by N), without accumulation."""
  for r in results:
    if ((r['workload'], r['method'], r.get('num_micro_batch', 1), bool(r.get('remat')), r.get('at_micro_batch'))
        == (workload, method, n, remat, at)):
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


def _n_steps(one: dict, n: int) -> dict:
  """``one``'s result as if each round ran ``n`` of its steps (a step at the micro-batch, against N of them)."""
  return dict(one, step_times=[n * t for t in one['step_times']])


def _over_n_steps(mine: dict, one: dict, n: int) -> str:
  """``mine``'s step against ``n`` steps of ``one`` (a step at the micro-batch), per round: median (quartiles)."""
  return _spread(mine, _n_steps(one, n))


def ratios(results: List[dict], workload: str) -> List[str]:
  """AccumBPTT against plain JAX + optax and against the hand-written recipe, N by N, and AccumBPTT's own
  cost over bp.BPTT with what micro-batching itself costs (plain JAX's N against its 1) divided out; where the
  steps at the micro-batch were measured (``--column``), the model's own cost at that size (bp.BPTT against plain
  JAX there) and AccumBPTT against N of bp.BPTT's steps at the micro-batch (accumulation's own cost)."""
  lines = ['| N | AccumBPTT / plain JAX + optax | AccumBPTT / recipe | recipe / plain JAX | '
           '[AccumBPTT(N) / bp.BPTT] / [plain JAX(N) / plain JAX(1)] | at the micro-batch: bp.BPTT / plain JAX | '
           'AccumBPTT(N) / [N x bp.BPTT at the micro-batch] |', '|---|---|---|---|---|---|---|']
  bptt, jax_1 = _find(results, workload, 'bptt'), _find(results, workload, 'jax', 1)
  for n in sorted({r['num_micro_batch'] for r in results if r['workload'] == workload and r['method'] == 'jax'}):
    mine, jax_, recipe = (_find(results, workload, m, n) for m in ('accum', 'jax', 'recipe'))
    bptt_at, jax_at = (_find(results, workload, m, at=n) for m in ('bptt', 'jax'))
    if mine and jax_:
      cells = [_spread(mine, jax_), _spread(mine, recipe) if recipe else '-', _spread(recipe, jax_) if recipe else '-',
               _cost_of_micro_batching_divided_out(mine, bptt, jax_, jax_1) if bptt and jax_1 and n > 1 else '-',
               _spread(bptt_at, jax_at) if bptt_at and jax_at else '-',
               _over_n_steps(mine, bptt_at, n) if bptt_at else '-']
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
                   f'{_check(ratio <= COLUMN_LIMIT)}'
                   f'{_factors(results, workload, n, column=True) if ratio > COLUMN_LIMIT else ""}')
  for other, limit in (('jax', JAX_LIMIT), ('recipe', RECIPE_LIMIT)):
    for n in RATIO_NS:
      mine, theirs = _find(results, workload, 'accum', n), _find(results, workload, other, n)
      if mine and theirs:
        ratio = _ratio(mine, theirs)
        lines.append(f'- AccumBPTT / {_label(theirs)} at N={n}: {ratio:.3f} (target <= {limit:.2f}): '
                     f'{_check(ratio <= limit)}'
                     f'{_factors(results, workload, n, False) if other == "jax" and ratio > limit else ""}')
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


def _factors(results: List[dict], workload: str, n: int, column: bool) -> str:
  """Where the steps at N's micro-batch were measured, a missed ratio against plain JAX in its factors (each the
  median of its own per-round ratios, so their product comes near the ratio, within the rounds' noise, not exactly
  to it): AccumBPTT's N micro-batches against N of bp.BPTT's steps at the micro-batch (accumulation's own cost),
  bp.BPTT against plain JAX there (the BrainPy model's), and N of plain JAX's steps there against its N
  micro-batches in one step (what plain JAX's scan saves); for the ``column``'s ratio, over bp.BPTT against plain
  JAX at the whole batch too."""
  mine, bptt_at, jax_at = (_find(results, workload, 'accum', n), _find(results, workload, 'bptt', at=n),
                           _find(results, workload, 'jax', at=n))
  jax_n, bptt, jax_1 = (_find(results, workload, 'jax', n), _find(results, workload, 'bptt'),
                        _find(results, workload, 'jax'))
  if not (mine and bptt_at and jax_at and jax_n and (bptt and jax_1 or not column)):
    return ''
  text = (f'; its factors: AccumBPTT against {n} bp.BPTT steps at batch {bptt_at["shape"][0]} '
          f'{_ratio(mine, _n_steps(bptt_at, n)):.3f} (accumulation\'s own), bp.BPTT against plain JAX there '
          f'{_ratio(bptt_at, jax_at):.3f} (the BrainPy model), {n} plain JAX steps there against plain JAX\'s {n} '
          f'micro-batches {_ratio(_n_steps(jax_at, n), jax_n):.3f} (its scan)')
  return text + (f', over bp.BPTT against plain JAX at the whole batch {_ratio(bptt, jax_1):.3f}' if column else '')


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
      rs = sorted((r for r in mine if r['method'] == method and bool(r.get('remat')) == remat
                   and not r.get('at_micro_batch')),
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


# ------------------------------------------------------------------ the device part

NAMES = {'snn_ce': 'spiking network (SpikingRNN)', 'rnn_ce': 'rate RNN (RNNCell)'}
AHEAD, WITH_STEP, DEVICE = 'numpy, sent ahead', 'numpy, with its step', 'device'  # how batches reach the step
# the vendors' dense bf16 peaks, FLOP/s per chip, by device_kind (a substring of it)
NOMINAL_PEAK = {'TPU v5 lite': 197e12, 'TPU v5e': 197e12, 'TPU v5p': 459e12, 'TPU v5': 459e12, 'TPU v4': 275e12,
                'TPU v6 lite': 918e12, 'TPU v6e': 918e12, 'H100': 989e12, 'H200': 989e12, 'A100': 312e12}


def _nominal_peak(kind: str) -> Optional[float]:
  return next((peak for name, peak in NOMINAL_PEAK.items() if name.lower() in kind.lower()), None)


def _fmt_bytes(n: Optional[float]) -> str:
  if n is None:
    return '-'
  unit = next((u for u in ('GiB', 'MiB', 'KiB') if n >= 2 ** (10 * ('KMG'.index(u[0]) + 1))), 'B')
  return f'{n:.0f} B' if unit == 'B' else f"{n / 2 ** (10 * ('KMG'.index(unit[0]) + 1)):.1f} {unit}"


def _fmt_flops(flops: Optional[float]) -> str:
  """FLOP/s with its SI prefix: ``'110 TFLOP/s'``, ``'3.2 GFLOP/s'``."""
  if flops is None:
    return '-'
  prefix, scale = next(((p, s) for p, s in (('T', 1e12), ('G', 1e9), ('M', 1e6)) if flops >= s), ('', 1.))
  return f'{flops / scale:.3g} {prefix}FLOP/s'


def _speed(row: dict, kind: str) -> str:
  value = row.get('samples_per_s', {}).get(kind)
  return '-' if value is None else f'{value:,.0f}'


def _speed_ratio(rows: List[dict], mine: tuple, theirs: tuple) -> Optional[float]:
  """Median of per-round ratios of samples/s, ``mine = (trainer, kind)`` over ``theirs``, where they were timed
  in the same rounds, else the ratio of medians (NumPy against device batches timed in two phases)."""
  a = next((r for r in rows if r['trainer'] == mine[0]), None)
  b = next((r for r in rows if r['trainer'] == theirs[0]), None)
  if not a or not b or mine[1] not in a['epoch_s'] or theirs[1] not in b['epoch_s']:
    return None
  if a['interleaved'] or (mine[1] == DEVICE) == (theirs[1] == DEVICE):  # timed in the same rounds
    return per_round_ratio(b['epoch_s'][theirs[1]], a['epoch_s'][mine[1]])  # time ratio inverted: speed
  return statistics.median(b['epoch_s'][theirs[1]]) / statistics.median(a['epoch_s'][mine[1]])


def _fit_gives(facts: dict) -> str:
  """How AccumBPTT's fit hands NumPy batches to the step by default on the run's device (:func:`sends_ahead`)."""
  return WITH_STEP if facts['platform'] == 'cpu' else AHEAD


def _run_section(facts: dict, run: dict) -> List[str]:
  accelerator = facts['platform'] != 'cpu'
  fit_gives = _fit_gives(facts)
  shape = Shape(*run['shape'])
  peak = run['peak']
  nominal = _nominal_peak(facts['kind']) if accelerator else None
  label = f"{facts['kind']} ({facts['platform'].upper()})" if accelerator else \
      f"CPU ({facts['host']}): not an accelerator"
  out = [f'## {label}', '']
  if not accelerator:
    out += ['**CPU figures.** They show that every code path runs (planning, sending batches ahead, plain JAX at '
            'the same micro-batching) at a small scale; they say nothing of an accelerator\'s speed or memory. On a '
            'CPU the "device" is the host\'s memory: there is no transfer to hide, and a jitted step takes a NumPy '
            'array more cheaply than a copy made ahead, so on a CPU `fit` hands each batch to its step (the column '
            '"NumPy, with its step"), and sends batches ahead only on an accelerator.', '']
  commands = run.get('commands', [facts['command']])  # several where batch sizes were measured in several calls
  out += [f"- Command{'s' if len(commands) > 1 else ''}: {'; '.join(f'`{c}`' for c in commands)}; "
          f"{facts['date']} (the last).",
          f"- Device: {facts['kind']} x {facts['count']} ({facts['platform']}), memory limit "
          f"{_fmt_bytes(facts['memory_limit'])}; host {facts['host']}.",
          '- Versions: ' + ', '.join(f'{k} {v}' for k, v in facts['versions'].items()) + '.',
          f"- Networks: T={shape.time}, {shape.hidden} hidden, {shape.inputs} inputs, {shape.outputs} classes, "
          f"cross-entropy of the last step, Adam; an epoch is {run['epoch']} batches, {run['rounds']} rounds.",
          f"- What `fit` gives the user here, NumPy batches: AccumBPTT \"{fit_gives}\", bp.BPTT \"{WITH_STEP}\" "
          f"(its own loop).",
          "- AccumBPTT: `num_micro_batch='auto'`, " + (f"memory_budget={run['budget']!r} (a CPU has no device "
                                                        f"limit to plan against)" if run['budget'] else
                                                        'no memory_budget (the device\'s own memory)') + '.',
          f"- Peak: a square matmul measured {_fmt_flops(peak['float32'])} in float32 (default precision), "
          f"{_fmt_flops(peak['bfloat16'])} in bfloat16" + (f"; the vendor's dense bf16 figure is "
                                                          f"{nominal / 1e12:.0f} TFLOP/s" if nominal else '') + '.',
          '']
  for workload in dict.fromkeys(r['workload'] for r in run['rows']):
    out += _workload_table(workload, [r for r in run['rows'] if r['workload'] == workload], peak, fit_gives)
  if run.get('holds'):
    out += ['### Arrays put on the device after planning', '',
            'A fresh AccumBPTT planned and trained one batch with the device free, then trained it again while an '
            'array held a share of the device (`--holds BATCH`):', '']
    out += [f"- {h['held_share']:.0%} held: {h['seconds']:.1f} s, "
            + (f"plan {h['plan']}" if h['error'] is None else f"error {h['error']}") for h in run['holds']]
    out.append('')
  out += _host_copy_table(run['host_copy']) if run.get('host_copy') else []
  if run.get('notes'):  # measured on the same device beside the benchmark (kept in accelerator.json)
    out += ['### Measured beside it', ''] + [f'- {note}' for note in run['notes']] + ['']
  return out


def _workload_table(workload: str, rows: List[dict], peak: dict, fit_gives: str) -> List[str]:
  """One network's rows of a run: the table, the ratios of samples/s by batch size, what did not run."""
  out = [f'### {NAMES.get(workload, workload)}', '',
         '| batch | trainer | fits | plan | bytes (XLA) | first epoch s | samples/s: NumPy, sent ahead | NumPy, '
         'with its step | on the device | achieved (device data) | of the measured peak |',
         '|---|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    speed = r.get('samples_per_s', {}).get(DEVICE)
    achieved = None if speed is None else r['model_flops'] * speed / r['batch']
    fits = {True: 'yes', False: '**no**', None: 'error'}[r['fits']]
    note = r['error'] or r.get('run_error') or ''
    out.append(f"| {r['batch']} | {r['trainer']} | {fits} | {r.get('plan', note[:80] or '-')} | "
               f"{_fmt_bytes(r.get('bytes'))} | {r.get('first_epoch_s', float('nan')):.1f} | "
               f"{_speed(r, AHEAD)} | {_speed(r, WITH_STEP)} | {_speed(r, DEVICE)} | "
               f"{_fmt_flops(achieved)} | "
               f"{'-' if achieved is None else f'{achieved / max(peak.values()):.0%}'} |")
  out += _startup_table(rows)
  out += ['', 'Ratios of samples/s:', '']
  best = max((r['samples_per_s'].get(DEVICE, 0) for r in rows if r['trainer'] == 'bp.BPTT'), default=0)
  if best:
    mine = [r for r in rows if r['trainer'] == 'AccumBPTT']
    out.append("- Against bp.BPTT's best on device batches (" + f'{best:,.0f} samples/s), AccumBPTT: ' + '; '.join(
      f"B={r['batch']} " + ', '.join(f'{kind} {r["samples_per_s"][kind] / best:.2f}'
                                     for kind in (fit_gives, DEVICE) if kind in r['samples_per_s'])
      for r in mine if r['samples_per_s']))
  for batch in dict.fromkeys(r['batch'] for r in rows):
    at = [r for r in rows if r['batch'] == batch]
    ratio = functools.partial(_speed_ratio, at)
    cells = [('AccumBPTT sent ahead / with its step', ratio(('AccumBPTT', AHEAD), ('AccumBPTT', WITH_STEP))),
             ("AccumBPTT fit's NumPy / its device batches", ratio(('AccumBPTT', fit_gives), ('AccumBPTT', DEVICE))),
             ("AccumBPTT fit's NumPy / bp.BPTT's NumPy", ratio(('AccumBPTT', fit_gives), ('bp.BPTT', WITH_STEP))),
             ('AccumBPTT / bp.BPTT, device', ratio(('AccumBPTT', DEVICE), ('bp.BPTT', DEVICE))),
             ('AccumBPTT / plain JAX, device', ratio(('AccumBPTT', DEVICE), ('plain JAX + optax', DEVICE)))]
    cells = [f'{name} {value:.2f}' for name, value in cells if value is not None]
    out += [f'- B={batch}: ' + '; '.join(cells)] if cells else []  # (a batch with no second speed to set against)
  errors = [r for r in rows if r['error'] or r.get('run_error') or r.get('plan_error')]
  if errors:
    out += ['', 'What did not run:', '']
    out += [f"- B={r['batch']} {r['trainer']}: {r['error'] or r.get('run_error') or r.get('plan_error')}"
            for r in errors]
  return out + ['']


STARTUP_PHASES = (('planning probes', 'probes'), ('planned step compiles', 'planned step compiles'),
                  ('trial runs', 'trial runs'), ('planning (other)', 'planning, other'),
                  ('first-batch check', 'first-batch check (waited for)'), ('step compile', 'step compile'),
                  ('runs and the rest', 'runs and the rest'), ('beside', 'beside (its own thread)'))


def _host_copy_table(copies: List[dict]) -> List[str]:
  """GB/s of a piece's copy to the device out of host arrays, by way and slices (``--host-copy``); a kind of
  slices a run did not measure (older runs: no "written earlier") is ``-``."""
  piece = copies[0]['piece_bytes'] / 2 ** 20
  kinds = ('untouched', 'written earlier', 'touched')
  out = ['### A piece copied to the device out of a host array (plain JAX)', '',
         f'`--host-copy`: a piece of {piece:.0f} MiB out of float32 host arrays; GB/s, the median of the copies; '
         '"untouched": pages never written since the array was made (each way its own array, a different slice '
         'each copy), "written earlier": the array written once before the copies (a batch made before training: '
         'the feed\'s case), "touched": written just before the copy; the ways of a kind take the array\'s slices '
         'in turn (an array of fewer slices than the copies has some read again; runs before 2026-12-07 copied '
         'the untouched ones out of one array, so most of their copies read slices read before).', '',
         '| host array | way | ' + ' | '.join(f'{k} GB/s' for k in kinds) + ' |', '|---|---|---|---|---|']
  cells = {(c['host_gb'], c['way'], c['slices']): c for c in copies}
  for gb, way in dict.fromkeys((c['host_gb'], c['way']) for c in copies):
    out.append(f"| {gb:g} GB | {way} | " + ' | '.join(_rate(cells[gb, way, k]) if (gb, way, k) in cells else '-'
                                                       for k in kinds) + ' |')
  return out + ['']


def _rate(copy: dict) -> str:
  return copy['error'][:60] if copy.get('error') else f"{copy['gb_per_s']:.2f}"


def _startup_table(rows: List[dict]) -> List[str]:
  """The first epoch by phase (:mod:`~brainpy_accum.diagnostics._phases`), AccumBPTT's against bp.BPTT's at the
  same batch, or at bp.BPTT's largest batch that fits where it does not fit (marked ``*``)."""
  timed = [r for r in rows if r.get('first_fit_phases')]
  if not timed:
    return []
  out = ['', 'Start-up, the first epoch by phase (seconds on the thread that calls `fit`; XLA compilations in '
         'brackets; "beside": the first-batch check compiling and running on its own thread, not waited for):', '',
         '| batch | trainer | first epoch s | / bp.BPTT | ' + ' | '.join(label for _, label in STARTUP_PHASES) + ' |',
         '|---|---|---|---|' + '---|' * len(STARTUP_PHASES)]
  bptt = {r['batch']: r for r in timed if r['trainer'] == 'bp.BPTT'}
  for r in timed:
    base = bptt.get(r['batch']) or (bptt[max(bptt)] if bptt and r['batch'] > max(bptt) else None)
    ratio = '-' if base is None else f"{r['first_epoch_s'] / base['first_epoch_s']:.2f}" + (
      '' if base['batch'] == r['batch'] else f" * (at {base['batch']})")
    cells = [f"{p['seconds']:.2f} ({p['compilations']})" if p['seconds'] or p['compilations'] else '-'
             for p in (r['first_fit_phases'][name] for name, _ in STARTUP_PHASES)]
    out.append(f"| {r['batch']} | {r['trainer']} | {r['first_epoch_s']:.2f} | {ratio} | " + ' | '.join(cells) + ' |')
  return out


HEADER = '''# On a GPU or TPU

Made by `python -m brainpy_accum.bench --parts device` (or `python -m brainpy_accum.bench.accelerator`): on an
accelerator the spiking network (`bench.workloads.SpikingRNN`: T=500, 1024 hidden, 128 inputs, cross-entropy of
the last step's read-out, Adam) at batch sizes from 2,048 (bp.BPTT's largest on a TPU v5e) to 65,536 (16.8 GB of
data, as large as the chip); on a CPU both networks at small sizes. For each batch size: whether bp.BPTT's step
fits, `AccumBPTT(num_micro_batch='auto')`'s plan and bytes with no budget (the device's own memory), the time to
the first epoch, and samples/s over epochs of 16 batches through `fit`:

- **NumPy, sent ahead**: NumPy batches from the host, as users pass them, each batch (or, where its step does not
  run in one micro-batch, each piece of one micro-batch) sent to the device while the step before it runs. This
  is what AccumBPTT's `fit` gives the user on an accelerator.
- **NumPy, with its step**: the same batches, each copied when its step is called: what bp.BPTT's own loop does,
  and `fit` on a CPU (where there is no transfer to hide).
- **on the device**: the same batches made on the device beforehand; no copy, the step's own speed (only where
  a batch takes at most 30% of the device: a larger one cannot sit there beside its step).

On a machine whose commands are limited in time (the TPU's 10-minute calls) the run is its calls in sequence,
each a subset of the batch sizes that adds its rows to `accelerator.json` (same device and settings): `--batches
2048 4096 8192` then `--batches 16384 32768` then `--batches 65536` (with `--holds 4096` in any one of them).
bp.BPTT's reference is measured once: a call above the batch whose bp.BPTT step an earlier call found too large
does not compile it again.

The first epoch is also given by phase (`brainpy_accum.diagnostics._phases`): the planner's quick probes, its
compilations for training (the kept one is the step's own compilation), trial steps, other planning, the wait for
the first-batch check, the steps' compilations outside planning, and the runs with the rest (transfers, the loop);
"beside" is the check compiling on its own thread. AccumBPTT's first epoch is set against bp.BPTT's at the same
batch, or, where bp.BPTT does not fit, at its largest batch that does (marked `*`). Since 5f5b383 a throwaway
model is built and reset at each batch size before the first fits, so that the model's own small programs are
compiled before either trainer is timed (on the TPU v5e, every row measured since 2026-12-07 14:23 UTC); before,
bp.BPTT, timed first, held them for both. `--host-copy 4 8 16` measures,
in plain JAX, a piece's copy to the device out of host arrays of those sizes (GB): directly (one copy: fit's
way since 01c77a9; 8 threads before it), from 4 or 8 threads, staged in a reused or a fresh host buffer, and
through JAX's `pinned_host` memory, from slices written just before, written once before any copy (a batch made
before training: the feed's case) and pages never touched since the array was made (runs before 2026-12-07
measured the first and the last only). The arrays are batches of the network's samples (T x inputs) and a piece
is whole samples, as fit's are. Runs up to 2026-12-07 copied slices of flat arrays: one thread moved 4.2-4.3
GB/s there, against 9.8 GB/s for the feed's own copies of (2048, 500, 128) pieces back to back out of one 512 MiB
array (bench.feed, the same day); which of the two a piece of the feed's shape out of a large array gets is for
the next run to say.

The ratios against bp.BPTT's best speed on device batches are the issue's measure. `--holds BATCH` also trains
one batch after planning it with 60% and 30% of the device held by an array. FLOP/s count the matmuls:
`6 B T (I H + H H + H O)` a train step. "Bytes" are XLA's compile-time figure of the train step (arguments,
outputs, temporaries); for AccumBPTT that of its plan (of a piece, where the batch is streamed in pieces). Trainers
alternate within a round (order reversed every other round); ratios are medians of per-round ratios, except between
NumPy and device batches at a batch size where three batches take more than a tenth of the device's memory: those
are timed in two phases (so that the device holds one of them at a time) and their ratio is one of medians. Plain
JAX + optax at the same micro-batching is measured on the CPU run only.'''


def device_report(data: dict) -> str:
  """accelerator.md: every run of ``data`` (accelerators first), and what is still missing."""
  runs = sorted(data.get('runs', {}).values(), key=lambda r: r['facts']['platform'] == 'cpu')
  out = [HEADER, '']
  if not any(r['facts']['platform'] != 'cpu' for r in runs):
    out += ['**No accelerator figures yet.** Every figure below was measured on a CPU. The figures on a chip (on '
            'the TPU v5e: bp.BPTT\'s frontier, AccumBPTT(\'auto\') with no budget at 4,096, 8,192 and 16,384, NumPy '
            'against device batches at 2,048, 4,096 and 8,192, FLOP/s against the chip\'s peak) will be added here '
            'by rerunning the command above when a chip is lent.', '']
  for run in runs:
    out += _run_section(run['facts'], run)
  out += ['![samples/s and bytes against the batch size](accelerator.png)', '']
  return '\n'.join(out)


def plot_device(data: dict, path: str) -> None:
  """Samples/s (NumPy batches through fit, and device batches) and bytes against the batch size, per run and
  workload; bp.BPTT, AccumBPTT and plain JAX; the device's memory limit where known."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  panels = [(run, w) for run in data.get('runs', {}).values() for w in dict.fromkeys(r['workload'] for r in run['rows'])]
  fig, axes = plt.subplots(2, max(1, len(panels)), figsize=(5.5 * max(1, len(panels)), 8), squeeze=False)
  styles = {'bp.BPTT': 'D-', 'AccumBPTT': 'o-', 'plain JAX + optax': '^:'}
  for column, (run, workload) in enumerate(panels):
    speed_ax, bytes_ax = axes[0][column], axes[1][column]
    for color, (trainer, style) in enumerate(styles.items()):
      color = f'C{color}'  # one colour a trainer: NumPy batches filled, device batches hollow
      rows = [r for r in run['rows'] if r['workload'] == workload and r['trainer'] == trainer]
      numpy = _fit_gives(run['facts']) if trainer == 'AccumBPTT' else WITH_STEP
      for kind, fill in ((numpy, 'full'), (DEVICE, 'none')):
        points = [(r['batch'], r['samples_per_s'][kind]) for r in rows if kind in r.get('samples_per_s', {})]
        if points:
          speed_ax.plot(*zip(*points), style, color=color, fillstyle=fill, label=f'{trainer}, {kind}')
      points = [(r['batch'], r['bytes']) for r in rows if r.get('bytes')]
      if points:
        bytes_ax.plot([b for b, _ in points], [v / 2 ** 20 for _, v in points], style, color=color, label=trainer)
      misses = [r['batch'] for r in rows if r['fits'] is False]
      if misses:
        speed_ax.plot(misses, [0] * len(misses), 'x', color=color, ms=10, label=f'{trainer}: does not fit')
    limit = run['facts'].get('memory_limit')
    if limit:
      bytes_ax.axhline(limit / 2 ** 20, color='gray', ls='--', label='device memory')
    elif run.get('budget'):
      bytes_ax.axhline(parse_memory(run['budget']) / 2 ** 20, color='gray', ls='--',
                       label=f"AccumBPTT's memory_budget {run['budget']}")
    device = 'CPU, not an accelerator' if run['facts']['platform'] == 'cpu' else run['facts']['kind']
    title = f"{device}: {NAMES.get(workload, workload)}"
    speed_ax.set(xscale='log', xlabel='batch size', ylabel='samples/s', title=title)
    bytes_ax.set(xscale='log', yscale='log', xlabel='batch size', ylabel='train step, MiB (XLA)')
    for ax in (speed_ax, bytes_ax):
      ax.grid(alpha=0.3, which='both')
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
