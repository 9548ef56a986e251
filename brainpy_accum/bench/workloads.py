"""The benchmarked networks, in BrainPy and in plain JAX, and their random batches."""

from typing import NamedTuple

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['Shape', 'RateRNN', 'SpikingRNN', 'WORKLOADS', 'last_step_only', 'make_brainpy_model', 'make_batch',
           'jax_params', 'jax_loss']


class Shape(NamedTuple):
  batch: int
  time: int
  hidden: int
  inputs: int
  outputs: int = 10


class RateRNN(bp.DynamicalSystem):
  """tanh RNN cell and a linear read-out at every step."""

  def __init__(self, shape: Shape):
    super().__init__()
    self.cell = bp.dyn.RNNCell(shape.inputs, shape.hidden)
    self.readout = bp.dnn.Dense(shape.hidden, shape.outputs)

  def update(self, x):
    return self.readout(self.cell(x))


class SpikingRNN(bp.DynamicalSystem):
  """Recurrent LIF population (arctan surrogate gradient) and a linear read-out at every step."""

  def __init__(self, shape: Shape):
    super().__init__()
    self.i2h = bp.dnn.Dense(shape.inputs, shape.hidden)
    self.h2h = bp.dnn.Dense(shape.hidden, shape.hidden, b_initializer=None)
    self.lif = bp.dyn.Lif(shape.hidden, V_rest=0., V_reset=0., V_th=1., tau=5.,
                          spk_fun=bm.surrogate.Arctan())
    self.readout = bp.dnn.Dense(shape.hidden, shape.outputs)

  def update(self, x):
    return self.readout(self.lif(self.i2h(x) + self.h2h(self.lif.spike.value)))


WORKLOADS = ('rnn', 'snn', 'rnn_ce', 'snn_ce')  # '_ce': cross-entropy of the last step's read-out, class labels


def last_step_only(workload: str) -> bool:
  """Whether ``workload``'s loss is the cross-entropy of the last step's read-out (the read-out still runs at
  every step, in BrainPy and in plain JAX alike)."""
  return workload.endswith('_ce')


def make_brainpy_model(workload: str, shape: Shape, seed: int = 0) -> bp.DynamicalSystem:
  bm.random.seed(seed)
  with bm.training_environment():
    return {'rnn': RateRNN, 'snn': SpikingRNN}[workload.replace('_ce', '')](shape)


def make_batch(shape: Shape, seed: int = 0, abstract: bool = False, workload: str = 'rnn'):
  """Random ``(batch, time, inputs)`` inputs and ``(batch, time, outputs)`` targets, float32 (``'_ce'``
  workloads: ``(batch,)`` int32 class labels).

  With ``abstract=True``, ``jax.ShapeDtypeStruct`` placeholders for compiling ahead of time.
  """
  labels = last_step_only(workload)
  if abstract:
    return (jax.ShapeDtypeStruct((shape.batch, shape.time, shape.inputs), jnp.float32),
            jax.ShapeDtypeStruct((shape.batch,), jnp.int32) if labels else
            jax.ShapeDtypeStruct((shape.batch, shape.time, shape.outputs), jnp.float32))
  rng = np.random.default_rng(seed)  # float32 drawn as such: a batch of 65,536 x 500 x 128 is 16.8 GB
  x = rng.random((shape.batch, shape.time, shape.inputs), dtype=np.float32)
  if labels:
    return x, rng.integers(0, shape.outputs, shape.batch).astype('int32')
  y = rng.random((shape.batch, shape.time, shape.outputs), dtype=np.float32)
  return x, y


def jax_params(shape: Shape, seed: int = 0) -> dict:
  rng = np.random.RandomState(seed)
  scale = lambda n: 1. / np.sqrt(n)
  return {'wi': jnp.asarray(rng.randn(shape.inputs, shape.hidden) * scale(shape.inputs), jnp.float32),
          'wh': jnp.asarray(rng.randn(shape.hidden, shape.hidden) * scale(shape.hidden), jnp.float32),
          'b': jnp.zeros(shape.hidden, jnp.float32),
          'wo': jnp.asarray(rng.randn(shape.hidden, shape.outputs) * scale(shape.hidden), jnp.float32),
          'bo': jnp.zeros(shape.outputs, jnp.float32)}


@jax.custom_jvp
def _spike(v):
  return (v >= 0.).astype(v.dtype)


@_spike.defjvp
def _spike_jvp(primals, tangents):
  v, = primals
  surrogate = 1. / (1. + (jnp.pi * v) ** 2)  # arctan surrogate, as bm.surrogate.Arctan(alpha=2)
  return _spike(v), surrogate * tangents[0]


def _rnn_step(params, h, x):
  h = jnp.tanh(x @ params['wi'] + h @ params['wh'] + params['b'])
  return h, h @ params['wo'] + params['bo']


def _snn_step(params, carry, x, dt=0.1, tau=5.):
  v, s = carry
  v = v + (-v + x @ params['wi'] + params['b'] + s @ params['wh']) * (dt / tau)
  s = _spike(v - 1.)
  v = v * (1. - jax.lax.stop_gradient(s))
  return (v, s), s @ params['wo'] + params['bo']


def jax_loss(workload: str, params, x, y):
  """Mean-squared error of a batch ``x`` (batch, time, inputs) run with ``lax.scan`` over time (``'_ce'``:
  cross-entropy of the last step's read-out with the labels ``y``)."""
  batch, hidden = x.shape[0], params['wh'].shape[0]
  if workload.startswith('rnn'):
    step, carry = _rnn_step, jnp.zeros((batch, hidden))
  else:
    step, carry = _snn_step, (jnp.zeros((batch, hidden)), jnp.zeros((batch, hidden)))
  _, outs = jax.lax.scan(lambda c, xt: step(params, c, xt), carry, jnp.swapaxes(x, 0, 1))
  if last_step_only(workload):
    log_p = jax.nn.log_softmax(outs[-1])
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))
  return jnp.mean((outs - jnp.swapaxes(y, 0, 1)) ** 2)
