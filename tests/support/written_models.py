"""Models that write their own weights or records inside ``update``, for the tests against bp.BPTT
(``tests/trainer/test_written_state.py``) and the figures of ``written_state_figures.py``."""

import brainpy as bp
import brainpy.math as bm
import numpy as np

W0 = [[0.5, -0.3, 0.2], [-0.1, 0.4, -0.6]]  # the layer


class WrittenLayer(bp.DynamicalSystem):
  """``x @ W`` over time whose ``update`` first writes ``W`` (``kind``), counts its time steps and, for
  ``'record'``, records sample 0's output in a Variable without a batch axis."""

  def __init__(self, kind: str):
    super().__init__()
    self.kind = kind
    self.W = bm.TrainVar(bm.asarray(W0))
    self.inhibitory = bm.asarray([[False], [True]])  # Dale's law: input 0 excites, input 1 inhibits
    self.absent = bm.asarray([[False, True, False], [True, False, False]])  # connections that do not exist
    self.record = bm.Variable(bm.zeros(3))
    self.steps = bm.Variable(bm.zeros((), 'int32'))

  def update(self, x):
    w = self.W.value
    if self.kind == 'clip':
      w = bm.where(w < 0, 0., w)
    elif self.kind == 'dale':
      w = bm.where(self.inhibitory, -bm.relu(-w), bm.relu(w))
    elif self.kind == 'mask':
      w = bm.where(self.absent, 0., w)
    elif self.kind == 'rescale':  # each unit's incoming weights to unit norm
      w = w / bm.sqrt(bm.sum(w ** 2, axis=0, keepdims=True))
    elif self.kind == 'hebb':  # a Hebbian term of the batch: depends on the data
      w = w + 0.1 * (x.T @ (x @ w)) / x.shape[0]
    self.W.value = w
    out = x @ self.W.value
    if self.kind == 'record':
      self.record.value = out[0]
    self.steps.value += 1
    return out


def dale(w, n_in: int):
  """Dale's law as published E/I networks write it in ``update``: the weights of the excitatory inputs (the
  first four fifths) that are negative and those of the inhibitory inputs (the rest) that are positive, masked
  to 0: ``bm.where(mask, 0, w)``."""
  sign = bm.where(bm.arange(n_in)[:, None] < n_in - max(1, n_in // 5), 1., -1.)
  return bm.where(sign * w < 0, 0., w)


class EILayer(bp.DynamicalSystem):
  """LIF neurons driven by ``x @ W``, whose ``update`` masks ``W`` by Dale's law at every step."""

  def __init__(self, n_in: int, n_out: int, scale: float = 4.):
    super().__init__()
    self.W = bm.TrainVar(bp.init.KaimingNormal(scale=scale)((n_in, n_out)))
    self.lif = bp.dyn.Lif(n_out, V_rest=0., V_reset=0., V_th=1., tau=2., spk_fun=bm.surrogate.Arctan())

  def update(self, x):
    self.W.value = dale(self.W.value, self.W.shape[0])
    return self.lif(x @ self.W.value)


class EINetwork(bp.DynamicalSystem):
  """Four E/I LIF layers and a linear read-out, all masked by Dale's law: five layers written in ``update``."""

  def __init__(self, sizes=(2, 8, 8, 8, 8), n_out=3, scale=4.):
    super().__init__()
    self.layers = bm.NodeList([EILayer(a, b, scale) for a, b in zip(sizes[:-1], sizes[1:])])
    self.out = bm.TrainVar(bp.init.KaimingNormal()((sizes[-1], n_out)))

  def update(self, x):
    for layer in self.layers:
      x = layer(x)
    self.out.value = dale(self.out.value, self.out.shape[0])
    return x @ self.out.value
