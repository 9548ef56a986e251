"""The figures of the guide's "Models that write their own state": AccumBPTT against bp.BPTT, one update.

``python tests/support/written_state_figures.py`` prints

- the issue's layer (``W`` clipped to its non-negative entries in ``update``, batch 8 of seed-1 ``randn``, SGD
  with lr 1): ``W`` after one step under bp.BPTT and AccumBPTT at ``num_micro_batch`` 1, 2, 3 and ``'auto'``;
- a five-layer E/I LIF network whose ``update`` masks its weights by Dale's law (four LIF layers of 64 and a
  read-out of 10, Kaiming-normal weights at scale 8, 50 time steps of inputs spiking at rate 0.5, batch 32, Adam
  with lr 1e-3): the relative L2 distance of all parameters from
  bp.BPTT's after one update, at ``num_micro_batch`` 2 and 4 and with ``whole_batch_loss=True``, and the largest
  magnitude that a weight masked at the start (bp.BPTT keeps it at exactly 0) ends with.

Run it on another checkout (``PYTHONPATH=that/checkout``) to compare with the code there.
"""

import pathlib
import sys
import warnings

import brainpy as bp
import brainpy.math as bm
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import step_bytes  # noqa: E402
from written_models import EINetwork, WrittenLayer, dale  # noqa: E402

import brainpy_accum  # noqa: E402
from brainpy_accum import AccumBPTT  # noqa: E402


def _fit(model, trainer_cls, optimizer, batches, **options):
  trainer = trainer_cls(model, bp.losses.mean_squared_error, optimizer=optimizer, progress_bar=False, **options)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    trainer.fit(batches, num_epoch=1)
  return [np.asarray(v.value) for v in model.train_vars().unique().values()]


def issue_layer() -> None:
  rng = np.random.RandomState(1)
  x, y = rng.randn(8, 5, 2).astype('float32'), rng.randn(8, 5, 3).astype('float32')
  with bm.training_environment():  # 'auto' within a budget between the steps of micro-batches of 1 and 2 samples
    probe = AccumBPTT(WrittenLayer('clip'), 'mean_squared_error', num_micro_batch='auto', memory_budget='1GiB')
  budget = (step_bytes(probe, x, y, 8, 1, False) + step_bytes(probe, x, y, 8, 2, False)) // 2
  for name, cls, options in [('bp.BPTT', bp.BPTT, {}), *[(f'AccumBPTT num_micro_batch={n!r}', AccumBPTT,
                             dict(num_micro_batch=n, cache=False, **({'memory_budget': budget} if n == 'auto' else {})))
                             for n in (1, 2, 3, 'auto')]]:
    with bm.training_environment():
      model = WrittenLayer('clip')
    (w,) = _fit(model, cls, bp.optim.SGD(lr=1.), [(x, y)], **options)
    print(f'  {name:36s} W = {np.array2string(w, precision=4, suppress_small=True, separator=", ")}'.replace('\n', ''))


def _network():
  bm.random.seed(0)
  with bm.training_environment():
    return EINetwork(sizes=(20, 64, 64, 64, 64), n_out=10, scale=8.)


def ei_network() -> None:
  rng = np.random.RandomState(0)
  batches = [((rng.rand(32, 50, 20) < 0.5).astype('float32'), rng.randn(32, 50, 10).astype('float32'))]
  start = [np.asarray(v.value) for v in _network().train_vars().unique().values()]
  masked = [np.asarray(dale(w, len(w))) == 0. for w in start]
  expected = _fit(_network(), bp.BPTT, bp.optim.Adam(lr=1e-3), batches)
  reference = np.concatenate([p.ravel() for p in expected])
  print(f'  masked at the start: {sum(m.sum() for m in masked)} of {sum(m.size for m in masked)} weights; bp.BPTT '
        f'keeps them at {max(np.abs(p[m]).max() for p, m in zip(expected, masked)):.1e}')
  for name, options in [('num_micro_batch=2', dict(num_micro_batch=2)), ('num_micro_batch=4', dict(num_micro_batch=4)),
                        ('num_micro_batch=4, whole_batch_loss=True', dict(num_micro_batch=4, whole_batch_loss=True))]:
    params = _fit(_network(), AccumBPTT, bp.optim.Adam(lr=1e-3), batches, cache=False, **options)
    distance = np.linalg.norm(np.concatenate([p.ravel() for p in params]) - reference) / np.linalg.norm(reference)
    leak = max(np.abs(p[m]).max() for p, m in zip(params, masked))
    print(f'  {name:42s} relative distance {distance:.1e}, largest masked weight {leak:.1e}')


if __name__ == '__main__':
  print(f'brainpy_accum from {pathlib.Path(brainpy_accum.__file__).parent}')
  print("The issue's layer, W after one SGD step (lr 1):")
  issue_layer()
  print("A five-layer E/I LIF network masked by Dale's law in update, after one Adam step (lr 1e-3):")
  ei_network()
