"""The ``mesh`` option: argument checks and a one-device mesh here; 8 simulated devices and two processes
in subprocesses, since JAX fixes its devices when it starts."""

import os
import pathlib
import socket
import subprocess
import sys

import brainpy as bp
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_model, params_of
from test_equivalence import Scenario, run

HERE = pathlib.Path(__file__).parent


def _env(**extra):
  env = dict(os.environ, **extra)
  env['PYTHONPATH'] = os.pathsep.join([str(HERE)] + [p for p in [env.get('PYTHONPATH')] if p])
  return env


@pytest.mark.parametrize('kwargs, error, message', [
  (dict(mesh='batch'), TypeError, 'mesh must be a jax.sharding.Mesh'),
  (dict(mesh_axis='batch'), ValueError, "mesh_axis='batch' names an axis of a device mesh, but mesh=None"),
  (dict(mesh=Mesh(np.array(jax.devices()[:1]), ('batch',)), mesh_axis='data'), ValueError,
   r"mesh_axis='data' is not an axis of the mesh, whose axes are \('batch',\)"),
  (dict(mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))), ValueError,
   r"say which one splits the batch with mesh_axis=\.\.\., e\.g\. mesh_axis='data'"),
])
def test_mesh_arguments_are_checked(kwargs, error, message):
  with pytest.raises(error, match=message):
    AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, **kwargs)


def test_one_device_mesh_equals_bptt():
  """The sharded code path on a mesh of one device: bp.BPTT's parameters, losses and metrics."""
  scenario = Scenario(sizes=(10, 10, 7))
  expected_params, expected_metrics, _ = run(scenario)
  params, metrics, trainer = run(scenario, AccumBPTT, num_micro_batch=3,
                                 mesh=Mesh(np.array(jax.devices()[:1]), ('batch',)))
  assert_trees_close(params, expected_params)
  assert_trees_close(metrics, expected_metrics)
  assert trainer.describe_batch(10) == 'batch 10 = 1 devices x (2 x 4 + 2)'


def test_on_eight_simulated_devices():
  """Runs ``multidevice_checks.py`` in its own pytest session on 8 simulated CPU devices."""
  result = subprocess.run(
    [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-o', 'addopts=',
     str(HERE / 'multidevice_checks.py')],
    env=_env(XLA_FLAGS='--xla_force_host_platform_device_count=8'), capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  assert ' passed' in result.stdout and 'skipped' not in result.stdout, result.stdout[-2000:]


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(('127.0.0.1', 0))
    return probe.getsockname()[1]


def test_two_processes_over_loopback_match_one_process(tmp_path):
  """jax.distributed with 2 processes x 2 CPU devices: both end with bp.BPTT's single-process parameters."""
  from multihost_data import BATCHES, NUM_EPOCH, make_trainer_kwargs

  port = _free_port()
  workers = [subprocess.Popen([sys.executable, str(HERE / 'multihost_worker.py'), str(i), str(port), str(tmp_path)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
  logs = [worker.communicate(timeout=600)[0] for worker in workers]
  assert [w.returncode for w in workers] == [0, 0], '\n'.join(log[-3000:] for log in logs)

  model = make_model('rnn')
  kwargs = make_trainer_kwargs()
  kwargs.pop('num_micro_batch')
  reference = bp.BPTT(model, bp.losses.mean_squared_error, **kwargs)
  reference.fit(BATCHES, num_epoch=NUM_EPOCH)
  results = [np.load(tmp_path / f'process_{i}.npz') for i in range(2)]
  for result in results:
    assert list(result['devices']) == [4, 2]  # 4 devices over 2 processes
    params = [result[f'arr_{i}'] for i in range(len(params_of(model)))]
    assert_trees_close(params, params_of(model))
    assert_trees_close(result['losses'], np.asarray(reference.train_losses))
  for a, b in zip(results[0].values(), results[1].values()):
    np.testing.assert_array_equal(a, b)  # the two processes hold identical parameters
