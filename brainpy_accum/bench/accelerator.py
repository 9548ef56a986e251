"""``python -m brainpy_accum.bench --parts device``: training on a GPU or TPU, batch size by batch size.

For the spiking network and the rate RNN of :mod:`.workloads` (cross-entropy of the last step's read-out, Adam;
on an accelerator T=500, 1024 hidden, 128 inputs, batches 256 to 16,384), at each batch size:

- ``bp.BPTT``: whether its step fits the device (a compilation that XLA refuses for memory,
  ``RESOURCE_EXHAUSTED``, is recorded as "does not fit", as is one that runs out at run time), its bytes;
- ``AccumBPTT(num_micro_batch='auto')``: on an accelerator with no ``memory_budget`` (the device's own memory),
  on a CPU, which has no limit, with a stated one; its plan and the planner's bytes (XLA's analysis);
- plain JAX + optax cut in as many micro-batches as AccumBPTT's plan (the nearest number that divides the batch),
  the same network with its read-out at every step;
- for each, the time to the first epoch (a fresh trainer, cold caches: compilations, planning, first epoch; the
  process first builds a throwaway model of the workload and resets it at the batch size, so that the small
  programs of the model's construction and state, which the trainers share, are compiled before either is
  timed, and neither trainer's first epoch holds them for the other) and
  samples/s over an epoch of ``E`` batches through ``fit``: NumPy batches from the host (what a user passes)
  sent to the device while the step before runs (what ``fit`` does on an accelerator), the same handed to each
  step (what it does on a CPU, and bp.BPTT everywhere), and the same batches already on the device (no copy:
  the step's own speed);
- the achieved FLOP/s against the chip's peak (measured with a large matmul, and the vendor's figure where known).
  FLOPs are counted from the matmuls: ``6 B T (I H + H H + H O)`` a step (forward ``2 B T (...)``, the backward
  pass twice that); XLA's cost analysis is recorded as well, but it counts a loop body once, whatever its trip
  count, so it undercounts a scanned network by about the number of time steps.

Trainers alternate within each round (order reversed every other round) and samples/s are medians of rounds;
ratios between trainers are medians of per-round ratios (:mod:`.measure`). NumPy batches and device batches are
timed in the same rounds where three batches take at most a tenth of the device's memory (on a CPU always), else
in two phases (the device batch made only for the second), so that the device holds one of them at a time. An
epoch is the same batch ``E`` times (distinct batches would take ``E`` times the host memory, and more
than the chip's at 16,384); each is copied to the device anew.

Writes ``accelerator.json`` (the runs of every device measured so far, by device) and, with
:mod:`.report`, ``accelerator.md`` and ``accelerator.png`` (samples/s and bytes against the batch size)
into ``--out``.
"""

import argparse
import contextlib
import datetime
import functools
import gc
import io
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import brainpy as bp
import brainstate
import jax
import jax.numpy as jnp
import optax

from ..diagnostics._phases import record_phases
from ..memory import compiled_step_bytes, parse_memory
from ..trainer import AccumBPTT
from ..trainer._feed import overlapping, prefetch_bytes
from .report import AHEAD, DEVICE, WITH_STEP, device_report, plot_device
from .measure import time_in_rounds
from .streaming import measure_host_copy
from .measure import FIT, LEARNING_RATE, Step, loss_of, plain_jax_step
from .workloads import Shape, jax_params, make_batch, make_brainpy_model

__all__ = ['ACCELERATOR', 'CPU', 'QUICK', 'measure_device', 'measure_batch', 'measure_peak', 'model_flops',
           'memory_refusal', 'stored_refusals', 'main']

ACCELERATOR = dict(shape=Shape(batch=0, time=500, hidden=1024, inputs=128), workloads=('snn_ce',),
                   batches=(2048, 4096, 8192, 16384, 32768, 65536), epoch=16, rounds=2, budget=None)
CPU = dict(shape=Shape(batch=0, time=50, hidden=128, inputs=64), batches=(64, 256, 1024), epoch=4, rounds=7,
           budget='32MiB', workloads=('snn_ce', 'rnn_ce'))
