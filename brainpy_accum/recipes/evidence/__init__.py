"""``python -m brainpy_accum.recipes.evidence``: e-prop's evidence-accumulation task, trained with ``AccumBPTT``.

The task of Bellec et al. (Nature Communications 2020), as BrainPy's paper trains it (``figure4A.py``): 7 cues of
40 Hz spikes on the 25 "left" or "right" input channels, a delay of 1 s and a recall cue, 2,200 steps of 1 ms; the
label is the side with more cues (``brainpy_datasets.cognitive.EvidenceAccumulation``). The network and the loss
are e-prop's (:class:`EvidenceSNN`, :func:`recall_loss`, :data:`RECIPE`); its batch-wide firing-rate regulariser
couples the samples: its mean is a batch statistic (:func:`~brainpy_accum.batch_mean`), which ``AccumBPTT``'s
micro-batches see whole (``--coupled whole-batch``: ``whole_batch_loss=True`` instead, which keeps the whole batch's
outputs); ``--trainer bptt``: ``bp.BPTT``.

Batch ``u`` is drawn from ``(seed, u)`` alone, so a run cut into calls trains on a straight run's batches: each
epoch (``--eval-every`` updates) is one ``fit(..., checkpoint=PATH)`` call (``--checkpoint``; the curve is kept in
``PATH.run.json``), and ``--seconds`` starts no epoch that would pass a job's time limit. A run records the
held-out accuracy against updates and wall time, and XLA's compile-time memory analysis of ``bp.BPTT``'s step at
its size (or the device's refusal) against ``AccumBPTT``'s plan; ``--out`` keeps the runs in a JSON list.
``docs/evidence.md`` gives the recipe's sources and the results.
"""

import argparse
import contextlib
import functools
import json
import os
import platform
import re
import sys
import time
import types
from typing import Callable, Dict, NamedTuple, Optional, Sequence

import brainpy as bp
import brainpy.math as bm
import jax
import numpy as np

from ...checkpoint import load as load_checkpoint
from ...checkpoint import save as save_checkpoint
from ...memory import compiled_step_bytes, format_memory, parse_memory
from ...memory._device import device_memory, is_refused_program, refused_bytes
from ...trainer import AccumBPTT
from ._network import DT, RECIPE, EvidenceSNN, Recipe, RefractoryALIF, recall_loss
from ._task import (CHANNELS, FEATURES, FEATURES_IN, HELD_OUT_STREAM, PAPER_PERIODS, Periods, TrainingBatches, Trials,
                    draw_trials, load_task)

__all__ = ['Periods', 'PAPER_PERIODS', 'Recipe', 'RECIPE', 'RefractoryALIF', 'EvidenceSNN', 'recall_loss', 'Trials',
           'FEATURES', 'CHANNELS', 'load_task', 'draw_trials', 'TrainingBatches', 'Config', 'build_model',
           'make_trainer', 'held_out_runner', 'evaluate', 'bptt_step_memory', 'Run', 'train', 'example_trial',
           'seconds_per_update', 'first_reaching', 'seconds_to', 'lowest_after', 'largest_bptt_batch', 'format_table',
           'main']


COUPLED = ('statistics', 'whole-batch')


class Config(NamedTuple):
  """One run's settings: a call that resumes a ``--checkpoint`` must give the same, but ``updates``."""
  trainer: str = 'accum'        # 'accum' (AccumBPTT) or 'bptt' (bp.BPTT)
  neurons: int = 100
  batch: int = 128
  periods: Periods = PAPER_PERIODS
  updates: int = 400
  eval_every: int = 25          # updates per epoch: the curve's points
  lr: Optional[float] = None    # Adam's learning rate; None: RECIPE.lr_at(neurons), e-prop's scaled by its width
  seed: int = 0
  test_trials: int = 1000
  budget: Optional[int] = None  # AccumBPTT's memory_budget in bytes (needed on a CPU)
  lr_half_life: Optional[int] = None  # updates over which Adam's learning rate halves (None: constant, as e-prop)
  stop_at: Optional[float] = None  # end the run at the first held-out accuracy at least this (e-prop: 0.93)
  past: int = 0                 # with stop_at: updates trained on after the first evaluation at least stop_at
  coupled: str = 'statistics'   # AccumBPTT's exact coupled loss: the rate a batch statistic ('statistics'), or
  #                               whole_batch_loss=True ('whole-batch')

  @property
  def learning_rate(self) -> float:
    """``lr``, or where it is ``None`` the recipe's rule for this width (:meth:`Recipe.lr_at`)."""
    return RECIPE.lr_at(self.neurons) if self.lr is None else self.lr


