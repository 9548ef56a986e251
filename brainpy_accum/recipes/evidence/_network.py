"""e-prop's network and loss for the evidence-accumulation task: :class:`EvidenceSNN` (LIF and ALIF neurons with
e-prop's refractoriness, a leaky read-out), :func:`recall_loss` and the constants of :data:`RECIPE`."""

import functools
import math
from typing import NamedTuple

import brainpy as bp
import brainpy.math as bm
from brainpy.context import share
import jax
import numpy as np

from ...core import batch_mean

__all__ = ['DT', 'Recipe', 'RECIPE', 'RefractoryALIF', 'EvidenceSNN', 'recall_loss']

DT = 1.  # ms per step, as in e-prop and BrainPy's figure4A.py


class Recipe(NamedTuple):
  """The network's and the training's constants, each where e-prop's tutorial has it (``IGITUGraz/
  eligibility_propagation``, ``tutorial_evidence_accumulation_with_alif.py`` and its ``models.py``)."""
  tau_v: float = 20.          # ms, membrane time constant (flag tau_v)
  tau_a: float = 2000.        # ms, adaptation time constant (flag tau_a)
  tau_out: float = 20.        # ms, read-out filter (flag tau_out)
  v_th: float = 0.6           # threshold (flag thr); the reset subtracts it
  tau_ref: float = 5.         # ms of refractoriness (flag n_ref)
  dampening: float = 0.3      # pseudo-derivative 0.3 * max(0, 1 - |v_scaled|) (flag dampening_factor)
  adaptive_fraction: float = 0.5  # 50 LIF + 50 ALIF neurons
  rate_target: float = 0.01   # spikes per ms: 10 Hz (flag reg_rate)
  rate_weight: float = 1.     # regulariser coefficient (flag reg_f)
  lr: float = 0.005           # Adam's learning rate (flag learning_rate), constant, at e-prop's width:
  lr_width: int = 100         # the recurrent neurons e-prop's learning rate was set for (lr_at scales it)

  @property
  def beta(self) -> float:
    """The adaptive neurons' threshold increase per spike, e-prop's ``beta_a = 1.7 (1 - rho) / (1 - alpha)``
    (``rho = exp(-dt / tau_a)``, ``alpha = exp(-dt / tau_v)``): 0.0174."""
    return 1.7 * (1 - math.exp(-DT / self.tau_a)) / (1 - math.exp(-DT / self.tau_v))

  def lr_at(self, neurons: int) -> float:
    """Adam's learning rate for a network of ``neurons`` recurrent neurons: e-prop's ``lr`` at its ``lr_width``
    (100), scaled as ``lr_width / neurons``.

    Adam moves every weight by about the learning rate per update, whatever its gradient's size, so the change of
    a neuron's input per update grows with the number of weights feeding it: at 1,024 neurons, e-prop's 0.005
    moves each recurrent input ten times as far as at 100, and the run diverges (docs/evidence.md measures it).
    Dividing by the width keeps that change at e-prop's.

    Examples
    --------
    >>> from brainpy_accum.recipes.evidence import RECIPE
    >>> RECIPE.lr_at(100), round(RECIPE.lr_at(1024), 8)
    (0.005, 0.00048828)
    """
    if not isinstance(neurons, int) or isinstance(neurons, bool) or neurons < 1:
      raise ValueError(f'neurons={neurons!r}: the learning rate is scaled by a positive number of neurons.')
    return self.lr * self.lr_width / neurons


RECIPE = Recipe()


class RefractoryALIF(bp.neurons.ALIFBellec2020):
  """``bp.neurons.ALIFBellec2020`` with e-prop's refractoriness: within ``tau_ref`` of its last spike a neuron
  does not spike, and no gradient flows through the spike it did not emit; its potential integrates on.

  BrainPy's neuron holds the potential during the refractory period but still spikes whenever the held value
  is above threshold, and its surrogate gradient flows through those spikes: with BPTT, on short trials of this
  task, the gradient's norm grew from 0.02 to 1e7 within 80 updates; with e-prop's refractoriness it stayed under
  0.5 (``docs/evidence.md``). The smallest interval between two spikes is ``tau_ref`` (5 steps, e-prop's).
  """

  def update(self, x=None):
    t, dt = share.load('t'), share.load('dt')
    V, a = self.integral(self.V.value, self.a.value, t, 0. if x is None else x, dt)
    refractory = jax.lax.stop_gradient((t - self.t_last_spike.value) < self.tau_ref)
    spike = bm.where(refractory, 0., self.spike_fun((V - self.V_th - self.beta * self.a) / self.V_th))
    self.t_last_spike.value = jax.lax.stop_gradient(bm.where(spike > 0., t, self.t_last_spike.value))
    self.refractory.value = refractory
    self.spike.value = spike
    self.V.value = V - self.V_th * spike
    self.a.value = a + spike  # the next step's threshold counts this spike, as e-prop's b does
    return spike


