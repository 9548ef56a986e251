"""``micro_batched_grad(..., mesh=...)``: argument checks and a one-device mesh here; 8 simulated devices in a
subprocess (``core_mesh_checks.py``), since JAX fixes its devices when it starts."""

import subprocess
import sys

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import background
from brainpy_accum import micro_batched_grad
from helpers import assert_trees_close
from test_core import PARAMS, data, param_states, pure_loss, values


def pure_grad_fn(n=2, **kwargs):
  states = param_states()
  return micro_batched_grad(lambda x, y: pure_loss(values(states), x, y), states, num_micro_batch=n, **kwargs)


ONE_DEVICE = Mesh(np.array(jax.devices()[:1]), ('batch',))


@pytest.mark.parametrize('kwargs, error, match', [
  (dict(mesh='batch'), TypeError, r"mesh='batch' must be a jax.sharding.Mesh"),
  (dict(mesh=jax.devices()), TypeError, r'mesh=.* must be a jax.sharding.Mesh .*got a list'),
  (dict(mesh=ONE_DEVICE, mesh_axis=0), TypeError, 'mesh_axis=0 must be the name'),
  (dict(mesh_axis='batch'), ValueError, "mesh_axis='batch' names an axis of a device mesh, but mesh=None"),
  (dict(mesh=ONE_DEVICE, mesh_axis='data'), ValueError, r"mesh_axis='data' is not an axis of the mesh"),
  (dict(mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))), ValueError,
   r"say which one splits the batch with mesh_axis=\.\.\., e\.g\. mesh_axis='data'"),
])
def test_bad_mesh_arguments_raise_when_the_transform_is_made(kwargs, error, match):
  with pytest.raises(error, match=match):
    pure_grad_fn(**kwargs)


def test_batch_not_divisible_by_the_devices_raises_before_anything_changes():
  # Two entries of one device: the size check comes before anything runs on the mesh.
  two = Mesh(np.array(jax.devices()[:1] * 2), ('batch',))
  w, h = brainstate.ParamState(data(3, 5, seed=1)), brainstate.HiddenState(data(7, 5, seed=2))

  def loss(x):
    h.value = 0.5 * h.value + jnp.tanh(x @ w.value)
    return jnp.mean(h.value ** 2)

  before = h.value
  with pytest.raises(ValueError, match=r"batch_size=7 does not split evenly over the 2 devices of mesh axis 'batch'"):
    micro_batched_grad(loss, {'w': w}, num_micro_batch=2, mesh=two)(data(7, 3))
  assert h.value is before


@pytest.mark.parametrize('n', [1, 3])
def test_one_device_mesh_equals_the_whole_batch(n):
  """The sharded code path (shard_map, one all-reduce) on a mesh of one device; 7 = 3 + 3 + 1 for N=3."""
  x, y = data(7, 3, seed=3), data(7, 2, seed=4)
  got = jax.jit(pure_grad_fn(n, mesh=ONE_DEVICE, return_value=True))(x, y)
  loss, grads = jax.value_and_grad(pure_loss)(PARAMS, x, y)
  assert_trees_close(got, (grads, loss))


def test_one_device_mesh_with_nested_args_and_values_that_are_not_cut():
  """Dict/tuple arguments with their own batch axes; an array and a Python float passed whole."""
  def loss(params, inputs, y, scale, offset):
    return pure_loss(params, (inputs['a'] + scale * inputs['b'][0]).mean(1) + offset, y)

  states = param_states()
  inputs, y = {'a': data(7, 4, 3, seed=3), 'b': (data(7, 4, 3, seed=4),)}, data(7, 2, seed=5)
  grad_fn = micro_batched_grad(lambda *args: loss(values(states), *args), states, num_micro_batch=3,
                               batch_axis=(0, 0, None, None), mesh=ONE_DEVICE)
  assert_trees_close(grad_fn(inputs, y, jnp.float32(0.5), 0.25), jax.grad(loss)(PARAMS, inputs, y, 0.5, 0.25))


@pytest.mark.long
@pytest.mark.multidevice
def test_on_eight_simulated_devices():
  """``core_mesh_checks.py`` in its own pytest session on 8 simulated CPU devices (about a minute)."""
  job = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-o', 'addopts=',
                        str(background.HERE / 'core_mesh_checks.py')], cwd=background.ROOT,
                       env=background.env(XLA_FLAGS='--xla_force_host_platform_device_count=8'),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
  text = job.stdout[-6000:]
  assert job.returncode == 0, text
  assert ' passed' in text and 'skipped' not in text, text