QUICK = dict(shape=Shape(batch=0, time=6, hidden=8, inputs=4), batches=(8, 16), epoch=2, rounds=1, budget='40KiB',
             peak_size=256, workloads=('snn_ce', 'rnn_ce'))
BPTT_SKIPPED = 'not tried: a smaller batch did not fit'
DEVICE_SHARE = 0.3  # device batches are timed where one takes at most this share of the device's memory
WORKLOADS = ('snn_ce', 'rnn_ce')
TRAINERS = ('bp.BPTT', 'AccumBPTT', 'plain JAX + optax')


def model_flops(shape: Shape, batch: int) -> float:
  """FLOPs of one train step of either network, from its matmuls: the input, recurrent and read-out products of
  every time step, forward (``2 B I H`` each) and backward (twice the forward); elementwise work is left out.

  Examples
  --------
  >>> model_flops(Shape(batch=0, time=500, hidden=1024, inputs=128), 2048) / 1e12  # doctest: +ELLIPSIS
  7.3...
  """
  per_step = shape.inputs * shape.hidden + shape.hidden * shape.hidden + shape.hidden * shape.outputs
  return 6. * batch * shape.time * per_step


def memory_refusal(error: BaseException) -> Optional[str]:
  """What XLA said if ``error`` says the step does not fit the device's memory (at compile time, as TPUs and
  GPUs refuse a program whose temporaries exceed the memory, or at run time), else ``None``.

  Examples
  --------
  >>> memory_refusal(ValueError('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in '
  ...                           'memory space hbm. Used 17.38G of 15.75G hbm.'))  # doctest: +ELLIPSIS
  'RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 17.38G...'
  >>> memory_refusal(ValueError('shapes do not match')) is None
  True
  """
  text = str(error)
  if 'RESOURCE_EXHAUSTED' in text or 'out of memory' in text.lower():
    return ' '.join(text.split())[:300]
  return None


def _device_facts(argv: Sequence[str]) -> dict:
  device = jax.devices()[0]
  return {'platform': device.platform, 'kind': device.device_kind, 'count': jax.device_count(),
          'memory_limit': _memory_limit(), 'host': _host(),
          'versions': {'python': platform.python_version(), 'jax': jax.__version__, 'jaxlib': _version('jaxlib'),
                       'brainpy': bp.__version__, 'brainstate': brainstate.__version__, 'optax': optax.__version__},
          'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
          'command': 'python -m brainpy_accum.bench.accelerator ' + ' '.join(argv),
          'compilation_cache': jax.config.jax_compilation_cache_dir}


def _version(package: str) -> str:
  try:
    import importlib.metadata
    return importlib.metadata.version(package)
  except Exception:  # noqa: BLE001 -- only a label
    return 'unknown'


def _host() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      model = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  except (OSError, StopIteration):
    model = platform.processor() or platform.machine()
  return f'{model}, {os.cpu_count()} cores'


def measure_peak(size: Optional[int] = None, repeats: int = 5) -> Dict[str, float]:
  """FLOP/s of a square matmul on the default device, float32 at JAX's default precision (what the networks
  run) and bfloat16: the best of ``repeats`` timings (size 8192 on an accelerator, 1024 on a CPU)."""
  size = size or (1024 if jax.default_backend() == 'cpu' else 8192)
  peaks = {}
  for dtype in ('float32', 'bfloat16'):
    a = jnp.ones((size, size), dtype)
    product = jax.jit(lambda a: a @ a)
    product(a).block_until_ready()
    best = float('inf')
    for _ in range(repeats):
      start = time.perf_counter()
      product(a).block_until_ready()
      best = min(best, time.perf_counter() - start)
    peaks[dtype] = 2. * size ** 3 / best
  return peaks


