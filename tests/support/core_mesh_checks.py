"""``micro_batched_grad(..., mesh=...)`` on 8 simulated CPU devices against whole-batch ``brainstate.transform.grad``.

JAX fixes its device count when it starts, so these checks run in their own pytest session with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (``test_core_mesh.py`` starts it). Batches of 40 give
each device 5 samples: with N=2 the micro-batches of a share are 3 + 2 (a short last one).
"""

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from brainpy_accum import count_all_reduces, micro_batched_grad
from helpers import assert_trees_close, make_model
from test_core import PARAMS, data, param_states, pure_loss, values

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason='needs 8 (simulated) devices')

BATCH = 40  # 8 devices x 5 samples


@pytest.fixture(scope='module')
def mesh():
  return Mesh(np.array(jax.devices()[:8]), ('batch',))


def one_all_reduce_outside_loops(hlo_text):
  count = count_all_reduces(hlo_text)
  assert (count.total, count.in_loops) == (1, 0), count


@pytest.mark.parametrize('n, reduction', [(2, 'mean'), (2, 'sum'), (1, 'mean')])
def test_pure_function_of_param_states(mesh, n, reduction):
  states, reduce = param_states(), jnp.mean if reduction == 'mean' else jnp.sum
  grad_fn = jax.jit(micro_batched_grad(lambda x, y: pure_loss(values(states), x, y, reduce), states,
                                       num_micro_batch=n, grad_reduction=reduction, return_value=True, mesh=mesh))
  x, y = data(BATCH, 3, seed=3), data(BATCH, 2, seed=4)
  expected = brainstate.transform.grad(lambda x, y: pure_loss(values(states), x, y, reduce), states,
                                       return_value=True)(x, y)
  assert_trees_close(grad_fn(x, y), expected)
  one_all_reduce_outside_loops(grad_fn.lower(x, y).compile().as_text())


def test_loss_weight_fn_and_aux_over_devices(mesh):
  """Masked mean: the devices' weighted sums make the whole batch's normalised loss; aux combined alike."""
  states = param_states()

  def loss_fn(x, mask, y):
    err = jnp.sum((jnp.tanh(x @ states['w'].value + states['b'].value) - y) ** 2, axis=-1)
    return jnp.sum(mask * err) / jnp.sum(mask), {'masked': jnp.sum(mask * err) / jnp.sum(mask)}

  x, y = data(BATCH, 4, 3, seed=3), data(BATCH, 4, 2, seed=4)
  mask = jnp.asarray(np.random.RandomState(5).rand(BATCH, 4) < np.linspace(0.1, 0.9, BATCH)[:, None], jnp.float32)
  grad_fn = micro_batched_grad(loss_fn, states, num_micro_batch=2, has_aux=True, return_value=True, mesh=mesh,
                               loss_weight_fn=lambda x, mask, y: mask.sum())
  expected = brainstate.transform.grad(loss_fn, states, has_aux=True, return_value=True)(x, mask, y)
  assert_trees_close(jax.jit(grad_fn)(x, mask, y), expected)


@pytest.mark.parametrize('has_aux, return_value', [(True, False), (False, False)])
def test_output_structure_is_brainstates(mesh, has_aux, return_value):
  states = param_states()

  def loss_fn(x, y):
    out = jnp.tanh(x @ states['w'].value + states['b'].value)
    loss = jnp.mean(jnp.sum((out - y) ** 2, axis=-1))
    return (loss, {'mean_out': out.mean()}) if has_aux else loss

  x, y = data(BATCH, 3, seed=3), data(BATCH, 2, seed=4)
  kwargs = dict(has_aux=has_aux, return_value=return_value)
  got = micro_batched_grad(loss_fn, states, micro_batch_size=2, mesh=mesh, **kwargs)(x, y)  # eager; 2 + 2 + 1
  expected = brainstate.transform.grad(loss_fn, states, **kwargs)(x, y)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
  assert_trees_close(got, expected)


def rnn_model():
  model = make_model('rnn')  # bp.dyn.RNNCell + bp.dnn.Dense in training mode: batch_axis Variables
  model.reset(BATCH)
  model.rnn.state.value = data(BATCH, 8, seed=9)  # each sample starts from its own state
  return model


def rnn_loss(model):
  def loss_fn(x, y):  # x: (batch, time, features)
    outs = bm.for_loop(model.step_run, (jnp.arange(x.shape[1]), jnp.moveaxis(x, 1, 0)))
    return jnp.mean((outs[-1] - y) ** 2), {'mean_out': outs.mean()}
  return loss_fn