def build_model(config: Config) -> EvidenceSNN:
  """The network of ``config.neurons``, its weights drawn from ``config.seed``, in training mode."""
  bm.random.seed(config.seed)
  with bm.training_environment():
    return EvidenceSNN(num_rec=config.neurons)


def make_trainer(config: Config, model: EvidenceSNN) -> bp.BPTT:
  """``AccumBPTT(num_micro_batch='auto')`` (with ``whole_batch_loss=True`` for ``coupled='whole-batch'``) or,
  for ``trainer='bptt'``, ``bp.BPTT``."""
  loss = functools.partial(recall_loss, window=config.periods.recall)
  lr = config.learning_rate
  lr = lr if config.lr_half_life is None else bp.optim.ExponentialDecayLR(lr, config.lr_half_life, 0.5)
  common = dict(optimizer=bp.optim.Adam(lr=lr), loss_has_aux=True, monitors={'spike': model.alif.spike},
                progress_bar=False, dt=DT)
  if config.trainer == 'bptt':
    return bp.BPTT(model, loss, **common)
  budget = {} if config.budget is None else {'memory_budget': config.budget}
  return AccumBPTT(model, loss, num_micro_batch='auto', whole_batch_loss=config.coupled == 'whole-batch', **budget,
                   **common)


def held_out_runner(model: EvidenceSNN) -> bp.DSRunner:
  """A runner of ``model`` that records each step's spike count, not every spike (900 MB per 100 trials of 1,024)."""
  return bp.DSRunner(model, monitors={'count': functools.partial(_spike_count, model)}, data_first_axis='B', dt=DT,
                     progress_bar=False, numpy_mon_after_run=True)


def _spike_count(model: EvidenceSNN):
  return bm.sum(model.alif.spike.value, axis=-1)


def evaluate(runner: bp.DSRunner, held_out: Trials, window: int, chunk: int = 100) -> Dict[str, float]:
  """Accuracy (the read-out averaged over the last ``window`` steps) and mean firing rate on ``held_out``,
  ``chunk`` trials at a time, with :func:`held_out_runner`'s runner."""
  correct, spikes = 0, 0.
  for start in range(0, len(held_out.labels), chunk):
    out = np.asarray(runner.predict(inputs=held_out.inputs[start:start + chunk], reset_state=True))
    correct += int(np.sum(out[:, -window:].mean(axis=1).argmax(axis=-1) == held_out.labels[start:start + chunk]))
    spikes += float(np.asarray(runner.mon['count']).sum())
  n, steps = held_out.inputs.shape[:2]
  return {'test_accuracy': correct / n, 'test_rate_hz': spikes / (n * steps * runner.target.alif.num) * 1000. / DT}


def bptt_step_memory(config: Config, sample: Trials, log: Callable = print) -> dict:
  """XLA's compile-time memory analysis of ``bp.BPTT``'s train step on a batch like ``sample`` (nothing runs),
  or, where the device refuses to compile it (``RESOURCE_EXHAUSTED``), the size its message names; logged."""
  model = build_model(config)
  trainer = make_trainer(config._replace(trainer='bptt'), model)
  model.reset(len(sample.labels))
  try:
    compiled = trainer.f_train.compile(bp.tools.DotDict(fit=True), sample.inputs, sample.labels)
  except Exception as error:  # noqa: BLE001 -- only the device's refusal is a measurement; others re-raised
    if not is_refused_program(error):
      raise
    limit = device_memory()
    found = {'bytes': refused_bytes(error, 1 + (limit.limit if limit else 0)), 'refused': True,
             'error': str(error).splitlines()[0][:400]}
  else:
    found = {'bytes': compiled_step_bytes(compiled), 'refused': False, 'error': None}
  log(f"bp.BPTT's train step at batch {len(sample.labels)}, {config.neurons} neurons, {config.periods.steps} steps "
      f"{'refused by the device: it needs' if found['refused'] else 'needs'} {format_memory(found['bytes'])} (XLA's "
      "compile-time analysis)", flush=True)
  return found


