"""``python -m brainpy_accum.bench.whole_batch``: what ``whole_batch_loss=True`` costs and what it buys.

A loss that couples the samples of a batch (here a firing-rate regulariser over the whole batch, and
optionally a batch maximum) is trained exactly by ``AccumBPTT(..., whole_batch_loss=True)`` with two
passes inside one compiled step; the default mode is exact only for means over samples. For every trainer
(``bp.BPTT`` on the whole batch, the default mode and ``whole_batch_loss=True`` at N=4 and N=8, and the
latter with ``remat=True`` at N=8) this measures, all in one process:

- memory: XLA's compile-time analysis of the train step (arguments + outputs + temporaries - aliases),
  compiled ahead of time after ``model.reset(batch)``; deterministic;
- step time relative to ``bp.BPTT``: rounds in which every trainer runs one step (order rotated from
  round to round), the ratio taken within each round, then the median over rounds, so that load from
  other jobs on shared cores cancels; also the evaluation step (forward pass only) as the unit of the
  predicted extra cost of the two passes;
- exactness: the gradient of the first step from the same parameters on the same batch (read from Adam's
  first moment, ``(1 - beta1) * gradient`` after one update), against ``bp.BPTT``'s.

Writes ``whole_batch_loss_benchmark.md`` into ``--out``. Inputs and targets are random:
this measures steps, not learning.
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np

from ..memory import compiled_step_bytes
from ..trainer import AccumBPTT
from .measure import FIT, LEARNING_RATE
from .workloads import Shape, make_batch, make_brainpy_model

__all__ = ['main', 'rate_regularised_mse', 'batch_max_mse', 'CONFIGS', 'WORKLOADS']

FULL = Shape(batch=256, time=100, hidden=256, inputs=64)
QUICK = Shape(batch=16, time=40, hidden=16, inputs=4)
TARGET_RATE = 0.02  # f0: spikes per neuron per time step
MiB = 2 ** 20


def rate_regularised_mse(predicts, targets):
  """MSE of the read-out plus ``sum over neurons of (mean over batch and time of its spikes - f0)^2``."""
  out, mons = predicts
  rate = bm.mean(mons['spike'], axis=(0, 1))
  return bp.losses.mean_squared_error(out, targets) + bm.sum((rate - TARGET_RATE) ** 2), {'rate': bm.mean(rate)}


def batch_max_mse(predicts, targets):
  """Mean plus maximum over the batch of the per-sample MSE."""
  err = bm.mean((predicts - targets) ** 2, axis=(1, 2))
  return bm.mean(err) + bm.max(err), {'max_err': bm.max(err)}


class Workload(NamedTuple):
  model: str          # 'snn' or 'rnn' of .workloads
  loss: Callable
  monitored: bool     # the loss also receives the hidden spikes (monitors={'spike': ...})
  drive: float        # inputs are uniform in [0, drive) ...
  gains: Optional[Tuple[float, float]]  # ... times a gain per sample, uniform in [low, high) (None: 1)
  description: str


WORKLOADS = {
  'snn': Workload('snn', rate_regularised_mse, True, 8., (0.5, 1.5),
                  'recurrent LIF layer (arctan surrogate gradient) with a linear read-out, spikes monitored; '
                  'loss = MSE(read-out) + sum over neurons of (mean over batch and time of its spikes - '
                  f'{TARGET_RATE})^2; '
                  'inputs uniform in [0, 8) times a gain per sample uniform in [0.5, 1.5), so that the neurons '
                  'spike and samples differ in rate, as different stimuli do'),
  'rnn': Workload('rnn', batch_max_mse, False, 1., None,
                  'tanh RNN with a linear read-out; loss = mean + max over the batch of the per-sample MSE'),
}


class Config(NamedTuple):
  label: str
  method: str  # 'bptt' or 'accum'
  num_micro_batch: int = 1
  whole_batch_loss: bool = False
  remat: bool = False


CONFIGS = (
  Config('bp.BPTT', 'bptt'),
  Config('AccumBPTT default', 'accum', 4),
  Config('AccumBPTT default', 'accum', 8),
  Config('AccumBPTT whole_batch_loss=True', 'accum', 4, True),
  Config('AccumBPTT whole_batch_loss=True', 'accum', 8, True),
  Config('AccumBPTT whole_batch_loss=True', 'accum', 8, True, True),
)


def build_trainer(workload: Workload, model: bp.DynamicalSystem, config: Config):
  """The trainer of ``config`` for ``model`` (shared by every trainer of a workload), with its own Adam."""
  kwargs = dict(optimizer=bp.optim.Adam(lr=LEARNING_RATE), progress_bar=False, loss_has_aux=True,
                monitors={'spike': model.lif.spike} if workload.monitored else None)
  if config.method == 'bptt':
    return bp.BPTT(model, workload.loss, **kwargs)
  return AccumBPTT(model, workload.loss, num_micro_batch=config.num_micro_batch,
                   whole_batch_loss=config.whole_batch_loss, remat=config.remat, **kwargs)


def _reset(trainer, batch: int) -> None:
  trainer.target.reset(batch)  # as fit(reset_state=True) does before every batch
  trainer.reset_state()


def _params(model) -> Dict[str, bm.Variable]:
  return model.train_vars().unique()


def step_memory(trainer, config: Config, x, y) -> Dict[str, int]:
  """XLA compile-time memory of the train step: total (as the planner counts it) and temporaries."""
  _reset(trainer, x.shape[0])
  compiled = trainer.f_train.compile(FIT, x, y) if config.method == 'bptt' else trainer.compile_step(x, y)
  return {'total': compiled_step_bytes(compiled), 'temp': compiled.memory_analysis().temp_size_in_bytes}


def first_step(trainer, initial: Dict[str, np.ndarray], x, y):
  """``(gradient, loss, metrics)`` of the first step from the ``initial`` parameters (this call also compiles it).

  The gradient is read from Adam's first moment, which after the first update is ``(1 - beta1) * gradient``.
  """
  params = _params(trainer.target)
  for k, v in params.items():
    v.value = jnp.asarray(initial[k])
  _reset(trainer, x.shape[0])
  loss, aux = trainer.f_train(FIT, x, y)
  opt = trainer.optimizer
  grad = {k: np.asarray(opt.implicit_vars[k + '_m'].value) / (1. - opt.beta1) for k in params}
  return grad, float(loss), {k: float(v) for k, v in aux.items()}


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def interleaved_times(runs: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, List[float]]:
  """Seconds of every ``runs`` entry in each of ``rounds`` rounds; the order rotates from round to round."""
  names = list(runs)
  times = {name: [] for name in names}
  for name in names:  # warm-up: compiles what has not been compiled yet
    runs[name]()
  for r in range(rounds):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      times[name].append(_timed(runs[name]))
  return times


def summary(values: Sequence[float]) -> Dict[str, float]:
  """Median and quartiles of per-round values."""
  values = sorted(values)
  q = statistics.quantiles(values, n=4, method='inclusive') if len(values) > 1 else [values[0]] * 3
  return {'median': statistics.median(values), 'q1': q[0], 'q3': q[2]}


def ratio_stats(times: Sequence[float], base: Sequence[float]) -> Dict[str, float]:
  """Median and quartiles of the per-round ratios ``times / base``."""
  return summary([t / b for t, b in zip(times, base)])


def _key(config: Config) -> str:
  return f'{config.label} N={config.num_micro_batch}' + (' remat' if config.remat else '')


def measure_workload(name: str, shape: Shape, rounds: int, log=print) -> dict:
  """Every configuration of :data:`CONFIGS` on one workload: memory, first-step gradient, interleaved step times."""
  workload = WORKLOADS[name]
  x, y = make_batch(shape)
  x = x * np.float32(workload.drive)
  if workload.gains is not None:
    x = x * np.random.RandomState(1).uniform(*workload.gains, size=(shape.batch, 1, 1)).astype(np.float32)
  model = make_brainpy_model(workload.model, shape)  # one model: every trainer starts from the same parameters
  initial = {k: np.asarray(v.value) for k, v in _params(model).items()}
  for k, v in _params(model).items():
    v.value = jnp.asarray(initial[k])  # not weakly typed (as after any update), so restoring them recompiles nothing
  trainers, results = {}, []
  for config in CONFIGS:
    trainer = build_trainer(workload, model, config)
    memory = step_memory(trainer, config, x, y)
    grad, loss, metrics = first_step(trainer, initial, x, y)
    trainers[_key(config)] = trainer
    results.append({'config': config._asdict(), 'key': _key(config), 'memory': memory, 'grad': grad, 'loss': loss,
                    'metrics': metrics})
    log(f'{name}: {_key(config):45s} memory {memory["total"] / MiB:8.2f} MiB (temp {memory["temp"] / MiB:8.2f})',
        flush=True)

  runs = {key: _stepping(t, shape.batch, x, y, model) for key, t in trainers.items()}
  forwards = {c.num_micro_batch: _key(c) for c in CONFIGS if c.method == 'accum' and not c.whole_batch_loss}
  runs.update({f'forward N={n}': _forwarding(trainers[key], shape.batch, x, y) for n, key in forwards.items()})
  times = interleaved_times(runs, rounds)
  base_key = _key(CONFIGS[0])
  scale = _against_bptt(name, results, times, base_key, log)
  forward_ratios = {n: ratio_stats(times[f'forward N={n}'], times[base_key]) for n in forwards}
  # Extra time of the two passes over the default mode at the same N, in forward passes, round by round.
  extra = {}
  for n in forwards:
    two, one = times[_key(Config(CONFIGS[3].label, 'accum', n, True))], times[forwards[n]]
    extra[n] = summary([(a - b) / f for a, b, f in zip(two, one, times[f'forward N={n}'])])
  outputs = shape.outputs + (shape.hidden if workload.monitored else 0)
  return {'workload': name, 'description': workload.description, 'shape': shape._asdict(), 'results': results,
          'forward': forward_ratios, 'extra_forwards': extra, 'bptt_step_s': statistics.median(times[base_key]), 'rounds': rounds,
          'grad_scale': scale, 'predictions_bytes': shape.batch * shape.time * outputs * 4}


def _stepping(trainer, batch: int, x, y, model):
  """A run of ``trainer``'s train step on a fresh state, to time."""
  def run():
    _reset(trainer, batch)
    jax.block_until_ready((trainer.f_train(FIT, x, y), [v.value for v in _params(model).values()]))
  return run


