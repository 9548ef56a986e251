"""``python -m brainpy_accum.recipes.mnist1d``: spiking networks on MNIST-1D, trained with ``AccumBPTT``.

MNIST-1D (Greydanus & Kobak) is a published benchmark of 40-sample signals in 10 classes, 4000 for
training and 1000 for testing; its README table gives logistic regression 32%, MLP 68%, GRU 91%,
CNN 94%, human 96%. The data is made locally by the ``mnist1d`` package
(``make_dataset(get_dataset_args())``, the default arguments; nothing is downloaded).

Two spiking networks, both LIF neurons with an arctan surrogate gradient and a read-out summed over time:

- ``recurrent``: two recurrent LIF layers, fast then slower, reading the signal as a time series, one new
  sample per time step (each held for 2 steps) through a tapped delay line (the newest sample and the ones
  before it: a learnable causal filter bank, i.e. synaptic delays);
- ``conv``: three convolutional LIF layers running along the signal, which is the input current at each of
  8 time steps; spikes of the last layer averaged over positions, then read out. Its training signals are
  shifted at random by up to 2 samples every epoch.

Each is trained at a batch whose ``bp.BPTT`` train step does not fit ``memory_budget`` (XLA's
compile-time memory analysis, as the memory planner counts it), with
``AccumBPTT(num_micro_batch='auto', memory_budget=...)``, which cuts each batch into the fewest
micro-batches that fit. ``--rate-regulariser`` adds a row (first seed only): the recurrent network with a
batch-wide firing-rate penalty, which couples the samples of a batch and so is trained with
``whole_batch_loss=True``; the row records the default mode's first-batch warning on the same loss
and the memory and time of both modes.

Prints a table and writes the rows as JSON (``--out``).
"""

import argparse
import json
import sys
import time
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import brainpy as bp
import brainpy.math as bm
import numpy as np

from ..memory import compiled_step_bytes, format_memory, parse_memory
from ..trainer import AccumBPTT

__all__ = ['Mnist1d', 'ModelSpec', 'MODELS', 'RATE_TARGET', 'RecurrentSNN', 'ConvSNN', 'load_mnist1d', 'delay_line',
           'held_signal', 'random_shifts', 'summed_cross_entropy', 'rate_regularised_cross_entropy',
           'bptt_step_bytes', 'Trained', 'train', 'rate_regulariser_row', 'format_table', 'main']

PAPER = {'logistic regression': 0.32, 'MLP': 0.68, 'GRU': 0.91, 'CNN': 0.94, 'human': 0.96}
RATE_TARGET = 0.05  # spikes per neuron per time step of the rate regulariser
RATE_WEIGHT = 1.
FIT = bp.tools.DotDict(fit=True)


class Mnist1d(NamedTuple):
  """The standard split: ``x_train`` (4000, 40) float32, ``y_train`` (4000,) int32, and the 1000 test signals."""
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load_mnist1d() -> Mnist1d:
  """MNIST-1D made locally with the package's default arguments (``make_dataset(get_dataset_args())``)."""
  try:
    from mnist1d.data import get_dataset_args, make_dataset
  except ImportError as error:
    raise ImportError('The MNIST-1D benchmark needs the mnist1d package: pip install "brainpy-accum[mnist1d]" '
                      '(or pip install mnist1d).') from error
  data = make_dataset(get_dataset_args())
  return Mnist1d(np.asarray(data['x'], np.float32), np.asarray(data['y'], np.int32),
                 np.asarray(data['x_test'], np.float32), np.asarray(data['y_test'], np.int32))


def delay_line(signals: np.ndarray, taps: int, steps_per_sample: int = 1) -> np.ndarray:
  """``(n, length * steps_per_sample, taps)``: a tapped delay line of the signal, arriving one sample at a time.

  At sample ``t`` the line holds the samples ``t - taps + 1 .. t`` (zeros before the start), newest last, and it
  is presented for ``steps_per_sample`` time steps. The network never sees a sample before its time.

  Examples
  --------
  >>> delay_line(np.array([[1., 2., 3.]]), 2)[0].tolist()
  [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]]
  >>> delay_line(np.array([[1., 2.]]), 1, steps_per_sample=2)[0, :, 0].tolist()
  [1.0, 1.0, 2.0, 2.0]
  """
  n, length = signals.shape
  padded = np.concatenate([np.zeros((n, taps - 1), signals.dtype), signals], axis=1)
  line = np.stack([padded[:, t:t + taps] for t in range(length)], axis=1)
  return np.repeat(line, steps_per_sample, axis=1)


