"""The device part's report: ``accelerator.md`` (every run measured, by device, accelerators first, and what is
still missing) and ``accelerator.png`` (samples/s and bytes against the batch size), from the runs that
:mod:`.device` measures and keeps in ``accelerator.json``."""

import statistics
from typing import List, Optional

from ..memory import parse_memory
from .measure import per_round_ratio
from .workloads import Shape

__all__ = ['AHEAD', 'WITH_STEP', 'DEVICE', 'NAMES', 'NOMINAL_PEAK', 'device_report', 'plot_device']

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


def _ratio(rows: List[dict], mine: tuple, theirs: tuple) -> Optional[float]:
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
  out += [f"- Command: `{facts['command']}`; {facts['date']}.",
          f"- Device: {facts['kind']} x {facts['count']} ({facts['platform']}), memory limit "
          f"{_fmt_bytes(facts['memory_limit'])}; host {facts['host']}.",
          '- Versions: ' + ', '.join(f'{k} {v}' for k, v in facts['versions'].items()) + '.',
          f"- Networks: T={shape.time}, {shape.hidden} hidden, {shape.inputs} inputs, {shape.outputs} classes, "
          f"cross-entropy of the last step, Adam; an epoch is {run['epoch']} batches, {run['rounds']} rounds.",
          f"- What `fit` gives the user here, NumPy batches: AccumBPTT \"{fit_gives}\", bp.BPTT \"{WITH_STEP}\" "
          f"(its own loop).",
          f"- AccumBPTT: `num_micro_batch='auto'`, " + (f"memory_budget={run['budget']!r} (a CPU has no device "
                                                        f"limit to plan against)" if run['budget'] else
                                                        'no memory_budget (the device\'s own memory)') + '.',
          f"- Peak: a square matmul measured {_fmt_flops(peak['float32'])} in float32 (default precision), "
          f"{_fmt_flops(peak['bfloat16'])} in bfloat16" + (f"; the vendor's dense bf16 figure is "
                                                          f"{nominal / 1e12:.0f} TFLOP/s" if nominal else '') + '.',
          '']
  for workload in dict.fromkeys(r['workload'] for r in run['rows']):
    rows = [r for r in run['rows'] if r['workload'] == workload]
    out += [f'### {NAMES.get(workload, workload)}', '',
            '| batch | trainer | fits | plan | bytes (XLA) | first epoch s | samples/s: NumPy, sent ahead | NumPy, '
            'with its step | on the device | achieved (device data) | of the measured peak |',
            '|---|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
      speed = r.get('samples_per_s', {}).get(DEVICE)
      achieved = None if speed is None else r['model_flops'] * speed / r['batch']
      best_peak = max(peak.values())
      fits = {True: 'yes', False: '**no**', None: 'error'}[r['fits']]
      note = r['error'] or r.get('run_error') or ''
      out.append(f"| {r['batch']} | {r['trainer']} | {fits} | {r.get('plan', note[:80] or '-')} | "
                 f"{_fmt_bytes(r.get('bytes'))} | {r.get('first_epoch_s', float('nan')):.1f} | "
                 f"{_speed(r, AHEAD)} | {_speed(r, WITH_STEP)} | {_speed(r, DEVICE)} | "
                 f"{_fmt_flops(achieved)} | "
                 f"{'-' if achieved is None else f'{achieved / best_peak:.0%}'} |")
    out += ['', 'Ratios of samples/s:', '']
    for batch in dict.fromkeys(r['batch'] for r in rows):
      at = [r for r in rows if r['batch'] == batch]
      cells = [('AccumBPTT sent ahead / with its step', _ratio(at, ('AccumBPTT', AHEAD), ('AccumBPTT', WITH_STEP))),
               ("AccumBPTT fit's NumPy / its device batches", _ratio(at, ('AccumBPTT', fit_gives), ('AccumBPTT', DEVICE))),
               ("AccumBPTT fit's NumPy / bp.BPTT's NumPy", _ratio(at, ('AccumBPTT', fit_gives), ('bp.BPTT', WITH_STEP))),
               ('AccumBPTT / bp.BPTT, device', _ratio(at, ('AccumBPTT', DEVICE), ('bp.BPTT', DEVICE))),
               ('AccumBPTT / plain JAX, device', _ratio(at, ('AccumBPTT', DEVICE), ('plain JAX + optax', DEVICE)))]
      out.append(f'- B={batch}: ' + '; '.join(f'{name} {value:.2f}' for name, value in cells if value is not None))
    errors = [r for r in rows if r['error'] or r.get('run_error') or r.get('plan_error')]
    if errors:
      out += ['', 'What did not run:', '']
      out += [f"- B={r['batch']} {r['trainer']}: {r['error'] or r.get('run_error') or r.get('plan_error')}"
              for r in errors]
    out.append('')
  return out


HEADER = '''# On a GPU or TPU

Made by `python -m brainpy_accum.bench --parts device` (or `python -m brainpy_accum.bench.device`): the spiking
network (`bench.workloads.SpikingRNN`) and the rate RNN, cross-entropy of the last step's read-out, Adam, at
batch sizes from 256 to 16,384 on an accelerator (T=500, 1024 hidden, 128 inputs), small ones on a CPU.
For each batch size: whether bp.BPTT's step fits, `AccumBPTT(num_micro_batch='auto')`'s plan and bytes, plain
JAX + optax at the same micro-batching, the time to the first epoch of each, and samples/s over an epoch
through `fit`:

- **NumPy, sent ahead**: NumPy batches from the host, as users pass them, each sent to the device while the
  step before it runs (at most one batch ahead), so that the copy hides behind the step where the step is the
  longer. This is what AccumBPTT's `fit` gives the user on an accelerator.
- **NumPy, with its step**: the same batches, each copied when its step is called. This is what `fit` gives
  on a CPU (where there is no transfer to hide), and what bp.BPTT's own loop does everywhere.
- **on the device**: the same batches made on the device beforehand; no copy, the step's own speed.

FLOP/s count the matmuls: `6 B T (I H + H H + H O)` a train step (forward, and the backward pass at twice the
forward). XLA's cost analysis (in `accelerator.json`, `xla_flops`) counts each loop body once, whatever its trip
count, so it is not used. "Bytes" are XLA's compile-time figure of the train step (arguments, outputs,
temporaries); for AccumBPTT that of its plan. Trainers alternate within a round (order reversed every other
round); ratios are medians of per-round ratios, except between NumPy and device batches at a batch size where
three batches take more than a tenth of the device's memory: those are timed in two phases (so that the device
holds one of them at a time) and their ratio is one of medians.'''


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