def _forwarding(trainer, batch: int, x, y):
  """A run of ``trainer``'s evaluation step (the forward pass) on a fresh state, to time."""
  def run():
    _reset(trainer, batch)
    jax.block_until_ready(trainer.f_loss(FIT, x, y))
  return run


def _against_bptt(name: str, results: list, times: dict, base_key: str, log) -> float:
  """Each result's step time, gradient and loss against bp.BPTT's (the first result); the gradient's scale."""
  base_grad, base_loss = results[0]['grad'], results[0]['loss']
  scale = max(float(np.max(np.abs(g))) for g in base_grad.values())
  for r in results:
    r['step'] = ratio_stats(times[r['key']], times[base_key])
    r['grad_max_abs_diff'] = max(float(np.max(np.abs(r['grad'][k] - g))) for k, g in base_grad.items())
    r['grad_rel_diff'] = r['grad_max_abs_diff'] / scale
    r['grad_rel_l2'] = _norm([r['grad'][k] - g for k, g in base_grad.items()]) / _norm(base_grad.values())
    r['loss_diff'] = r['loss'] - base_loss
    del r['grad']
    log(f"{name}: {r['key']:45s} step {r['step']['median']:.2f} x BPTT  grad diff {r['grad_max_abs_diff']:.2e} "
        f"({r['grad_rel_diff']:.1e} of max |grad|, relative L2 {r['grad_rel_l2']:.1e})  "
        f"loss diff {r['loss_diff']:+.2e}", flush=True)
  return scale