def test_brainpy_model_with_batch_axis_variables(mesh):
  """Grads, loss, aux and the final (split) RNN state are the whole batch's; one all-reduce, none in loops."""
  x, y = data(BATCH, 4, 3, seed=3), data(BATCH, 2, seed=4)
  model = rnn_model()
  expected = bm.jit(brainstate.transform.grad(rnn_loss(model), model.train_vars().unique(), has_aux=True,
                                              return_value=True))(x, y)
  expected_state = model.rnn.state.value
  model = rnn_model()
  grad_fn = bm.jit(micro_batched_grad(rnn_loss(model), model.train_vars().unique(), num_micro_batch=2, has_aux=True,
                                      return_value=True, mesh=mesh))
  got = grad_fn(x, y)
  assert_trees_close((list(got[0].values()),) + got[1:], (list(expected[0].values()),) + expected[1:])
  assert_trees_close(model.rnn.state.value, expected_state)
  one_all_reduce_outside_loops(grad_fn.compile(x, y).as_text())


class GRUNet(brainstate.nn.Module):
  def __init__(self):
    super().__init__()
    self.cell = brainstate.nn.GRUCell(3, 5)
    self.out = brainstate.nn.Linear(5, 2)

  def update(self, x):
    return self.out(self.cell(x))


def test_states_the_loss_creates_end_holding_the_whole_batch(mesh):
  """``init_all_states`` inside the loss: each device's new HiddenStates stitched into the whole batch's."""
  x, y = data(2, BATCH, 3, seed=3), data(BATCH, 2, seed=4)  # time first
  brainstate.random.seed(0)
  model = GRUNet()

  def loss_fn(x, y):
    brainstate.nn.init_all_states(model, x.shape[1])
    return jnp.mean((brainstate.transform.for_loop(model, x)[-1] - y) ** 2)

  params = model.states(brainstate.ParamState)
  # a state created inside a traced function lives only there, so read it there
  run = lambda grad_fn: brainstate.transform.jit(lambda x, y: (grad_fn(x, y), model.cell.h.value))(x, y)
  whole = brainstate.transform.grad(loss_fn, params, return_value=True)
  expected = run(lambda x, y: (whole(x, y), loss_fn(x, y))[0])  # brainstate's grad keeps no state the loss creates
  got = run(micro_batched_grad(loss_fn, params, num_micro_batch=2, return_value=True, batch_axis=(1, 0), mesh=mesh))
  assert got[1].shape == (BATCH, 5)
  assert_trees_close(got, expected)


def test_named_state_with_the_batch_on_axis_1(mesh):
  w = brainstate.ParamState(data(3, 5, seed=1))

  def runs(micro):
    h = brainstate.HiddenState(data(5, BATCH, seed=2))

    def loss(x):
      h.value = 0.5 * h.value + jnp.tanh(x @ w.value).T
      return jnp.mean(h.value ** 2)

    grad = (micro_batched_grad(loss, {'w': w}, num_micro_batch=2, states=[(h, 1)], mesh=mesh) if micro else
            brainstate.transform.grad(loss, {'w': w}))
    return brainstate.transform.jit(lambda x: (grad(x), h.value))(data(BATCH, 3, seed=3))

  assert_trees_close(runs(True), runs(False))


def test_devices_draw_their_own_random_numbers(mesh):
  w = brainstate.ParamState(jnp.ones(()))

  def loss_fn(x):
    noise = brainstate.random.rand(x.shape[0])
    return jnp.mean(w.value * noise * x), {'square': jnp.mean(noise ** 2)}

  brainstate.random.seed(0)
  key = brainstate.random.DEFAULT.value
  grad_fn = micro_batched_grad(loss_fn, {'w': w}, num_micro_batch=1, has_aux=True, mesh=mesh)
  grads, aux = brainstate.transform.jit(grad_fn)(jnp.ones(8))
  # One sample per device: equal draws on every device would give mean(noise)**2 == mean(noise**2).
  assert float(aux['square']) - float(grads['w']) ** 2 > 1e-3
  assert not np.array_equal(jax.random.key_data(brainstate.random.DEFAULT.value), jax.random.key_data(key))


def test_batch_not_divisible_by_the_devices_raises_and_changes_nothing(mesh):
  w, h = brainstate.ParamState(data(3, 5, seed=1)), brainstate.HiddenState(data(12, 5, seed=2))

  def loss(x):
    h.value = 0.5 * h.value + jnp.tanh(x @ w.value)
    return jnp.mean(h.value ** 2)

  grad_fn = micro_batched_grad(loss, {'w': w}, num_micro_batch=2, mesh=mesh)
  before = h.value
  with pytest.raises(ValueError, match=r"batch_size=12 does not split evenly over the 8 devices of mesh axis "
                                       r"'batch'.*multiple of 8 \(e\.g\. 8 or 16\)"):
    grad_fn(data(12, 3))
  assert h.value is before


def test_mesh_axis_of_a_two_axis_mesh():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('data', 'model'))
  states = param_states()
  loss_fn = lambda x, y: pure_loss(values(states), x, y)
  x, y = data(BATCH, 3, seed=3), data(BATCH, 2, seed=4)
  got = jax.jit(micro_batched_grad(loss_fn, states, num_micro_batch=3, mesh=mesh, mesh_axis='data'))(x, y)
  assert_trees_close(got, jax.grad(pure_loss)(PARAMS, x, y))