class _Trainer:
  """One trainer at one batch size: ``epoch(batches)`` runs one epoch through its fit and waits for its end."""

  def __init__(self, name: str, workload: str, shape: Shape, budget: Optional[int], micro_batches: int = 1):
    self.name, self.workload, self.shape, self.batch = name, workload, shape, shape.batch
    self.micro_batches = micro_batches
    if name == 'plain JAX + optax':
      self.params = jax_params(shape)
      self.tx = optax.adam(LEARNING_RATE)
      self.opt = self.tx.init(self.params)
      self.step = plain_jax_step(workload, micro_batches, self.tx)
      return
    model = make_brainpy_model(workload, shape)
    optimizer = bp.optim.Adam(lr=LEARNING_RATE)
    if name == 'bp.BPTT':
      self.trainer = bp.BPTT(model, loss_of(workload), optimizer=optimizer, progress_bar=False)
    else:  # on an accelerator no budget: the device's own memory (cache=False: every first epoch starts cold)
      options = {} if budget is None else {'memory_budget': budget}
      self.trainer = AccumBPTT(model, loss_of(workload), optimizer=optimizer, progress_bar=False,
                               num_micro_batch='auto', cache=False, **options)

  def epoch(self, batches: List[tuple], quiet: bool = False) -> None:
    """One epoch over ``batches``; ``quiet``: without fit's report line."""
    if self.name == 'plain JAX + optax':
      loss = None
      for x, y in batches:
        self.params, self.opt, loss = self.step(self.params, self.opt, x, y)
      jax.block_until_ready((self.params, loss))
      return
    with _silenced(quiet):  # the report line, and bp.BPTT's progress bar (it shows one for a list of batches)
      self.trainer.fit(batches, num_epoch=1, num_report=-1)
    jax.block_until_ready([v.value for v in self.trainer.target.train_vars().unique().values()])

  def plan(self) -> Dict[str, object]:
    """How the trainer cut the batch, and the bytes of its compiled step (XLA's analysis)."""
    if self.name == 'AccumBPTT':
      chunk = self.trainer.stream_chunks.get(self.batch)
      plan, used = self.trainer.memory_plans[chunk or self.batch]
      text = self.trainer.describe_batch(self.batch)
      if chunk is not None:
        text = f'batch {self.batch} streamed in chunks of {chunk}: {text}'
      return {'plan': text, 'micro_batches': plan.num_micro_batches, 'bytes': used, 'xla_flops': None}
    x, y = make_batch(self.shape, abstract=True, workload=self.workload)
    if self.name == 'bp.BPTT':
      self.trainer.target.reset(self.batch)
      compiled = self.trainer.f_train.compile(FIT, x, y)
      plan = f'batch {self.batch} whole'
    else:
      compiled = self.step.lower(self.params, self.opt, x, y).compile()
      plan = f'{self.micro_batches} x {self.batch // self.micro_batches}'
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {'plan': plan, 'micro_batches': self.micro_batches, 'bytes': compiled_step_bytes(compiled),
            'xla_flops': (cost or {}).get('flops')}


@contextlib.contextmanager
def _silenced(quiet: bool):
  if not quiet:
    yield
    return
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    yield


def _divisor_at_least(batch: int, n: int) -> int:
  """The smallest divisor of ``batch`` not below ``n`` (plain JAX cuts equal micro-batches)."""
  return next(d for d in range(max(1, n), batch + 1) if batch % d == 0)


def _warm_up(workload: str, shape: Shape) -> None:
  """A throwaway model of ``workload`` and its optimizer built, the model reset at ``shape.batch`` and the
  optimizer's schedule stepped as at an epoch's end: the programs they run compiled in this process, as a trainer
  built after them finds them (bp.BPTT's first epoch measured first held them for AccumBPTT's: 22 compilations against
  8 at a batch of 2,048 on the TPU v5e, each small program 0.2-0.5 s there)."""
  model, optimizer = make_brainpy_model(workload, shape), bp.optim.Adam(lr=LEARNING_RATE)
  optimizer.register_train_vars(model.train_vars().unique())
  model.reset(shape.batch)
  optimizer.lr.step_epoch()  # (fit's end of an epoch: an addition to the schedule's counter)
  jax.block_until_ready([v.value for v in list(model.vars().unique().values()) + list(optimizer.vars().values())])