class EvidenceSNN(bp.DynamicalSystem):
  """e-prop's LIF/ALIF network in BrainPy's parts: :class:`RefractoryALIF` neurons and a leaky read-out.

  Each step, with ``alpha = exp(-dt / tau_v)``::

    V <- alpha V + W_in x + W_rec z_prev             (no self-connections)
    z  = H((V - v_th - beta a) / v_th)                (pseudo-derivative: dampening * max(0, 1 - |.|))
    V <- V - v_th z;  a <- rho a + z;  no spike within 5 ms of the last
    y <- kappa y + (1 - kappa) W_out z                (the read-out, kappa = exp(-dt / tau_out))

  ``beta`` is 0 for the first half of the ``num_rec`` neurons (LIF) and :attr:`Recipe.beta` for the rest (ALIF).
  BrainPy's neuron integrates ``tau dV/dt = -V + I`` exactly over a step, which multiplies ``I`` by ``1 - alpha``;
  the currents are divided by it, so that the weights are e-prop's: ``N(0, 1 / fan_in)`` input and recurrent
  weights, a Glorot-uniform read-out, no biases.
  """

  def __init__(self, num_in: int = 100, num_rec: int = 100, num_out: int = 2, recipe: Recipe = RECIPE):
    super().__init__()
    alpha = math.exp(-DT / recipe.tau_v)
    n_regular = num_rec - round(num_rec * recipe.adaptive_fraction)
    beta = np.concatenate([np.zeros(n_regular), np.full(num_rec - n_regular, recipe.beta)]).astype(np.float32)
    self.i2r = bp.dnn.Linear(num_in, num_rec, W_initializer=bp.init.Normal(scale=1 / math.sqrt(num_in)),
                             b_initializer=None)
    self.w_rec = bm.TrainVar(bm.random.normal(size=(num_rec, num_rec)) / math.sqrt(num_rec))
    self.no_autapse = bm.asarray(1. - np.eye(num_rec, dtype=np.float32))
    self.alif = RefractoryALIF(
      num_rec, V_rest=0., V_th=recipe.v_th, tau=recipe.tau_v, tau_a=recipe.tau_a, beta=beta,
      tau_ref=recipe.tau_ref, input_var=False, V_initializer=bp.init.ZeroInit(), a_initializer=bp.init.ZeroInit(),
      spike_fun=functools.partial(bm.surrogate.relu_grad, alpha=recipe.dampening, width=1.))
    self.r2o = bp.dnn.Linear(num_rec, num_out, W_initializer=bp.init.XavierUniform(), b_initializer=None)
    self.out = bp.dyn.Leaky(num_out, tau=recipe.tau_out)
    self.current_gain = 1. / (1. - alpha)
    self.out_gain = 1. - math.exp(-DT / recipe.tau_out)

  def update(self, x):
    recurrent = self.alif.spike.value @ (self.w_rec * self.no_autapse)
    spikes = self.alif((self.i2r(x) + recurrent) * self.current_gain)
    return self.out(self.r2o(spikes) * self.out_gain)


def recall_loss(predicts, labels, *, window: int, recipe: Recipe = RECIPE):
  """e-prop's loss: the cross-entropy of the read-out at each of the last ``window`` steps (the recall), averaged,
  plus ``rate_weight * sum over neurons of (mean over batch and time of its spikes / dt - f0)^2``, whose mean over
  the batch couples the samples: it is a batch statistic (:func:`~brainpy_accum.batch_mean`, ``bm.mean`` under
  ``bp.BPTT``), which ``AccumBPTT``'s micro-batches see whole. Metrics: ``acc`` (the argmax of the
  read-out averaged over the window), ``ce``, ``reg`` and ``rate_hz``."""
  out, monitors = predicts
  logits = out[:, -window:]
  ce = bp.losses.cross_entropy_loss(logits, bm.repeat(labels[:, None], window, axis=1))
  rate = batch_mean(monitors['spike'], axis=(0, 1), name='rate') / DT
  reg = recipe.rate_weight * bm.sum((rate - recipe.rate_target) ** 2)
  accuracy = bm.mean(bm.argmax(bm.mean(logits, axis=1), axis=-1) == labels)
  return ce + reg, {'acc': accuracy, 'ce': ce, 'reg': reg, 'rate_hz': bm.mean(rate) * 1000. / DT}