def _norm(arrays) -> float:
  return float(np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in arrays)))


def _find(m: dict, n: int, whole: bool, remat: bool = False) -> dict:
  for r in m['results']:
    c = r['config']
    if (c['method'], c['num_micro_batch'], c['whole_batch_loss'], c['remat']) == ('accum', n, whole, remat):
      return r
  raise KeyError((n, whole, remat))


def table(m: dict) -> List[str]:
  base = m['results'][0]
  lines = ['| trainer | N | micro-batch | remat | step memory MiB | temp MiB | memory / BPTT | '
           'step time / BPTT: median [quartiles] | first-step gradient: max abs diff from BPTT | '
           '... relative L2 error | loss - BPTT loss |',
           '|---|---|---|---|---|---|---|---|---|---|---|']
  for r in m['results']:
    c, mem, s = r['config'], r['memory'], r['step']
    lines.append(f"| {c['label']} | {c['num_micro_batch']} | {m['shape']['batch'] // c['num_micro_batch']} | "
                 f"{'yes' if c['remat'] else 'no'} | {mem['total'] / MiB:.2f} | {mem['temp'] / MiB:.2f} | "
                 f"{mem['total'] / base['memory']['total']:.3f} | {s['median']:.2f} [{s['q1']:.2f}, {s['q3']:.2f}] | "
                 f"{r['grad_max_abs_diff']:.2e} | {r['grad_rel_l2']:.1e} | {r['loss_diff']:+.2e} |")
  return lines