def _first_epoch(build: Callable[[], _Trainer], batches: List[tuple], row: dict) -> Optional[_Trainer]:
  """Build a fresh trainer and run its first epoch, timed, by phase (:mod:`~brainpy_accum.diagnostics._phases`:
  ``row['first_fit_phases']``); ``None`` (and why, in ``row``) where it fails."""
  start = time.perf_counter()
  try:
    with record_phases() as phases:
      trainer = build()
      trainer.epoch(batches)
  except Exception as error:  # noqa: BLE001 -- a trainer that cannot run this batch is a finding, not a crash
    refusal = memory_refusal(error)
    row['fits'] = False if refusal else None
    row['error'] = refusal or f'{type(error).__name__}: {" ".join(str(error).split())[:300]}'
    return None
  row['first_epoch_s'] = time.perf_counter() - start
  row['first_fit_phases'] = phases.table()
  row['first_fit_events'] = [list(event) for event in phases.events]  # the planner's compilations, in order
  row['fits'] = True
  return trainer


def _timed(trainer: _Trainer, batches: List[tuple], overlap: Optional[bool] = None) -> Step:
  def run():
    with overlapping(overlap):
      trainer.epoch(batches, quiet=True)
  return Step(run, lambda: None, lambda: 0)


def measure_batch(workload: str, shape: Shape, epoch: int, rounds: int, budget: Optional[int],
                  bptt_fits: bool = True) -> List[dict]:
  """Every trainer at ``shape.batch``, one row each, see the module's docstring. NumPy and device batches are
  timed in the same rounds where three batches take at most a tenth of the device's memory (always on a CPU),
  else in two phases, so that the device holds one of them at a time (``'interleaved'`` in each row); device
  batches only where one takes at most :data:`DEVICE_SHARE` of the device (larger ones cannot sit there beside
  their step). On an accelerator AccumBPTT's NumPy batches are timed as ``fit`` gives them (sent ahead), and plain
  JAX is left out (its row says so)."""
  batch = shape.batch
  x, y = make_batch(shape, workload=workload)
  host = [(x, y)] * epoch
  limit = _memory_limit()
  together = limit is None or 3 * prefetch_bytes(x, y) <= limit / 10
  on_chip = limit is not None
  rows = {name: {'workload': workload, 'batch': batch, 'trainer': name, 'fits': None, 'error': None,
                 'epoch_s': {}, 'interleaved': together} for name in TRAINERS}
  trainers: Dict[str, _Trainer] = {}
  _warm_up(workload, shape)
  for name in ('bp.BPTT', 'AccumBPTT'):
    if name == 'bp.BPTT' and not bptt_fits:
      rows[name].update(fits=False, error=BPTT_SKIPPED)
      continue
    trainer = _first_epoch(lambda: _Trainer(name, workload, shape, budget), host, rows[name])
    if trainer is not None:
      trainers[name] = trainer
  for name, trainer in trainers.items():
    try:
      rows[name].update(trainer.plan())
    except Exception as error:  # noqa: BLE001
      rows[name]['plan_error'] = f'{type(error).__name__}: {" ".join(str(error).split())[:200]}'
  # numpy batches from the host: fit as a user calls it, and (on a CPU) the same without sending batches ahead
  timed = [('bp.BPTT', WITH_STEP, _timed(trainers['bp.BPTT'], host))] if 'bp.BPTT' in trainers else []
  if 'AccumBPTT' in trainers:
    timed += [('AccumBPTT', AHEAD, _timed(trainers['AccumBPTT'], host, overlap=True))]
    if not on_chip:
      timed += [('AccumBPTT', WITH_STEP, _timed(trainers['AccumBPTT'], host, overlap=False))]
  if not together:
    _record(timed, rounds, rows)
    timed = []
  if limit is not None and x.nbytes + y.nbytes > DEVICE_SHARE * limit:
    rows['plain JAX + optax']['error'] = 'not measured: the batch cannot sit on the device beside its step'
  else:
    _device_phase(trainers, rows, timed, (x, y), (workload, shape, epoch, rounds, budget))
  _finish_rows(rows, shape, epoch)
  return list(rows.values())


