"""What ``micro_batched_grad`` says, and puts back, when a model state stops the cut (core/_states.py), and
the batch-statistic warning: each against brainstate's whole-batch gradient of the same states."""

import re

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brainpy_accum import micro_batched_grad
from helpers import assert_trees_close

B, I, H = 10, 3, 8


def data(*shape, seed=0):
  return jnp.asarray(np.random.RandomState(seed).rand(*shape), jnp.float32)


def test_an_error_in_the_micro_batches_leaves_every_state_as_before():
  """A refusal raised while the micro-batches are traced (here a per-sample aux leaf) used to leave the batched
  HiddenState at the first micro-batch's 4 rows, and the corrected call then failed on its shapes."""
  w, h = brainstate.ParamState(data(I, H, seed=1)), brainstate.HiddenState(data(B, H, seed=2))
  count = brainstate.ShortTermState(jnp.zeros(()))
  start = h.value

  def loss(x, aux=lambda h: jnp.mean(h)):
    h.value = jnp.tanh(x @ w.value + h.value)
    count.value = count.value + 1
    return jnp.mean(h.value ** 2), aux(h.value)

  x = data(B, I, seed=3)
  per_sample = lambda x: loss(x, lambda h: h.sum(1))  # noqa: E731
  with pytest.raises(ValueError, match='aux leaf must keep its shape'):
    micro_batched_grad(per_sample, {'w': w}, num_micro_batch=3, has_aux=True)(x)
  assert h.value.shape == (B, H) and np.array_equal(h.value, start) and float(count.value) == 0
  grads, aux = micro_batched_grad(loss, {'w': w}, num_micro_batch=3, has_aux=True)(x)
  after, h.value, count.value = h.value, start, jnp.zeros(())
  assert_trees_close((grads, aux, after), (*brainstate.transform.grad(loss, {'w': w}, has_aux=True)(x), h.value))


@pytest.mark.parametrize('kind, shape, axis', [('short', (B,), 0), ('plain', (B, H), 0), ('delay', (4, B, H), 1)])
@pytest.mark.parametrize('n', [3, 5])
def test_a_per_sample_state_left_whole_is_named_with_its_axis(kind, shape, axis, n):
  """A per-sample state the rule leaves whole (a plain ShortTermState of (B,), a plain State of (B, H), a delay line
  with the samples on axis 1) failed deep in JAX (a cond's branches differ, shapes that do not broadcast). The
  error names it, its axis and the states= that cuts it; the states are as before; that states= is exact."""
  w, h = brainstate.ParamState(data(I, H, seed=1)), brainstate.HiddenState(data(B, H, seed=2))
  other = (brainstate.ShortTermState if kind != 'plain' else brainstate.State)(data(*shape, seed=4))
  start = (h.value, other.value)

  def loss(x):
    h.value = jnp.tanh(x @ w.value + h.value)
    if kind == 'delay':  # a delay line: the oldest step out, this one in
      other.value = jnp.concatenate([other.value[1:], h.value[None]], axis=0)
      drive = other.value[0]
    else:
      other.value = 0.5 * other.value + (h.value.mean(1) if kind == 'short' else h.value)
      drive = other.value
    return jnp.mean(h.value ** 2) + jnp.mean(drive ** 2)

  x = data(B, I, seed=3)
  with pytest.raises(ValueError, match=rf'{type(other).__name__}\(shape={re.escape(str(shape))}\) \(axis {axis}\).*'
                                       rf'states=\[\(HiddenState.*, 0\), \({type(other).__name__}.*, {axis}\)\]'):
    micro_batched_grad(loss, {'w': w}, num_micro_batch=n)(x)
  assert all(np.array_equal(a, b) for a, b in zip((h.value, other.value), start))
  grads = micro_batched_grad(loss, {'w': w}, num_micro_batch=n, states=[(h, 0), (other, axis)])(x)
  after = (h.value, other.value)
  h.value, other.value = start
  assert_trees_close((grads, after), (brainstate.transform.grad(loss, {'w': w})(x), (h.value, other.value)))


def test_a_gradient_with_respect_to_a_batched_state_is_refused_by_name():
  """A HiddenState in grad_states failed with shapes that do not add; one micro-batch still gives brainstate's."""
  w, h0 = brainstate.ParamState(data(I, H, seed=1)), brainstate.HiddenState(data(B, H, seed=2))

  def loss(x):
    return jnp.mean(jnp.tanh(x @ w.value + h0.value) ** 2)

  x, start = data(B, I, seed=3), h0.value
  with pytest.raises(ValueError, match=r"grad_states\['h0'\] holds the batch \(shape \(10, 8\), samples on axis 0\)"
                                       r".*ParamState of one row"):
    micro_batched_grad(loss, {'w': w, 'h0': h0}, num_micro_batch=3)(x)
  assert np.array_equal(h0.value, start)
  whole = brainstate.transform.grad(loss, {'w': w, 'h0': h0})(x)
  assert_trees_close(micro_batched_grad(loss, {'w': w, 'h0': h0}, num_micro_batch=1)(x), whole)


def test_a_tuple_loss_without_has_aux_names_has_aux():
  w = brainstate.ParamState(data(I, H, seed=1))
  with pytest.raises(TypeError, match=r'returned a tuple, not a scalar loss: set has_aux=True'):
    micro_batched_grad(lambda x: (jnp.mean(x @ w.value), {}), {'w': w}, num_micro_batch=2)(data(B, I))


def test_batch_normalisation_with_running_statistics_warns_of_the_gradient():
  """BatchNorm in training normalises each micro-batch by its own statistics: the gradient differs from the whole
  batch's (measured here, so that the warning is not about nothing), and the warning says so."""
  brainstate.random.seed(0)
  l1, bn = brainstate.nn.Linear(I, H), brainstate.nn.BatchNorm0d(H)
  params = l1.states(brainstate.ParamState)

  def loss(x):
    return jnp.mean(jax.nn.relu(bn(l1(x))) ** 2)

  x = data(12, I, seed=3)
  with brainstate.environ.context(fit=True):
    with pytest.warns(UserWarning, match=r'batch statistic \(a BatchState.*each micro-batch by its own statistics.*'
                                         r'LayerNorm'):
      micro = micro_batched_grad(loss, params, num_micro_batch=3)(x)
    whole = brainstate.transform.grad(loss, params)(x)
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(micro), jax.tree.leaves(whole))) > 1e-3