def interpretation(m: dict) -> List[str]:
  """3-5 sentences read off the figures."""
  base = m['results'][0]
  mem = lambda r: r['memory']['total'] / MiB
  d4, d8, w4, w8, wr = _find(m, 4, False), _find(m, 8, False), _find(m, 4, True), _find(m, 8, True), \
      _find(m, 8, True, True)
  fwd, extra = m['forward'], m['extra_forwards']
  span = lambda r: f"{r['median']:.2f} [{r['q1']:.2f}, {r['q3']:.2f}]"
  exact = max(w4['grad_rel_l2'], w8['grad_rel_l2'], wr['grad_rel_l2'])
  exact_abs = max(w4['grad_max_abs_diff'], w8['grad_max_abs_diff'], wr['grad_max_abs_diff'])
  default = max(d4['grad_rel_l2'], d8['grad_rel_l2'])
  if default > 10 * max(exact, 1e-7):
    verdict = (f"while the default mode's is off by {d4['grad_rel_l2']:.1e} / {d8['grad_rel_l2']:.1e} at N=4 / 8 "
               f"and it reports another loss "
               f"({d4['loss_diff']:+.2e} / {d8['loss_diff']:+.2e}): it trains the mean of the micro-batches' "
               f"losses, not the loss of the batch")
  else:
    verdict = (f"and the default mode's error is of the same order here ({default:.1e}): on this batch the loss "
               f"does not couple the samples beyond float32 round-off, so this run does not show the difference")
  return [
    f"- Memory: `whole_batch_loss=True` needs {mem(w4):.2f} / {mem(w8):.2f} MiB at N=4 / 8 "
    f"({w4['memory']['total'] / base['memory']['total']:.2f} / {w8['memory']['total'] / base['memory']['total']:.2f}"
    f" x bp.BPTT's {mem(base):.2f} MiB), {mem(w4) - mem(d4):+.2f} / {mem(w8) - mem(d8):+.2f} MiB against the "
    f"default mode at the same N; the whole batch's predictions that it keeps (what loss_fun receives) take "
    f"{m['predictions_bytes'] / MiB:.2f} MiB.",
    f"- With `remat=True` at N=8 it needs {mem(wr):.2f} MiB ({wr['memory']['total'] / base['memory']['total']:.2f}"
    f" x bp.BPTT, {wr['memory']['total'] / w8['memory']['total']:.2f} x N=8 without remat) and its step takes "
    f"{wr['step']['median']:.2f} x bp.BPTT's.",
    f"- Compute: its step takes {w4['step']['median']:.2f} / {w8['step']['median']:.2f} x bp.BPTT's at N=4 / 8, "
    f"against {d4['step']['median']:.2f} / {d8['step']['median']:.2f} x for the default mode; per round, its extra "
    f"time over the default mode is {span(extra[4])} / {span(extra[8])} micro-batched forward passes (median "
    f"[quartiles]; one forward pass = the evaluation step, {fwd[4]['median']:.2f} / {fwd[8]['median']:.2f} x "
    f"bp.BPTT's step), against the predicted ~1.",
    f"- Exactness: its first-step gradient matches bp.BPTT's to float32 round-off (relative L2 error at most "
    f"{exact:.1e}, largest entry difference {exact_abs:.1e}), {verdict}.",
  ]