def _device_phase(trainers: Dict[str, '_Trainer'], rows: Dict[str, dict], timed: list, batch: tuple,
                  setting: tuple) -> None:
  """The same batches already on the device (no copy: the step's own speed), timed with ``timed`` (the NumPy
  steps timed in the same rounds, if any); plain JAX on them too, on a CPU."""
  workload, shape, epoch, rounds, budget = setting
  device_x, device_y = jax.block_until_ready(jax.device_put(batch))
  on_device = [(device_x, device_y)] * epoch
  if _memory_limit() is None:
    n = _divisor_at_least(shape.batch, rows['AccumBPTT'].get('micro_batches') or 1)
    jax_trainer = _first_epoch(lambda: _Trainer('plain JAX + optax', workload, shape, budget, n), on_device,
                               rows['plain JAX + optax'])
    if jax_trainer is not None:
      trainers['plain JAX + optax'] = jax_trainer
      rows['plain JAX + optax'].update(jax_trainer.plan())
  else:
    rows['plain JAX + optax']['error'] = 'not measured on the accelerator (the CPU run compares it)'
    for trainer in trainers.values():  # a first epoch on device batches: their own compilations, not timed
      trainer.epoch(on_device[:2], quiet=True)
  _record(timed + [(name, DEVICE, _timed(trainer, on_device)) for name, trainer in trainers.items()], rounds, rows)


def _finish_rows(rows: Dict[str, dict], shape: Shape, epoch: int) -> None:
  for row in rows.values():
    row['model_flops'] = model_flops(shape, shape.batch)
    row['samples_per_s'] = {kind: epoch * shape.batch / statistics.median(times)
                            for kind, times in row['epoch_s'].items()}


def _memory_limit() -> Optional[int]:
  """The default device's memory in bytes, where it says (not on a CPU)."""
  device = jax.devices()[0]
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  return (stats or {}).get('bytes_limit')


def _record(timed, rounds: int, rows: Dict[str, dict]) -> None:
  """Time the epochs of ``timed`` (``(trainer, kind, step)``) in interleaved rounds into their rows; a trainer
  that fails at run time (out of memory) is recorded as such and left out."""
  try:
    times = time_in_rounds([step for _, _, step in timed], rounds, warm_up=False)
  except Exception as error:  # noqa: BLE001
    refusal = memory_refusal(error)
    if refusal is None:
      raise
    for name, _, _ in timed:  # which one ran out is not known here: say so in each
      rows[name].setdefault('run_error', refusal)
    return
  for (name, kind, _), seconds in zip(timed, times):
    rows[name]['epoch_s'][kind] = seconds


def measure_device(workloads: Sequence[str] = WORKLOADS, shape: Shape = ACCELERATOR['shape'],
                   batches: Sequence[int] = ACCELERATOR['batches'], epoch: int = 8, rounds: int = 3,
                   budget: Optional[int] = None, peak_size: Optional[int] = None,
                   done_batch: Optional[Callable[[dict], None]] = None,
                   bptt_refused: Optional[Dict[str, Tuple[int, str]]] = None) -> dict:
  """Every workload at every batch size (:func:`measure_batch`), with the device, its peak and the settings;
  ``done_batch(run)`` receives the run so far after each batch size (a run cut short keeps what it measured).
  ``bptt_refused``: per workload, the smallest batch whose bp.BPTT step an earlier call of the same settings found
  too large for the device, and what the device said: bp.BPTT is not tried again at it or above (its reference is
  the stored one), and its row says where it was refused (at that batch, with the device's words)."""
  run = {'shape': list(shape), 'batches': list(batches), 'epoch': epoch, 'rounds': rounds, 'budget': budget,
         'peak': measure_peak(peak_size), 'rows': []}
  for workload in workloads:
    refused, said = (bptt_refused or {}).get(workload, (None, ''))
    for batch in sorted(batches):
      bptt_fits = refused is None or batch < refused
      done = measure_batch(workload, shape._replace(batch=batch), epoch, rounds, budget, bptt_fits)
      gc.collect()  # the trainers of this batch size and their executables leave the device
      if not bptt_fits and done[0]['error'] == BPTT_SKIPPED:
        done[0]['error'] = said if batch == refused else f'not tried: its step was refused at batch {refused}'
      elif done[0]['fits'] is False and (refused is None or batch < refused):
        refused, said = batch, done[0]['error'] or BPTT_SKIPPED
      for row in done:
        speeds = ', '.join(f'{k} {v:,.0f}' for k, v in row['samples_per_s'].items())
        print(f"{workload} B={batch:<6} {row['trainer']:18} fits={row['fits']!s:5} {row.get('plan', '')}: "
              f"samples/s {speeds or '-'} {row['error'] or row.get('run_error') or ''}", flush=True)
      run['rows'] += done
      if done_batch is not None:
        done_batch(run)
  return run


