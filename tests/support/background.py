"""Subprocess checks started when collection finishes, so they run beside the rest of the session.

The 8-simulated-device session and the two-process run need their own JAX
processes; they mostly wait on one core while the main session compiles on
the other. ``conftest.py`` starts those whose tests were collected; the tests
then wait for them and check what they left.
"""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from typing import Dict, List, NamedTuple

HERE = pathlib.Path(__file__).parent  # tests/support
ROOT = HERE.parent.parent  # the repository, where the subprocesses run
TEST_FOLDERS = [str(HERE.parent / name) for name in ('core', 'memory', 'trainer', 'checkpoint', 'bench', 'recipes')]


class Job(NamedTuple):
  processes: List[subprocess.Popen]
  logs: List[pathlib.Path]
  out_dir: pathlib.Path


_jobs: Dict[str, Job] = {}
NUM_MICRO_BATCH_FOR_BRAINPY_SUITE = (2, 3)  # even and uneven splits of BrainPy's batches of 2 and 3


def env(**extra) -> dict:
  """This environment, with the support and test folders importable and ``extra`` set.

  The processes run on the CPU (``JAX_PLATFORMS=cpu``) whatever this one runs on: on a GPU or TPU the session
  holds the device (only one process can hold a TPU), and their checks simulate devices on the CPU.
  """
  values = dict(os.environ, JAX_PLATFORMS='cpu', **extra)
  if 'XLA_FLAGS' in extra and os.environ.get('XLA_FLAGS'):  # keep the session's flags (conftest's -O0)
    values['XLA_FLAGS'] = f"{os.environ['XLA_FLAGS']} {extra['XLA_FLAGS']}"
  values['PYTHONPATH'] = os.pathsep.join([str(HERE)] + TEST_FOLDERS + [p for p in [values.get('PYTHONPATH')] if p])
  return values


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(('127.0.0.1', 0))
    return probe.getsockname()[1]


def _start(name: str, commands: List[List[str]], environment: dict) -> None:
  out_dir = pathlib.Path(tempfile.mkdtemp(prefix=f'brainpy_accum_{name}_'))
  logs = [out_dir / f'log_{i}.txt' for i in range(len(commands))]
  environment = {key: value.replace('{out}', str(out_dir)) for key, value in environment.items()}
  processes = [subprocess.Popen([arg.replace('{out}', str(out_dir)) for arg in command], env=environment,
                                stdout=open(log, 'w'), stderr=subprocess.STDOUT, cwd=ROOT)
               for command, log in zip(commands, logs)]
  _jobs[name] = Job(processes, logs, out_dir)


def start_eight_devices() -> None:
  """``multidevice_checks.py`` in its own pytest session on 8 simulated CPU devices."""
  _start('eight_devices', [[sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-o', 'addopts=',
                            str(HERE / 'multidevice_checks.py')]],
         env(XLA_FLAGS='--xla_force_host_platform_device_count=8'))


def start_two_processes() -> None:
  """Two ``multihost_worker.py`` processes joined by jax.distributed over 127.0.0.1."""
  port = str(_free_port())
  _start('two_processes', [[sys.executable, str(HERE / 'multihost_worker.py'), str(i), port, '{out}']
                           for i in range(2)], env())


def start_two_process_checkpoints() -> None:
  """``multihost_resume.py``: two processes interrupted mid-window write a checkpoint; two fresh ones resume."""
  _start('two_process_checkpoints', [[sys.executable, str(HERE / 'multihost_resume.py'), '{out}']], env())


def brainpy_test_file() -> pathlib.Path:
  """BrainPy's own BPTT test file, as the installed brainpy ships it."""
  import importlib.util
  package = pathlib.Path(importlib.util.find_spec('brainpy').origin).parent
  return package / 'train' / 'back_propagation_test.py'


def start_brainpy_suite(n: int) -> None:
  """BrainPy's BPTT test file with bp.BPTT switched to AccumBPTT at ``num_micro_batch=n``."""
  ini = pathlib.Path(tempfile.mkdtemp(prefix='brainpy_accum_ini_')) / 'pytest.ini'
  ini.write_text('[pytest]\n')  # keeps this project's pytest options (doctests, testpaths) out of BrainPy's file
  command = [sys.executable, '-m', 'pytest', '-q', '-c', str(ini), '--rootdir', str(ini.parent),
             '-p', 'no:cacheprovider', '-p', 'brainpy_switch', str(brainpy_test_file())]
  _start(f'brainpy_suite_{n}', [command], env(BRAINPY_ACCUM_N=str(n), BRAINPY_ACCUM_REPORT='{out}/report.json'))


def finish(name: str, start, timeout: float = 900) -> Job:
  """Wait for job ``name`` (starting it now if collection did not) and return it."""
  if name not in _jobs:
    start()
  job = _jobs[name]
  for process in job.processes:
    process.wait(timeout=timeout)
  return job


def output(job: Job) -> str:
  """The processes' combined output, for assertion messages."""
  return '\n'.join(log.read_text()[-6000:] for log in job.logs)
