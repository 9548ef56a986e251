"""The ``mesh`` option: argument checks and a one-device mesh here; 8 simulated devices and two processes
in subprocesses, since JAX fixes its devices when it starts."""

import os
import signal

import brainpy as bp
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import background
from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, params_of
from test_equivalence import Scenario, run


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


def resume_across_mesh(saved_on_mesh: bool, checkpoint, mesh: Mesh, size: int) -> None:
  """Ctrl-C with an accumulate_steps window holding one batch (of ``size`` samples), fit on ``mesh`` or without
  one as ``saved_on_mesh`` says; the checkpoint resumed in the other form; the run must end as bp.BPTT's on the
  windows."""
  batches = make_batches((size,) * 4)
  trainer = lambda on: AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error,  # noqa: E731
                                 optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, num_micro_batch=2,
                                 accumulate_steps=2, **({'mesh': mesh} if on else {}))

  def interrupted():  # Ctrl-C while fetching batch 3: batches 0-2 run (fit holds one batch ahead)
    for i, batch in enumerate(batches):
      if i == 3:
        os.kill(os.getpid(), signal.SIGINT)
      yield batch

  handler = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt):
      trainer(saved_on_mesh).fit(interrupted, num_epoch=1, checkpoint=checkpoint)
  finally:
    signal.signal(signal.SIGINT, handler)
  resumed = trainer(not saved_on_mesh)
  resumed.fit(batches, num_epoch=1, checkpoint=checkpoint)
  reference = bp.BPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                      progress_bar=False)
  reference.fit([tuple(np.concatenate(parts) for parts in zip(*batches[i:i + 2])) for i in (0, 2)], num_epoch=1)
  assert_trees_close(params_of(resumed.target), params_of(reference.target))


@pytest.mark.parametrize('saved_on_mesh', [True, pytest.param(False, marks=pytest.mark.long)])  # README suite time
def test_a_window_saved_on_a_mesh_resumes_without_one_and_the_reverse(saved_on_mesh, tmp_path):
  """On a mesh the accumulate_steps window keeps one row of sums per device, without one a single sum: a
  checkpoint taken mid-window resumes in the other form (the rows added; the sum put in the first row). It was
  refused as a model that does not fit. (Eight devices: ``multidevice_checks.py``.)"""
  resume_across_mesh(saved_on_mesh, tmp_path / 'run.ckpt', Mesh(np.array(jax.devices()[:1]), ('batch',)), 4)


@pytest.mark.long
@pytest.mark.multidevice
def test_on_eight_simulated_devices():
  """``multidevice_checks.py`` in its own pytest session on 8 simulated CPU devices (started at collection)."""
  job = background.finish('eight_devices', background.start_eight_devices)
  text = background.output(job)
  assert job.processes[0].returncode == 0, text
  assert ' passed' in text and 'skipped' not in text, text


@pytest.mark.long
@pytest.mark.multidevice
def test_two_processes_over_loopback_match_one_process():
  """jax.distributed with 2 processes x 2 CPU devices: both end with bp.BPTT's single-process parameters."""
  from multihost_data import BATCHES, NUM_EPOCH, make_trainer_kwargs

  job = background.finish('two_processes', background.start_two_processes)
  assert [p.returncode for p in job.processes] == [0, 0], background.output(job)
  model = make_model('rnn')
  kwargs = make_trainer_kwargs()
  kwargs.pop('num_micro_batch')
  reference = bp.BPTT(model, bp.losses.mean_squared_error, **kwargs)
  reference.fit(BATCHES, num_epoch=NUM_EPOCH)
  results = [np.load(job.out_dir / f'process_{i}.npz') for i in range(2)]
  for result in results:
    assert list(result['devices']) == [4, 2]  # 4 devices over 2 processes
    params = [result[f'arr_{i}'] for i in range(len(params_of(model)))]
    assert_trees_close(params, params_of(model))
    assert_trees_close(result['losses'], np.asarray(reference.train_losses))
  for a, b in zip(results[0].values(), results[1].values()):
    np.testing.assert_array_equal(a, b)  # the two processes hold identical parameters


@pytest.mark.long
@pytest.mark.multidevice
def test_two_process_checkpoint_resumes_mid_window():
  """Two processes interrupted with an ``accumulate_steps`` window holding one batch (its rows on both
  processes' devices) write one checkpoint; two fresh processes resume and end as one uninterrupted process."""
  from multihost_data import RESUME_BATCHES, NUM_EPOCH, make_resume_trainer

  job = background.finish('two_process_checkpoints', background.start_two_process_checkpoints)
  assert job.processes[0].returncode == 0, background.output(job)
  assert 'process 0: interrupted; checkpoint written: True' in background.output(job)
  reference = make_resume_trainer()
  reference.fit(RESUME_BATCHES, num_epoch=NUM_EPOCH)
  for i in range(2):
    result = np.load(job.out_dir / f'process_{i}.npz')
    assert_trees_close([result[f'arr_{j}'] for j in range(len(params_of(reference.target)))],
                       params_of(reference.target))
    assert_trees_close(result['losses'], np.asarray(reference.train_losses))