def _lif(size, tau: float, **kwargs) -> bp.dyn.Lif:
  # threshold 1 and rest 0, so the input weights' scale sets how many neurons fire; soft reset (BrainPy's default)
  return bp.dyn.Lif(size, V_rest=0., V_reset=0., V_th=1., tau=tau, spk_fun=bm.surrogate.Arctan(), **kwargs)


class RecurrentSNN(bp.DynamicalSystem):
  """Two recurrent LIF layers reading a delay line of the signal; a linear read-out of the second layer's spikes.

  Parameters
  ----------
  taps : int
    Samples of the delay line (the input size).
  hidden : int
    Neurons per layer.
  tau_fast, tau_slow : float
    Membrane time constants (ms, with BrainPy's ``dt`` of 0.1 ms per step) of the first and second layers:
    the first detects local shapes, the second holds them longer.
  num_class : int
    Read-out size.
  """

  def __init__(self, taps: int = 8, hidden: int = 256, tau_fast: float = 0.25, tau_slow: float = 0.5,
               num_class: int = 10):
    super().__init__()
    self.inp = bp.dnn.Dense(taps, hidden, W_initializer=bp.init.KaimingNormal(scale=4.))
    self.rec = bp.dnn.Dense(hidden, hidden, W_initializer=bp.init.KaimingNormal(scale=2.), b_initializer=None)
    self.lif = _lif(hidden, tau_fast)
    self.inp2 = bp.dnn.Dense(hidden, hidden, W_initializer=bp.init.KaimingNormal(scale=16.))
    self.rec2 = bp.dnn.Dense(hidden, hidden, W_initializer=bp.init.KaimingNormal(scale=2.), b_initializer=None)
    self.lif2 = _lif(hidden, tau_slow)
    self.readout = bp.dnn.Dense(hidden, num_class)

  def update(self, x):
    first = self.lif(self.inp(x) + self.rec(self.lif.spike.value))
    second = self.lif2(self.inp2(first) + self.rec2(self.lif2.spike.value))
    return self.readout(second)


