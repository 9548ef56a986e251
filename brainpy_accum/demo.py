"""Train a recurrent network on scikit-learn's handwritten digits with ``AccumBPTT``.

Each 8x8 image is read row by row as a sequence of 8 time steps with 8
inputs; a GRU reads the rows and a linear read-out classifies the last step.
The dataset ships inside scikit-learn, so nothing is downloaded. The demo
prints the test accuracy it reached and the compiled train step's memory
(XLA's compile-time analysis) for ``bp.BPTT`` and for ``AccumBPTT``.

Run it with ``python -m brainpy_accum.demo`` (``--help`` for options).
"""

import argparse
import importlib.util
import itertools
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

import brainpy as bp
import brainpy.math as bm
import numpy as np

from .trainer import AccumBPTT

__all__ = ['DigitsRNN', 'load_digits_sequences', 'train_step_memory', 'main']


class DigitsRNN(bp.DynamicalSystem):
  """GRU over the image rows, linear read-out of the class scores at each step."""

  def __init__(self, num_in: int = 8, num_hidden: int = 128, num_class: int = 10):
    super().__init__()
    self.gru = bp.dyn.GRUCell(num_in, num_hidden)
    self.readout = bp.dnn.Dense(num_hidden, num_class)

  def update(self, x):
    return self.readout(self.gru(x))


class Split(NamedTuple):
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load_digits_sequences(test_fraction: float = 0.25, seed: int = 0) -> Split:
  """scikit-learn's 1,797 digits as (sample, row, column) sequences in [0, 1], split at random."""
  from sklearn.datasets import load_digits
  digits = load_digits()
  x = (digits.images / 16.).astype('float32')
  y = digits.target.astype('int32')
  order = np.random.RandomState(seed).permutation(len(x))
  n_test = int(len(x) * test_fraction)
  test, train = order[:n_test], order[n_test:]
  return Split(x[train], y[train], x[test], y[test])


def last_step_cross_entropy(predicts, targets):
  """Cross-entropy of the last step's scores, with the accuracy as an auxiliary metric."""
  logits = predicts[:, -1]
  accuracy = bm.mean(bm.argmax(logits, axis=-1) == targets)
  return bp.losses.cross_entropy_loss(logits, targets), {'acc': accuracy}


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: Optional[int] = None) -> List[Tuple]:
  """Consecutive (inputs, labels) batches, shuffled when ``seed`` is given; the last one may be short."""
  order = np.arange(len(x)) if seed is None else np.random.RandomState(seed).permutation(len(x))
  return [(x[order[i:i + batch_size]], y[order[i:i + batch_size]]) for i in range(0, len(x), batch_size)]


def train_step_memory(trainer: bp.BPTT, inputs, targets) -> int:
  """Bytes of working memory (XLA temp buffers) of ``trainer``'s compiled train step on one batch."""
  trainer.target.reset(len(inputs))
  compiled = trainer.f_train.compile(bp.tools.DotDict(fit=True), inputs, targets)
  return compiled.memory_analysis().temp_size_in_bytes


def _trainer(cls, seed: int, lr: float, **kwargs):
  bm.random.seed(seed)
  with bm.training_environment():
    model = DigitsRNN()
  return cls(model, last_step_cross_entropy, optimizer=bp.optim.Adam(lr=lr), loss_has_aux=True, **kwargs)


def _plot(path: str, trainer, memory: dict) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  axes[0].plot(trainer.get_hist_metric('fit', 'loss'), label='train')
  axes[0].plot(trainer.get_hist_metric('test', 'loss'), label='test')
  axes[0].set(xlabel='epoch', ylabel='cross-entropy', title='Loss')
  axes[1].plot(trainer.get_hist_metric('fit', 'acc'), label='train')
  axes[1].plot(trainer.get_hist_metric('test', 'acc'), label='test')
  axes[1].set(xlabel='epoch', ylabel='accuracy', title='Accuracy')
  for ax in axes[:2]:
    ax.legend()
  axes[2].bar(list(memory), [v / 2 ** 20 for v in memory.values()], color=['grey', 'tab:blue'])
  axes[2].set(ylabel='MiB', title='Train-step working memory (XLA)')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


INSTALL_DEMO = 'pip install "brainpy-accum[demo]"  (from a clone of the repository: pip install ".[demo]")'


def missing_modules(names: Sequence[str]) -> List[str]:
  """The modules among ``names`` that cannot be imported here."""
  return [name for name in names if importlib.util.find_spec(name) is None]


def main(argv: Optional[Sequence[str]] = None) -> float:
  """Run the demo; return the test accuracy reached.

  Raises
  ------
  SystemExit
    Without scikit-learn (the dataset ships in it), naming the command that installs it.
  """
  parser = argparse.ArgumentParser(prog='python -m brainpy_accum.demo', description=__doc__.split('\n')[0])
  parser.add_argument('--epochs', type=int, default=30)
  parser.add_argument('--batch-size', type=int, default=256)
  parser.add_argument('--num-micro-batch', type=int, default=4)
  parser.add_argument('--lr', type=float, default=5e-3)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--plot', default='demo_digits.png', help="PNG of the curves and memory ('' for none)")
  args = parser.parse_args(argv)
  if missing_modules(['sklearn']):
    raise SystemExit(f'The demo trains on the handwritten digits that ship with scikit-learn, which is not '
                     f'installed. Install the demo extras:\n  {INSTALL_DEMO}')
  if args.plot and missing_modules(['matplotlib']):
    print(f'matplotlib is not installed, so no plot will be written; for the plot: {INSTALL_DEMO}')
    args.plot = ''

  data = load_digits_sequences(seed=args.seed)
  print(f'digits: {len(data.x_train)} train / {len(data.x_test)} test sequences of 8 rows x 8 pixels; '
        f'batch {args.batch_size} in {args.num_micro_batch} micro-batches')
  trainer = _trainer(AccumBPTT, args.seed, args.lr, num_micro_batch=args.num_micro_batch)
  test_batches = batches(data.x_test, data.y_test, args.batch_size)
  start = time.time()
  epoch_seeds = itertools.count(args.seed)  # a new, reproducible shuffle every epoch
  trainer.fit(lambda: batches(data.x_train, data.y_train, args.batch_size, seed=next(epoch_seeds)),
              test_data=test_batches, num_epoch=args.epochs)
  logits = trainer.predict(data.x_test, reset_state=True)[:, -1]
  accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == data.y_test))
  print(f'trained {args.epochs} epochs in {time.time() - start:.1f} s; '
        f'test accuracy {accuracy:.4f} on {len(data.y_test)} held-out digits')

  x, y = data.x_train[:args.batch_size], data.y_train[:args.batch_size]
  memory = {'bp.BPTT': train_step_memory(_trainer(bp.BPTT, args.seed, args.lr), x, y),
            f'AccumBPTT N={args.num_micro_batch}': train_step_memory(trainer, x, y)}
  print(f'train-step working memory at batch {args.batch_size} (XLA compile-time analysis):')
  for name, size in memory.items():
    print(f'  {name:<16} {size / 2 ** 20:8.2f} MiB')
  ratio = memory[f'AccumBPTT N={args.num_micro_batch}'] / memory['bp.BPTT']
  print(f'  ratio {ratio:.2f}')
  if args.plot:
    _plot(args.plot, trainer, memory)
    print(f'curves and memory written to {args.plot}')
  return accuracy


if __name__ == '__main__':
  main()