def _metrics_text(m: dict) -> str:
  metrics = m['results'][0]['metrics']
  if 'rate' in metrics:
    return (f"Mean firing rate at the first step (bp.BPTT): {metrics['rate']:.4f} spikes per neuron per time step "
            f"(f0 = {TARGET_RATE}).")
  return ', '.join(f'{k} at the first step (bp.BPTT): {v:.4g}' for k, v in metrics.items()) + '.'


def markdown(measured: List[dict], header: str) -> str:
  out = [header, '']
  for m in measured:
    s = m['shape']
    out += [f"## {m['workload']}: batch {s['batch']}, T={s['time']}, hidden {s['hidden']}, {s['inputs']} inputs", '',
            m['description'] + '.', '']
    out += table(m) + ['']
    fwd = m['forward']
    out += [f"bp.BPTT step: median {m['bptt_step_s']:.3f} s over {m['rounds']} rounds. Forward pass alone "
            f"(AccumBPTT's evaluation step at N micro-batches: what pass 1 adds) / bp.BPTT step: " +
            ', '.join(f"N={n} {r['median']:.2f} [{r['q1']:.2f}, {r['q3']:.2f}]" for n, r in fwd.items()) +
            f". Largest gradient entry of bp.BPTT: {m['grad_scale']:.2e}. " + _metrics_text(m), '']
    out += interpretation(m) + ['']
  return '\n'.join(out)


def _load() -> str:
  try:
    return f'{os.getloadavg()[0]:.1f}'
  except OSError:
    return 'unknown'


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.whole_batch', description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true', help=f'tiny shape {tuple(QUICK)} instead of {tuple(FULL)}')
  parser.add_argument('--workloads', nargs='+', default=None, choices=sorted(WORKLOADS),
                      help='default: snn and rnn; snn alone with --quick')
  parser.add_argument('--rounds', type=int, default=None, help='interleaved timing rounds (default 30; 2 with --quick)')
  parser.add_argument('--out', default='docs', help='folder for whole_batch_loss_benchmark.md')
  argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]  # e.g. a pathlib.Path for --out
  args = parser.parse_args(argv)
  shape = QUICK if args.quick else FULL
  rounds = args.rounds or (2 if args.quick else 30)
  started, load = time.time(), _load()
  workloads = args.workloads or (['snn'] if args.quick else ['snn', 'rnn'])
  measured = [measure_workload(name, shape, rounds) for name in workloads]
  command = ' '.join(['python -m brainpy_accum.bench.whole_batch'] + argv)
  header = (
    f"# whole_batch_loss=True: memory, step time, exactness\n\n"
    f"Made by `{command}` on {datetime.date.today().isoformat()}: {platform.machine()} CPU, {os.cpu_count()} cores "
    f"(shared with other jobs), Python {platform.python_version()}, jax {jax.__version__}, brainpy {bp.__version__}; "
    f"{time.time() - started:.0f} s in all; load average {load} at the start, {_load()} at the end. Inputs and targets are random: this measures steps, not learning.\n\n"
    f"- Memory: XLA's compile-time analysis of the train step (arguments + outputs + temporaries - aliases, as "
    f"the memory planner counts it; Adam), compiled ahead of time after `model.reset(batch)`: deterministic.\n"
    f"- Step time: every trainer lives in this one process; in each of {rounds} rounds every trainer runs one "
    f"train step (the order rotates from round to round), each divided by the same round's bp.BPTT step; the "
    f"table gives the median and quartiles of these {rounds} ratios.\n"
    f"- Gradient: every trainer's first step starts from the same initial parameters (one model shared by all "
    f"trainers, parameters restored before each first step) on the same batch; its gradient is read from Adam's "
    f"first moment (`(1 - beta1) * gradient` after one update) and compared with bp.BPTT's over all parameters. "
    f"Loss: the value the step reports.")
  os.makedirs(args.out, exist_ok=True)
  page = markdown(measured, header)
  with open(os.path.join(args.out, 'whole_batch_loss_benchmark.md'), 'w') as f:
    f.write(page + '\n')
  print(page)
  return measured


if __name__ == '__main__':
  main()