class ConvSNN(bp.DynamicalSystem):
  """A convolutional spiking network over the signal's 40 samples: three convolutional LIF layers, spike counts
  averaged over positions, a linear read-out.

  The whole signal is the input current of the first layer at every time step (direct encoding, as in
  :func:`held_signal`); the convolutions run along the signal (kernel 5, then 5 and 3 with stride 2), each
  followed by LIF neurons, one per position and channel. Averaging the last layer's spikes over positions makes
  the read-out see the same features wherever a digit's strokes lie (MNIST-1D shifts them at random).

  Parameters
  ----------
  channels : sequence of 3 int
    Channels of the three convolutional layers.
  tau : float
    Membrane time constant (ms, with BrainPy's ``dt`` of 0.1 ms per step) of every layer.
  length : int
    Samples per signal.
  num_class : int
    Read-out size.
  """

  def __init__(self, channels: Sequence[int] = (48, 96, 96), tau: float = 0.2, length: int = 40,
               num_class: int = 10):
    super().__init__()
    c1, c2, c3 = channels
    init = lambda: bp.init.KaimingNormal(scale=4.)
    self.conv1 = bp.dnn.Conv1d(1, c1, 5, w_initializer=init())
    self.lif1 = _lif((length, c1), tau, keep_size=True)
    self.conv2 = bp.dnn.Conv1d(c1, c2, 5, stride=2, w_initializer=init())
    self.lif2 = _lif(((length + 1) // 2, c2), tau, keep_size=True)
    self.conv3 = bp.dnn.Conv1d(c2, c3, 3, stride=2, w_initializer=init())
    self.lif3 = _lif(((length + 3) // 4, c3), tau, keep_size=True)
    self.readout = bp.dnn.Dense(c3, num_class)

  def update(self, x):
    h = self.lif1(self.conv1(x))
    h = self.lif2(self.conv2(h))
    h = self.lif3(self.conv3(h))
    return self.readout(h.mean(axis=1))


def held_signal(signals: np.ndarray, steps: int) -> np.ndarray:
  """``(n, steps, length, 1)``: the whole signal as one input channel, the same at each of ``steps`` time steps.

  Examples
  --------
  >>> held_signal(np.array([[1., 2., 3.]]), 2)[0, :, :, 0].tolist()
  [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
  """
  return np.repeat(signals[:, None, :, None], steps, axis=1)


def random_shifts(inputs: np.ndarray, rng: np.random.RandomState, max_shift: int = 2, axis: int = 2) -> np.ndarray:
  """Each sample's signal rolled by its own random shift of ``-max_shift .. max_shift`` positions along ``axis``
  (of the batch; 2 is the signal's axis of :func:`held_signal`): augmentation of the training signals.

  Examples
  --------
  >>> x = held_signal(np.arange(6.)[None], 1)
  >>> shifted = random_shifts(x, np.random.RandomState(0), max_shift=2)
  >>> sorted(shifted[0, 0, :, 0].tolist()) == list(range(6))
  True
  """
  shifts = rng.randint(-max_shift, max_shift + 1, size=len(inputs))
  return np.stack([np.roll(sample, shift, axis=axis - 1) for sample, shift in zip(inputs, shifts)])


def summed_cross_entropy(predicts, labels):
  """Cross-entropy of the class scores summed over time (a per-sample mean: micro-batches combine exactly)."""
  logits = predicts.sum(axis=1)
  return bp.losses.cross_entropy_loss(logits, labels), {'acc': bm.mean(bm.argmax(logits, axis=-1) == labels)}


def rate_regularised_cross_entropy(predicts, labels):
  """:func:`summed_cross_entropy` plus ``sum over neurons of (mean over batch and time of its spikes - f0)^2``.

  The rate is a batch-wide mean inside a square, so the loss of a batch is not a mean of its samples' losses:
  trained exactly by ``AccumBPTT(..., whole_batch_loss=True)``, not by the default mode.
  """
  out, monitors = predicts
  ce, aux = summed_cross_entropy(out, labels)
  rate = bm.mean(monitors['spike'], axis=(0, 1))
  return ce + RATE_WEIGHT * bm.sum((rate - RATE_TARGET) ** 2), dict(aux, rate=bm.mean(rate))


class ModelSpec(NamedTuple):
  """One benchmarked network and how it is trained."""
  name: str
  kind: str                                   # 'recurrent' or 'conv'
  build: Callable[[], bp.DynamicalSystem]
  encode: Callable[[np.ndarray], np.ndarray]  # (n, 40) signals -> (n, time, ...) model inputs
  batch: int                                  # the effective batch of every update
  memory_budget: int                          # bytes; bp.BPTT's step at `batch` does not fit
  epochs: int
  lr: float                                   # Adam's learning rate, times `decay` every epoch
  decay: float
  augment: Optional[Callable] = None          # (encoded batch, RandomState) -> augmented batch, every epoch


MODELS: Dict[str, ModelSpec] = {
  'recurrent': ModelSpec('recurrent LIF, 2 layers of 256, 8-tap delay line, 2 steps per sample', 'recurrent',
                         RecurrentSNN, lambda x: delay_line(x, 8, steps_per_sample=2), batch=32,
                         memory_budget=parse_memory('12MiB'), epochs=30, lr=2e-3, decay=0.94),
  'conv': ModelSpec('convolutional LIF over the signal, 3 layers of 48/96/96 channels, 8 steps, shifts +-2', 'conv',
                    ConvSNN, lambda x: held_signal(x, 8), batch=32, memory_budget=parse_memory('8MiB'), epochs=24,
                    lr=3e-3, decay=0.9, augment=random_shifts),
}


def _build(spec: ModelSpec, seed: int) -> bp.DynamicalSystem:
  bm.random.seed(seed)
  with bm.training_environment():
    return spec.build()


def bptt_step_bytes(spec: ModelSpec, inputs: np.ndarray, labels: np.ndarray) -> int:
  """Memory of ``bp.BPTT``'s train step on this batch (XLA's compile-time analysis; nothing runs)."""
  model = _build(spec, 0)
  trainer = bp.BPTT(model, summed_cross_entropy, optimizer=bp.optim.Adam(lr=spec.lr), loss_has_aux=True,
                    progress_bar=False)
  model.reset(len(labels))
  return compiled_step_bytes(trainer.f_train.compile(FIT, inputs, labels))


def _epoch_batches(inputs, labels, batch: int, seed: int, augment: Optional[Callable] = None):
  """A function returning the batches of one epoch, shuffled (and augmented) anew at each call; the short last
  batch dropped."""
  rng = np.random.RandomState(seed)

  def batches():
    order = rng.permutation(len(labels))
    x = inputs[order] if augment is None else augment(inputs[order], rng)
    return [(x[i:i + batch], labels[order[i:i + batch]]) for i in range(0, len(labels) - batch + 1, batch)]

  return batches


def _test_batches(inputs, labels, size: int = 40):
  # small batches: under memory_budget a batch of 500 would run as hundreds of tiny micro-batches, one after another
  return [(inputs[i:i + size], labels[i:i + size]) for i in range(0, len(labels), size)]


def _accuracy(trainer, inputs, labels) -> float:
  correct = 0
  for x, y in _test_batches(inputs, labels):
    out = trainer.predict(x, reset_state=True)
    out = out[0] if isinstance(out, tuple) else out
    correct += int(np.sum(np.asarray(out).sum(axis=1).argmax(axis=-1) == y))
  return correct / len(labels)


def _make_trainer(spec: ModelSpec, model, loss, *, updates_per_epoch: int, **kwargs) -> AccumBPTT:
  lr = bp.optim.ExponentialDecayLR(spec.lr, decay_steps=updates_per_epoch, decay_rate=spec.decay)
  return AccumBPTT(model, loss, optimizer=bp.optim.Adam(lr=lr), loss_has_aux=True, num_micro_batch='auto',
                   memory_budget=spec.memory_budget, progress_bar=False, **kwargs)


class Trained(NamedTuple):
  """What :func:`train` returns: the benchmark's row and the trainer (its model trained)."""
  row: dict
  trainer: AccumBPTT


def train(spec: ModelSpec, data: Mnist1d, seed: int = 0, *, epochs: Optional[int] = None,
          train_size: Optional[int] = None, log: Callable = print) -> Trained:
  """Train ``spec`` with ``AccumBPTT`` for one seed; the row holds test accuracy, memory figures, plan, time.

  ``epochs`` and ``train_size`` shorten the run (for tests and notebooks); the row records both.
  """
  x_train, x_test = spec.encode(data.x_train[:train_size]), spec.encode(data.x_test)
  y_train = data.y_train[:train_size]
  batch = min(spec.batch, len(y_train))
  epochs = spec.epochs if epochs is None else epochs
  bptt_bytes = bptt_step_bytes(spec, x_train[:batch], y_train[:batch])
  model = _build(spec, seed)
  trainer = _make_trainer(spec, model, summed_cross_entropy, updates_per_epoch=len(y_train) // batch)
  start = time.perf_counter()
  trainer.fit(_epoch_batches(x_train, y_train, batch, seed, spec.augment), num_epoch=epochs)
  train_seconds = time.perf_counter() - start
  plan, accum_bytes = trainer.memory_plans[batch]
  accuracy = _accuracy(trainer, x_test, data.y_test)
  log(f'{spec.kind} seed {seed}: test accuracy {accuracy:.4f} after {epochs} epochs in {train_seconds:.0f} s',
      flush=True)
  return Trained({'model': spec.name, 'kind': spec.kind, 'seed': seed, 'test_accuracy': accuracy,
          'trainer': 'AccumBPTT', 'batch': batch, 'memory_budget': spec.memory_budget,
          'bptt_step_bytes': bptt_bytes, 'bptt_step_fits_budget': bptt_bytes <= spec.memory_budget,
          'plan': _plan_text(plan),
          'num_micro_batches': plan.num_micro_batches, 'accum_step_bytes': accum_bytes, 'epochs': epochs,
          'train_size': len(y_train), 'train_seconds': train_seconds,
          'train_accuracy_per_epoch': [float(a) for a in trainer.get_hist_metric('fit', 'acc')],
          'train_loss_per_epoch': [float(a) for a in trainer.get_hist_metric('fit', 'loss')]}, trainer)


def _plan_text(plan) -> str:
  cut = f'{plan.num_full} x {plan.micro_batch_size}' + (f' + {plan.remainder}' if plan.remainder else '')
  return f'{plan.num_micro_batches} micro-batches ({cut})'


def _epoch_seconds(trainer, batches) -> float:
  """Seconds of one more epoch of ``trainer`` (already compiled by an earlier epoch)."""
  start = time.perf_counter()
  trainer.fit(batches, num_epoch=1)
  return time.perf_counter() - start


def _regularised_bptt_bytes(spec: ModelSpec, x, y) -> int:
  """XLA's memory of bp.BPTT's train step on the batch ``x, y``, with the rate-regularised loss."""
  model = _build(spec, 0)
  bptt = bp.BPTT(model, rate_regularised_cross_entropy, optimizer=bp.optim.Adam(lr=spec.lr), loss_has_aux=True,
                 monitors={'spike': model.lif.spike}, progress_bar=False)
  model.reset(len(y))
  return compiled_step_bytes(bptt.f_train.compile(FIT, x, y))


def rate_regulariser_row(spec: ModelSpec, data: Mnist1d, seed: int = 0, *, epochs: Optional[int] = None,
                         train_size: Optional[int] = None, log: Callable = print) -> dict:
  """The recurrent network with :func:`rate_regularised_cross_entropy`, trained with ``whole_batch_loss=True``.

  The same loss in the default mode is run for one epoch beside it, from the same initial parameters: its
  first-batch warning is captured, and both modes' plans, step memory (XLA) and seconds per epoch recorded.
  """
  x_train, x_test = spec.encode(data.x_train[:train_size]), spec.encode(data.x_test)
  y_train = data.y_train[:train_size]
  batch = min(spec.batch, len(y_train))
  epochs = spec.epochs if epochs is None else epochs
  updates = len(y_train) // batch
  batches = _epoch_batches(x_train, y_train, batch, seed)

  def trainer(whole_batch_loss):
    model = _build(spec, seed)
    return _make_trainer(spec, model, rate_regularised_cross_entropy, updates_per_epoch=updates,
                         monitors={'spike': model.lif.spike}, whole_batch_loss=whole_batch_loss)

  default = trainer(False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    default.fit(batches, num_epoch=1)
  coupled = [str(w.message) for w in caught if 'couples the samples' in str(w.message)]
  exact = trainer(True)
  start = time.perf_counter()
  exact.fit(batches, num_epoch=epochs)
  train_seconds = time.perf_counter() - start
  accuracy = _accuracy(exact, x_test, data.y_test)
  # read before the timing epochs below: each fit starts a new history, and they train further
  rates, accuracies, losses = ([float(a) for a in exact.get_hist_metric('fit', m)] for m in ('rate', 'acc', 'loss'))
  # one more epoch of each, back to back after both have compiled: seconds per epoch of the two modes
  default_epoch, exact_epoch = _epoch_seconds(default, batches), _epoch_seconds(exact, batches)
  (plan, accum_bytes), (default_plan, default_bytes) = exact.memory_plans[batch], default.memory_plans[batch]
  log(f'rate regulariser seed {seed}: test accuracy {accuracy:.4f}, rate {rates[-1]:.3f}; default mode '
      f'warned: {bool(coupled)}', flush=True)
  bptt_bytes = _regularised_bptt_bytes(spec, x_train[:batch], y_train[:batch])
  return {'model': spec.name + f' + batch-wide rate regulariser (f0={RATE_TARGET})', 'kind': spec.kind,
          'seed': seed, 'test_accuracy': accuracy, 'trainer': 'AccumBPTT whole_batch_loss=True', 'batch': batch,
          'memory_budget': spec.memory_budget, 'bptt_step_bytes': bptt_bytes,
          'bptt_step_fits_budget': bptt_bytes <= spec.memory_budget,
          'plan': _plan_text(plan),
          'num_micro_batches': plan.num_micro_batches, 'accum_step_bytes': accum_bytes, 'epochs': epochs,
          'train_size': len(y_train), 'train_seconds': train_seconds, 'epoch_seconds': exact_epoch,
          'final_rate': rates[-1],
          'default_mode': {'warned': bool(coupled), 'warning': coupled[0] if coupled else None,
                           'plan': _plan_text(default_plan),
                           'step_bytes': default_bytes, 'epoch_seconds': default_epoch},
          'train_accuracy_per_epoch': accuracies, 'train_loss_per_epoch': losses}


def format_table(rows: Sequence[dict]) -> str:
  """A Markdown table of the rows: accuracy, memory of ``bp.BPTT``'s step and of the plan, time."""
  lines = ['| model | trainer | test accuracy | batch | memory_budget | bp.BPTT step | fits | plan | plan step '
           '| epochs | train s |', '|' + '---|' * 11]
  for r in rows:
    accuracies = r['test_accuracy'] if isinstance(r['test_accuracy'], list) else [r['test_accuracy']]
    accuracy = ', '.join(f'{a:.3f}' for a in accuracies)
    seconds = r['train_seconds'] if isinstance(r['train_seconds'], list) else [r['train_seconds']]
    lines.append(f"| {r['model']} | {r['trainer']} | {accuracy} | {r['batch']} | {format_memory(r['memory_budget'])} "
                 f"| {format_memory(r['bptt_step_bytes'])} | {'yes' if r['bptt_step_fits_budget'] else 'no'} "
                 f"| {r['plan']} | {format_memory(r['accum_step_bytes'])} | {r['epochs']} | {', '.join(f'{t:.0f}' for t in seconds)} |")
  return '\n'.join(lines)


def _merge_seeds(rows: Sequence[dict]) -> dict:
  """One row for several seeds of the same model: accuracies and times as lists, their mean and spread."""
  if len(rows) == 1:
    return dict(rows[0])
  merged = dict(rows[0])
  for key in ('seed', 'test_accuracy', 'train_seconds', 'train_accuracy_per_epoch', 'train_loss_per_epoch'):
    merged[key] = [r[key] for r in rows]
  accuracies = np.asarray(merged['test_accuracy'])
  merged.update(mean_test_accuracy=float(accuracies.mean()), std_test_accuracy=float(accuracies.std(ddof=1)),
                min_test_accuracy=float(accuracies.min()), max_test_accuracy=float(accuracies.max()))
  return merged


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f'{value} must be a positive integer.')
  return value


def _seed(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f'seed {value} must be a non-negative integer.')
  return value


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.recipes.mnist1d', description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', nargs='+', type=_seed, default=[0], help='seeds to train (default: 0)')
  parser.add_argument('--models', nargs='*', choices=sorted(MODELS), default=list(MODELS),
                      help='networks to train (default: both; none with --rate-regulariser for that row alone)')
  parser.add_argument('--rate-regulariser', action='store_true',
                      help='add the recurrent network with a batch-wide rate regulariser (whole_batch_loss=True)')
  parser.add_argument('--epochs', type=_positive_int, default=None, help="shorten every run (default: each model's own)")
  parser.add_argument('--train-size', type=_positive_int, default=None,
                      help='train on the first N training signals only (a smoke run; default: all 4000)')
  parser.add_argument('--out', default=None, help='write the rows as JSON to this file')
  args = parser.parse_args([str(a) for a in (sys.argv[1:] if argv is None else argv)])
  if not args.models and not args.rate_regulariser:
    parser.error('--models with no model needs --rate-regulariser (otherwise there is nothing to train).')
  data = load_mnist1d()
  options = dict(epochs=args.epochs, train_size=args.train_size)
  rows = [_merge_seeds([train(MODELS[name], data, seed, **options).row for seed in args.seeds]) for name in args.models]
  if args.rate_regulariser:  # the first seed only: it trains the network again and runs the default mode beside it
    rows.append(rate_regulariser_row(MODELS['recurrent'], data, args.seeds[0], **options))
  if args.out:  # before printing: a run of many minutes must not be lost to the table
    with open(args.out, 'w') as f:
      json.dump(rows, f, indent=1)
  print(format_table(rows))
  print('MNIST-1D paper (Greydanus & Kobak), test accuracy: '
        + ', '.join(f'{name} {accuracy:.0%}' for name, accuracy in PAPER.items()))
  return rows


if __name__ == '__main__':
  main()