def measure_holds(workload: str, shape: Shape, shares: Sequence[float] = (0.6, 0.3)) -> List[dict]:
  """For each share of the device: AccumBPTT planned and trained on one batch of ``shape`` with the device free
  (a fresh trainer), then trained again while an array of this run holds that share of the device (put there
  after the plan was made): each fit's seconds, plan and error (``None``: it trained). The first fit includes
  planning and compilations: the figure the fit under a hold is compared with."""
  x, y = make_batch(shape, workload=workload)
  rows, limit = [], _memory_limit() or 0
  for share in shares:
    trainer = _Trainer('AccumBPTT', workload, shape, None)
    for held in (0., share):
      hold = jnp.ones((int(held * limit) // 4,), jnp.float32).block_until_ready() if held else None
      start, error = time.perf_counter(), None
      try:
        trainer.epoch([(x, y)], quiet=True)
      except Exception as failure:  # noqa: BLE001 -- what a user would have met is the finding
        error = f'{type(failure).__name__}: {" ".join(str(failure).split())[:300]}'
      rows.append({'held_share': held, 'seconds': time.perf_counter() - start, 'error': error,
                   'plan': trainer.trainer.describe_batch(shape.batch) if error is None else None})
      print(f'hold {held:.0%} of the device: {rows[-1]}', flush=True)
      del hold
      gc.collect()
    del trainer
    gc.collect()
  return rows


def _key(facts: dict) -> str:
  return f"{facts['platform']}: {facts['kind']}"


def _merged(before: Optional[dict], run: dict) -> dict:
  """``run``, with the rows of ``before`` (the same device's stored run) at the batch sizes and workloads that
  ``run`` did not measure, where both used the same network shape and settings: a device whose time is short
  measures its batch sizes in several calls."""
  same = ('shape', 'epoch', 'rounds', 'budget')
  if not before or any(before.get(k) != run.get(k) for k in same):
    return run
  measured = {(row['workload'], row['batch']) for row in run['rows']}
  kept = [row for row in before['rows'] if (row['workload'], row['batch']) not in measured]
  rows = sorted(kept + run['rows'], key=lambda row: (row['workload'], row['batch']))
  commands = before.get('commands', [before['facts']['command']])
  commands += [] if commands[-1] == run['facts']['command'] else [run['facts']['command']]  # (written per batch size)
  kept = {k: v for k, v in before.items()  # holds, host copies, bench.feed's runs (feed), notes
          if k not in run and k not in ('rows', 'batches', 'commands')}
  return dict(run, **kept, rows=rows, batches=sorted({row['batch'] for row in rows}), commands=commands)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.bench.accelerator',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true', help='tiny networks and batches (seconds; for tests)')
  parser.add_argument('--workloads', nargs='+', default=None, choices=list(WORKLOADS),
                      help='networks (default: the spiking one on an accelerator, both on a CPU)')
  parser.add_argument('--batches', nargs='+', type=int, default=None, help='batch sizes (default: by device)')
  parser.add_argument('--epoch', type=int, default=None, help='batches per epoch (default 16 on a device, 4 on a CPU)')
  parser.add_argument('--rounds', type=int, default=None, help='timed rounds (default 2; 7 on a CPU, whose load drifts)')
  parser.add_argument('--budget', default=None, help="AccumBPTT's memory_budget (default: none on an accelerator, "
                                                     f"{CPU['budget']} on a CPU)")
  parser.add_argument('--holds', type=int, default=None, metavar='BATCH',
                      help='also train a batch of BATCH after planning it, with 60%% and 30%% of the device held')
  parser.add_argument('--host-copy', nargs='+', type=float, default=None, metavar='GB',
                      help="plain JAX: a piece's copy to the device out of host arrays of these sizes in GB, each "
                           'way of bench.streaming.COPY_WAYS, untouched, written-earlier and touched slices '
                           '(trainers: with --batches)')
  parser.add_argument('--piece-mb', type=float, default=512, help='the piece --host-copy copies, in MB (default 512)')
  parser.add_argument('--out', default='docs', help='folder for accelerator.json, .md and .png')
  args = parser.parse_args(argv)
  accelerator = jax.default_backend() != 'cpu'
  preset = QUICK if args.quick else ACCELERATOR if accelerator else CPU
  budget = args.budget or preset['budget']
  facts = _device_facts(argv)
  os.makedirs(args.out, exist_ok=True)
  shape = preset['shape']
  workloads = args.workloads or list(preset['workloads'])
  extras = {'holds': None if args.holds is None else measure_holds(workloads[0], shape._replace(batch=args.holds)),
            'host_copy': None if args.host_copy is None else measure_host_copy(args.host_copy, args.piece_mb,
                                                                                sample=(shape.time, shape.inputs))}
  write = functools.partial(_write, args.out, facts, budget, {k: v for k, v in extras.items() if v is not None})
  epoch, rounds = args.epoch or preset['epoch'], args.rounds or preset['rounds']
  settings = {'shape': list(shape), 'epoch': epoch, 'rounds': rounds, 'budget': budget}
  batches = args.batches or ([] if args.host_copy else preset['batches'])
  run = measure_device(workloads, shape, batches, epoch, rounds,
                       None if budget is None else parse_memory(budget), preset.get('peak_size'), done_batch=write,
                       bptt_refused=stored_refusals(args.out, facts, settings))
  return write(run)


def stored_refusals(out: str, facts: dict, settings: dict) -> Dict[str, Tuple[int, str]]:
  """Per workload, the smallest batch whose bp.BPTT step the device refused and the row's words for it
  (``'stored: RESOURCE_EXHAUSTED ...'``), in the run that ``out``'s
  accelerator.json holds for this device with the same ``settings`` (shape, epoch, rounds, budget): a call that
  measures larger batches reuses bp.BPTT's reference instead of compiling its refused step again."""
  stored = os.path.join(out, 'accelerator.json')
  if not os.path.exists(stored):
    return {}
  with open(stored) as f:
    before = json.load(f).get('runs', {}).get(_key(facts))
  if not before or any(before.get(k) != v for k, v in settings.items()):
    return {}
  refused: Dict[str, Tuple[int, str]] = {}
  for row in sorted(before['rows'], key=lambda row: -row['batch']):
    said = memory_refusal(ValueError(row['error'] or ''))
    if row['trainer'] == 'bp.BPTT' and row['fits'] is False and said:
      refused[row['workload']] = (row['batch'], said if said.startswith('stored: ') else f'stored: {said}')
  return refused


def _write(out: str, facts: dict, budget, extras: dict, run: dict) -> dict:
  """accelerator.json (this device's run, with ``extras``: holds, host copies, merged with what it holds), .md
  and .png."""
  run = dict(run, budget=budget, facts=facts, **extras)
  stored = os.path.join(out, 'accelerator.json')
  data = {'runs': {}}
  if os.path.exists(stored):
    with open(stored) as f:
      data = json.load(f)
  data['runs'][_key(facts)] = _merged(data['runs'].get(_key(facts)), run)  # other devices' runs are kept
  with open(stored, 'w') as f:
    json.dump(data, f, indent=1)
  with open(os.path.join(out, 'accelerator.md'), 'w') as f:
    f.write(device_report(data) + '\n')
  plot_device(data, os.path.join(out, 'accelerator.png'))
  return data


if __name__ == '__main__':
  main()