def largest_bptt_batch(config: Config, log: Callable = print, multiple: int = 32,
                       measured: Optional[dict] = None) -> dict:
  """The largest batch, a multiple of ``multiple``, whose ``bp.BPTT`` train step fits the device's memory (or
  ``config.budget``) by XLA's own compilation, searched from ``config.batch``: the batches on either side are
  bracketed by doubling or halving, then narrowed by the line through their sizes. Each probe compiles the step of
  a batch of zeros (nothing runs); a step the device refuses to compile does not fit, whatever size it names.

  Returns ``{'batch', 'bytes', 'refused_batch', 'refused_bytes', 'limit', 'multiple', 'probes'}``: ``batch`` is
  ``None`` where even ``multiple`` trials do not fit; ``probes`` lists every batch compiled, with its figures.
  ``measured``: figures already known (``{batch: bptt_step_memory(...)}``), not compiled again.
  """
  memory = device_memory()
  limit = config.budget if config.budget is not None else (None if memory is None else memory.limit)
  if limit is None:
    raise ValueError('largest_bptt_batch needs a memory limit: this device reports none (a CPU); give '
                     'config.budget (--budget on the command line), e.g. 2GiB.')
  probes = dict(measured or {})

  def fits(batch: int) -> bool:
    if batch in probes:
      return not probes[batch]['refused'] and probes[batch]['bytes'] <= limit
    zeros = Trials(np.zeros((batch, config.periods.steps, FEATURES_IN), np.float32), np.zeros(batch, np.int32))
    probes[batch] = bptt_step_memory(config._replace(batch=batch), zeros, log)
    return not probes[batch]['refused'] and probes[batch]['bytes'] <= limit

  batch = max(multiple, config.batch // multiple * multiple)
  if fits(batch):  # bracket: lo fits (0: nothing does), hi does not
    lo = batch
    while fits(2 * lo):
      lo *= 2
    hi = 2 * lo
  else:
    hi = batch
    while hi > multiple and not fits(max(multiple, hi // 2 // multiple * multiple)):
      hi = max(multiple, hi // 2 // multiple * multiple)
    lo = 0 if hi == multiple else max(multiple, hi // 2 // multiple * multiple)
  while lo and hi - lo > multiple:  # the batch where the line through the two sizes meets the limit
    line = lo + (limit - probes[lo]['bytes']) * (hi - lo) / max(1, probes[hi]['bytes'] - probes[lo]['bytes'])
    batch = min(max(int(line) // multiple * multiple, lo + multiple), hi - multiple)
    if fits(batch):
      lo = batch
    else:
      hi = batch
  found = {'batch': lo or None, 'bytes': probes[lo]['bytes'] if lo else None, 'refused_batch': hi,
           'refused_bytes': probes[hi]['bytes'], 'limit': limit, 'multiple': multiple,
           'probes': [dict(probes[b], batch=b) for b in sorted(probes)]}
  log(f"bp.BPTT's largest batch that fits {format_memory(limit)}: {found['batch']} (a multiple of {multiple}; "
      f"{hi} does not), from {len(probes) - len(measured or {})} compilations", flush=True)
  return found


class Run:
  """One run's record: its settings, curve, calls and memory figures, kept beside the checkpoint
  (``PATH.run.json``) so that a later call continues it, and written into ``--out``."""

  def __init__(self, name: str, config: Config, checkpoint: Optional[str]):
    self.name, self.config, self.checkpoint = name, config, checkpoint
    self.path = None if checkpoint is None else checkpoint + '.run.json'
    asked = dict(config._asdict(), lr=config.learning_rate, periods=config.periods._asdict(),
                 steps=config.periods.steps)
    self.record = {'name': name, 'config': asked, 'curve': [], 'calls': [], 'memory': {}, 'finished': False}
    if checkpoint is None or not os.path.exists(checkpoint):
      return
    if not os.path.exists(self.path):
      raise ValueError(f'--checkpoint {checkpoint} exists, but not its record {self.path}: the curve of the '
                       f'updates it holds is lost. Remove the checkpoint to start afresh, or name another.')
    with open(self.path) as f:
      saved = json.load(f)
    saved_config = dict(Config()._asdict(), **saved['config'])  # (records older than a setting lack it)
    differ = {k: (saved_config.get(k), v) for k, v in asked.items() if k != 'updates' and saved_config.get(k) != v}
    if differ:
      raise ValueError(f'--checkpoint {checkpoint} holds a run with other settings: '
                       + ', '.join(f'{k} {a!r} there, {b!r} asked' for k, (a, b) in differ.items())
                       + '. Pass the same options (only --updates may grow), or another --checkpoint.')
    self.record = dict(saved, config=asked)

  @property
  def epochs_done(self) -> int:
    return max(0, len(self.record['curve']) - 1)  # the curve's first point: before any update

  @property
  def finished(self) -> bool:
    """All updates trained, or (``stop_at``) ``past`` updates trained since the held-out accuracy first reached
    ``stop_at``."""
    done = min(self.epochs_done * self.config.eval_every, self.config.updates)
    reached = None if self.config.stop_at is None else first_reaching(self.record, self.config.stop_at)
    return done >= self.config.updates or (reached is not None and done >= reached + self.config.past)

  def save(self, out: Optional[str]) -> None:
    if self.path:
      _write_json(self.path, self.record)
    if out:
      with (open(out) if os.path.exists(out) else contextlib.nullcontext(None)) as f:
        runs = [] if f is None else [r for r in json.load(f) if r.get('name') != self.name]
      _write_json(out, runs + [self.record])


def _write_json(path: str, value) -> None:
  """``value`` as indented JSON, but each list of numbers on one line (the example's spikes), atomically."""
  text = re.sub(r'\[\s+([-+.,\deE\s]+?)\s+\]', lambda m: '[' + ' '.join(m.group(1).split()) + ']',
                json.dumps(value, indent=1))
  with open(path + '.tmp', 'w') as f:
    f.write(text + '\n')
  os.replace(path + '.tmp', path)


def _bptt_step_measured(out: Optional[str], record: dict) -> Optional[dict]:
  """``bp.BPTT``'s step figure of a run in ``out`` of the same network, batch and trial on the same device."""
  if not out or not os.path.exists(out):
    return None
  with open(out) as f:
    runs = json.load(f)
  same = ('neurons', 'batch', 'periods')
  for other in runs:
    if (other.get('device', {}).get('kind') == record['device']['kind']
        and other.get('device', {}).get('platform') == record['device']['platform']
        and all(other['config'].get(k) == record['config'][k] for k in same)
        and 'bptt_step' in other.get('memory', {})):
      return dict(other['memory']['bptt_step'], measured_in=other['name'])
  return None


def _bptt_checkpoint(trainer: bp.BPTT) -> types.SimpleNamespace:
  """What the package's checkpoint file holds of a trainer, for ``bp.BPTT`` (which has no counters)."""
  return types.SimpleNamespace(target=trainer.target, optimizer=trainer.optimizer,
                               skipped_steps=bm.Variable(bm.zeros((), dtype=bm.int32)))


def _drawing_threads() -> int:
  """Threads drawing batches ahead: half the host's cores, 2 to 8 (a batch of 512 trials takes about a second of
  one core, about what the scaled network's update takes on a TPU v5e)."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 2)
  return min(8, max(2, cores // 2))


def _machine() -> dict:
  device, limit = jax.devices()[0], device_memory()
  return {'platform': device.platform, 'kind': getattr(device, 'device_kind', ''),
          'memory_limit': None if limit is None else limit.limit,
          'host_cores': len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(),
          'xla_flags': os.environ.get('XLA_FLAGS', '')}


def train(config: Config, *, name: str, checkpoint: Optional[str] = None, seconds: Optional[float] = None,
          out: Optional[str] = None, log: Callable = print, started: Optional[float] = None,
          largest_bptt: bool = False) -> dict:
  """Train (or continue) one run; returns its record (``Run.record``), also written to ``out``.

  After each epoch (``config.eval_every`` updates) the held-out accuracy is measured and the record written; no
  epoch starts that would end ``seconds`` after ``started`` (by the last one's duration), but a call trains one
  at least. ``config.updates == 0``: the memory figures alone; a finished run: its example made again.
  ``bp.BPTT``'s step at the run's size is compiled once per run, and not at all where ``out`` holds its figure
  from a run of the same size on the same device. ``largest_bptt``: also :func:`largest_bptt_batch` (its
  compilations take a minute or more at the scaled size).
  """
  started = time.perf_counter() if started is None else started
  run = Run(name, config, checkpoint)
  task = load_task(config.periods)
  batches = TrainingBatches(task, config.batch, config.seed, config.eval_every, config.updates,
                            ahead=_drawing_threads())
  run.record.update(device=_machine(), versions={'python': platform.python_version(), 'jax': jax.__version__,
                                                   'brainpy': bp.__version__})
  if 'bptt_step' not in run.record['memory']:  # once per run: at a large size its compilation takes a while
    run.record['memory']['bptt_step'] = (_bptt_step_measured(out, run.record)
                                         or bptt_step_memory(config, batches.batch_of(0), log))
  if largest_bptt and 'bptt_largest' not in run.record['memory']:
    run.record['memory']['bptt_largest'] = largest_bptt_batch(
      config, log, measured={config.batch: run.record['memory']['bptt_step']})
  if config.trainer == 'bptt' and config.updates and run.record['memory']['bptt_step']['refused']:  # before a fit
    raise ValueError(f"bp.BPTT's step at batch {config.batch} does not fit this device: pass a smaller --batch.")
  trainer = make_trainer(config, build_model(config))
  if config.updates == 0:
    run.record['finished'] = True  # (nothing to train: the memory figures alone)
    if isinstance(trainer, AccumBPTT):
      trainer.plan_memory(*batches.batch_of(0))
  elif run.epochs_done and isinstance(trainer, AccumBPTT):  # (its fit loads it too, but evaluates nothing before)
    trainer.load_checkpoint(checkpoint)
  elif run.epochs_done:
    load_checkpoint(_bptt_checkpoint(trainer), checkpoint, None)
  if config.updates:
    held_out = draw_trials(task, (config.seed, HELD_OUT_STREAM), config.test_trials)
    _train_epochs(run, trainer, batches, held_out, out, log, started, seconds)
    run.record['finished'] = run.finished
    example = example_trial(trainer, held_out, config.periods.recall)
    run.record['example'] = dict(example, updates=run.record['curve'][-1]['updates'])
  _record_memory(run, trainer)
  run.save(out)
  return run.record


def _train_epochs(run: Run, trainer: bp.BPTT, batches: TrainingBatches, held_out: Trials, out: Optional[str],
                  log: Callable, started: float, seconds: Optional[float]) -> None:
  """The epochs of one call: each trained, evaluated and recorded, until the run is finished or ``seconds``."""
  runner = held_out_runner(trainer.target)
  if not run.record['curve']:
    _evaluate_point(run, trainer, runner, held_out, 0, log)
  done = min(run.epochs_done * run.config.eval_every, run.config.updates)
  call = {'updates_before': done, 'updates_after': done, 'fit_seconds': 0., 'eval_seconds': 0.,
          'device': run.record['device']['kind'] or run.record['device']['platform']}
  if not run.finished:
    run.record['calls'].append(call)
  last = None
  while not run.finished:
    elapsed = time.perf_counter() - started
    if seconds is not None and last is not None and elapsed + last > seconds:
      log(f'stopping after {elapsed:.0f} s: another epoch (about {last:.0f} s) would pass --seconds {seconds:g}')
      return
    epoch_start = time.perf_counter()
    fit_seconds = _fit_epoch(trainer, batches, run.epochs_done, run.checkpoint)
    updates = min((run.epochs_done + 1) * run.config.eval_every, run.config.updates)
    point = _evaluate_point(run, trainer, runner, held_out, updates, log, fit_seconds)
    call.update(updates_after=updates, fit_seconds=call['fit_seconds'] + fit_seconds,
                eval_seconds=call['eval_seconds'] + point['eval_seconds'])
    _record_memory(run, trainer)
    run.save(out)
    last = time.perf_counter() - epoch_start


def example_trial(trainer: bp.BPTT, held_out: Trials, window: int, per_population: int = 50, every: int = 5) -> dict:
  """The first held-out trial, for figures: its input spikes, those of the first ``per_population`` LIF and ALIF
  neurons, the read-out's probability of label 1 every ``every`` steps, the label and the answer."""
  out = np.asarray(trainer.predict(held_out.inputs[:1], reset_state=True))[0]
  spikes = np.asarray(trainer.mon['spike'])[0]
  n_regular = spikes.shape[1] - round(spikes.shape[1] * RECIPE.adaptive_fraction)
  shown = np.r_[0:min(per_population, n_regular), n_regular:min(n_regular + per_population, spikes.shape[1])]
  steps, rows = np.nonzero(spikes[:, shown])
  input_steps, channels = np.nonzero(held_out.inputs[0])
  probability = 1. / (1. + np.exp(out[:, 0] - out[:, 1]))  # the read-out's softmax, of label 1
  return {'label': int(held_out.labels[0]), 'prediction': int(out[-window:].mean(axis=0).argmax()),
          'input_steps': input_steps.tolist(), 'input_channels': channels.tolist(), 'neurons': shown.tolist(),
          'lif_shown': int(np.sum(shown < n_regular)), 'spike_steps': steps.tolist(), 'spike_rows': rows.tolist(),
          'probability_every': every, 'probability_1': np.round(probability[::every], 3).tolist()}


def _fit_epoch(trainer: bp.BPTT, batches: TrainingBatches, epoch: int, checkpoint: Optional[str]) -> float:
  """Train epoch ``epoch``; the seconds it took (planning and compilations included)."""
  batches.epoch = epoch
  start = time.perf_counter()
  if isinstance(trainer, AccumBPTT) and checkpoint:  # the epochs before are in the checkpoint: fit skips them
    trainer.fit(batches, num_epoch=epoch + 1, checkpoint=checkpoint)
  else:
    trainer.fit(batches, num_epoch=1)
    if checkpoint:  # bp.BPTT: its parameters and optimizer state, in the package's checkpoint file
      save_checkpoint(_bptt_checkpoint(trainer), checkpoint, None)
  return time.perf_counter() - start


def _evaluate_point(run: Run, trainer: bp.BPTT, runner: bp.DSRunner, held_out: Trials, updates: int, log: Callable,
                    fit_seconds: float = 0.) -> dict:
  start = time.perf_counter()
  point = evaluate(runner, held_out, run.config.periods.recall)
  point['eval_seconds'] = time.perf_counter() - start
  curve = run.record['curve']
  point.update(updates=updates, fit_seconds=fit_seconds, seconds=(curve[-1]['seconds'] if curve else 0.) + fit_seconds)
  if updates:  # the epoch's training metrics (means over its updates)
    point['train_loss'] = float(np.asarray(trainer.train_losses)[-1])
    for key in ('acc', 'ce', 'reg', 'rate_hz'):
      point[f'train_{key}'] = float(np.asarray(trainer.get_hist_metric('fit', key))[-1])
  curve.append(point)
  log(f"{run.name}: update {updates}, {point['seconds']:.0f} s of training: held-out accuracy "
      f"{point['test_accuracy']:.3f}, rate {point['test_rate_hz']:.1f} Hz", flush=True)
  return point


def _record_memory(run: Run, trainer: bp.BPTT) -> None:
  """The budget, and ``AccumBPTT``'s plan of the run's batch: its step's memory by XLA's analysis, and where the
  batch is streamed from the host, the piece (or chunk) whose step that is."""
  run.record['memory']['budget'] = run.config.budget
  if not isinstance(trainer, AccumBPTT):
    return
  streamed = trainer.stream_chunks.get(run.config.batch)
  planned = trainer.memory_plans.get(run.config.batch if streamed is None else streamed)
  if planned is None:
    return
  plan, step_bytes = planned
  text = f'{plan.num_micro_batches} micro-batch{"es" if plan.num_micro_batches > 1 else ""} ({plan.describe_cuts()})'
  if streamed is not None:  # (in pieces by choice, a host batch sent ahead; in chunks where its data does not fit)
    text = f"streamed in {'pieces' if run.config.batch in trainer.planner.piece_sizes else 'chunks'} of {streamed}, " \
           f'each {text}'
  run.record['memory']['plan'] = {'num_micro_batches': plan.num_micro_batches, 'step_bytes': step_bytes,
                                  'micro_batch_size': plan.micro_batch_size, 'streamed': streamed, 'text': text}


def seconds_per_update(record: dict) -> Optional[float]:
  """The median seconds of an update over the epochs that compiled nothing (not a call's first), or ``None``."""
  curve, first_of_call = record['curve'], {call['updates_before'] for call in record['calls']}
  per_update = [point['fit_seconds'] / (point['updates'] - before['updates'])
                for before, point in zip(curve, curve[1:]) if before['updates'] not in first_of_call]
  return float(np.median(per_update)) if per_update else None


def first_reaching(record: dict, accuracy: float) -> Optional[int]:
  """The updates after which the held-out accuracy first reached ``accuracy``, or ``None``."""
  return next((point['updates'] for point in record['curve'] if point['test_accuracy'] >= accuracy), None)


def seconds_to(record: dict, accuracy: float) -> Optional[float]:
  """Seconds of training (fits, compilations included; evaluations not) until the held-out accuracy first reached
  ``accuracy``, or ``None``."""
  return next((point['seconds'] for point in record['curve'] if point['test_accuracy'] >= accuracy), None)


def lowest_after(record: dict, accuracy: float) -> Optional[float]:
  """The lowest held-out accuracy at the evaluations after the first at least ``accuracy`` (``None``: none)."""
  reached = first_reaching(record, accuracy)
  after = [p['test_accuracy'] for p in record['curve'] if reached is not None and p['updates'] > reached]
  return min(after) if after else None


def format_table(records: Sequence[dict]) -> str:
  """A Markdown table of the runs: held-out accuracy (first >= 0.93, 0.95, the seconds to 0.95, the lowest after
  it; best, last), time and memory."""
  lines = ['| run | device | updates | first >= 0.93 | first >= 0.95 | s to 0.95 | lowest after | best | last '
           '| s / update | bp.BPTT step | AccumBPTT plan | its step | budget or limit |', '|' + '---|' * 14]
  for r in records:
    curve, bptt, plan = r['curve'], r['memory'].get('bptt_step'), r['memory'].get('plan')
    limit, per_update = r['memory'].get('budget') or r['device']['memory_limit'], seconds_per_update(r)
    to_target, lowest = seconds_to(r, 0.95), lowest_after(r, 0.95)
    cells = [r['name'], r['device']['kind'] or r['device']['platform'], curve[-1]['updates'] if curve else 0,
             first_reaching(r, 0.93), first_reaching(r, 0.95), None if to_target is None else f'{to_target:.0f}',
             None if lowest is None else f'{lowest:.3f}',
             f"{max(p['test_accuracy'] for p in curve):.3f}" if curve else None,
             f"{curve[-1]['test_accuracy']:.3f}" if curve else None, f'{per_update:.2f}' if per_update else None,
             (format_memory(bptt['bytes']) + (' (refused)' if bptt['refused'] else '')) if bptt else None,
             plan['text'] if plan else None, format_memory(plan['step_bytes']) if plan else None,
             format_memory(limit) if limit else None]
    lines.append('| ' + ' | '.join('-' if c is None else str(c) for c in cells) + ' |')
  return '\n'.join(lines)


def _int_at_least(minimum: int, text: str) -> int:
  value = int(text)
  if value < minimum:
    raise argparse.ArgumentTypeError(f'{value} must be an integer of at least {minimum}.')
  return value


_POSITIVE, _NON_NEGATIVE = functools.partial(_int_at_least, 1), functools.partial(_int_at_least, 0)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.recipes.evidence', description=__doc__.split('\n')[0])
  parser.add_argument('--trainer', choices=('accum', 'bptt'), default='accum',
                      help="'accum': AccumBPTT(num_micro_batch='auto'); 'bptt': bp.BPTT")
  parser.add_argument('--coupled', choices=COUPLED, default='statistics',
                      help="how AccumBPTT trains the batch-wide rate exactly: 'statistics' (a batch statistic, "
                           "brainpy_accum.batch_mean; default) or 'whole-batch' (whole_batch_loss=True)")
  parser.add_argument('--neurons', type=_POSITIVE, default=100, help='recurrent neurons (default 100)')
  parser.add_argument('--batch', type=_POSITIVE, default=128, help='trials per update (default 128)')
  parser.add_argument('--periods', type=_POSITIVE, nargs=4, default=list(PAPER_PERIODS),
                      metavar=('INTERVAL', 'CUE', 'DELAY', 'RECALL'),
                      help='ms before each cue, of each cue, of the delay, of the recall (default 50 100 1000 150)')
  parser.add_argument('--updates', type=_NON_NEGATIVE, default=400,
                      help='optimizer updates of the whole run (default 400; 0: the memory figures alone)')
  parser.add_argument('--eval-every', type=_POSITIVE, default=25, help='updates between held-out evaluations')
  parser.add_argument('--lr', type=float, default=None,
                      help=f"Adam's learning rate (default: e-prop's {RECIPE.lr} at {RECIPE.lr_width} neurons, times "
                           f"{RECIPE.lr_width} / --neurons: {RECIPE.lr_at(1024):.3g} at 1024)")
  parser.add_argument('--lr-half-life', type=_POSITIVE, default=None,
                      help="updates over which the learning rate halves, continuously (default: constant, as e-prop)")
  parser.add_argument('--stop-at', type=float, default=None, metavar='ACCURACY',
                      help="end the run once the held-out accuracy reaches this (e-prop's early stop: 0.93)")
  parser.add_argument('--past', type=_NON_NEGATIVE, default=0, metavar='UPDATES',
                      help='with --stop-at: train this many updates more after its first evaluation at or above it')
  parser.add_argument('--largest-bptt-batch', action='store_true',
                      help="also find bp.BPTT's largest batch (a multiple of 32) whose step this device compiles "
                           "(with --budget on a CPU); a minute or more of compilations at the scaled size")
  parser.add_argument('--seed', type=_NON_NEGATIVE, default=0)
  parser.add_argument('--test-trials', type=_POSITIVE, default=None, help='held-out trials (default 1000; --quick 200)')
  parser.add_argument('--quick', action='store_true', help='200 held-out trials (unless --test-trials says)')
  parser.add_argument('--budget', default=None,
                      help="AccumBPTT's memory_budget, e.g. 2GiB (needed on a CPU; default: the device's own)")
  parser.add_argument('--checkpoint', default=None, help='resume from / write to this file (and PATH.run.json)')
  parser.add_argument('--seconds', type=float, default=None, help='stop at an epoch boundary within about S s')
  parser.add_argument('--name', default=None, help='the run\'s name in --out (default: from the settings)')
  parser.add_argument('--out', default=None, help='a JSON list of runs: this run is added or replaced by name')
  return parser


def main(argv: Optional[Sequence[str]] = None) -> dict:
  started = time.perf_counter()
  parser = _parser()
  args = parser.parse_args([str(a) for a in (sys.argv[1:] if argv is None else argv)])
  if args.trainer == 'accum' and args.budget is None and device_memory() is None:
    parser.error('--budget is needed on a CPU, which reports no memory limit (e.g. --budget 2GiB).')
  if args.past and args.stop_at is None:
    parser.error('--past counts updates after --stop-at is reached: give --stop-at too (e.g. --stop-at 0.95).')
  if args.lr is not None and not args.lr > 0:
    parser.error(f'--lr {args.lr}: the learning rate must be a positive number.')
  if args.largest_bptt_batch and args.budget is None and device_memory() is None:
    parser.error('--largest-bptt-batch needs --budget on a CPU, which reports no memory limit (e.g. --budget 2GiB).')
  periods = Periods(*args.periods)
  config = Config(trainer=args.trainer, neurons=args.neurons, batch=args.batch, periods=periods,
                  updates=args.updates, eval_every=args.eval_every, lr=args.lr, lr_half_life=args.lr_half_life,
                  stop_at=args.stop_at, past=args.past, seed=args.seed, coupled=args.coupled,
                  test_trials=args.test_trials or (200 if args.quick else 1000),
                  budget=None if args.budget is None else parse_memory(args.budget))
  name = args.name or (f"{'AccumBPTT' if args.trainer == 'accum' else 'bp.BPTT'} {args.neurons} neurons, "
                       f'batch {args.batch}, {periods.steps} steps, seed {args.seed}'
                       + ('' if args.lr is None else f', lr {args.lr:g}')
                       + ('' if args.lr_half_life is None else f', lr half-life {args.lr_half_life}')
                       + (', whole_batch_loss' if args.trainer == 'accum' and args.coupled == 'whole-batch' else ''))
  record = train(config, name=name, checkpoint=args.checkpoint, seconds=args.seconds, out=args.out, started=started,
                 largest_bptt=args.largest_bptt_batch)
  print(format_table([record]), 'finished' if record['finished'] else 'not finished: run it again to go on', sep='\n')
  return record


if __name__ == '__main__':
  main()
