"""The suite's switches: the long suite (``--long``), one JAX compilation cache per run, early subprocess checks,
float32 matmuls and the accelerator-only tests off the CPU.

``python -m pytest -q`` runs the suite a contributor runs while working: every behaviour, small models, a few
minutes on two cores. ``--long`` adds the tests marked ``long``: the searches, BrainPy's gallery ports, the
resume-after-SIGKILL runs, the multi-process and multi-device checks. ``--long -m long`` runs those alone.

On a GPU or TPU the suite runs in one process (``python -m pytest -q -n 0``: only one process can hold a TPU,
and each xdist worker would take its own share of a GPU). There every test runs with float32 matmuls
(:func:`_float32_matmuls_off_the_cpu`), the tests marked ``accelerator`` run (on the CPU they skip, saying why),
and the checks in their own processes run on the CPU (``background.env``).
"""

import os
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent / 'support'))
import background  # noqa: E402
import pytest  # noqa: E402
sys.path[1:1] = background.TEST_FOLDERS  # test files import one another across the mirrored folders

LONG_HELP = ('also run the long suite: tests marked "long" (searches, gallery ports, resume after SIGKILL, '
             'multi-process and multi-device checks); "--long -m long" runs them alone')


def pytest_addoption(parser):
  parser.addoption('--long', action='store_true', default=False, help=LONG_HELP)


def pytest_configure(config):
  _share_compilations(config)


def _share_compilations(config):
  """Faster XLA compilations, and one persistent JAX compilation cache for the whole run, its xdist workers
  and its subprocesses.

  Many tests build a fresh trainer for the same tiny model, and each fresh trainer compiles the same XLA
  program again; the cache turns the repeats into look-ups. Compilation counts stay exact: JAX reports a
  backend compilation for a cache hit too, which is what :mod:`brainpy_accum` counts. An environment that
  names its own cache (``JAX_COMPILATION_CACHE_DIR``, as ``.ci/run`` does for all its legs) keeps it;
  otherwise the cache is a fresh folder removed at the end, so every run starts cold.
  """
  # The tests' models are tiny: XLA's LLVM back end at -O0 compiles about a third faster. The optimised HLO,
  # and so every compile-time memory figure the tests compare, is the same at any back-end level.
  flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_backend_optimization_level' not in flags:
    os.environ['XLA_FLAGS'] = f'{flags} --xla_backend_optimization_level=0'.strip()
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')
  # AccumBPTT's own caches (the plan cache, its default JAX cache folder under ~/.cache) stay off: a test that
  # plans must plan, and no test writes into the home folder; the cache tests name a temporary folder.
  os.environ.setdefault('BRAINPY_ACCUM_CACHE', '0')
  if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
    folder = tempfile.mkdtemp(prefix='brainpy_accum_jax_cache_')
    os.environ['JAX_COMPILATION_CACHE_DIR'] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


# CI (.ci/run) runs the long suite on two legs, one per brainpy version; each long test runs on one of them,
# chosen by its file so that the two legs take about the same time (the README suite, on every leg, runs
# BrainPy's own BPTT tests with AccumBPTT on each brainpy version). The markers let a contributor run one
# leg's share alone.
LONG_ON_MULTIDEVICE_LEG = ('test_mesh.py', 'test_core_mesh.py', 'test_resume.py', 'test_training_loop.py',
                           'test_hostile_input.py', 'test_whole_batch_loss.py')


def long_leg_marker(filename: str) -> str:
  """The marker that places a long test of ``filename`` on one CI leg."""
  return 'multidevice_leg' if filename in LONG_ON_MULTIDEVICE_LEG else 'other_long_leg'


NEEDS_ACCELERATOR = "needs a GPU or TPU: jax.default_backend() is 'cpu'"
NO_HOST_CALLBACKS = (f'runs a host callback, and JAX_PLATFORMS={os.environ.get("JAX_PLATFORMS")!r} leaves JAX no CPU '
                     f'backend to run it on (as bp.BPTT: the callback is the test\'s or the user\'s own)')


def pytest_collection_modifyitems(config, items):
  """Long tests get their CI leg's marker; without ``--long`` they are deselected (not skipped: they are not
  part of this run). Tests marked ``accelerator`` skip on the CPU, those marked ``cpu_only(reason)`` off it,
  saying why; those marked ``host_callback(reason)`` skip where JAX has no CPU backend to run a host callback
  (``JAX_PLATFORMS=tpu``)."""
  for item in items:
    if item.get_closest_marker('long'):
      item.add_marker(long_leg_marker(item.path.name))
  if any(item.get_closest_marker(name) for item in items for name in ('accelerator', 'cpu_only', 'host_callback')):
    import jax
    from brainpy_accum.core._written import host_callbacks_run
    on_cpu, callbacks = jax.default_backend() == 'cpu', host_callbacks_run()
    for item in items:
      if on_cpu and item.get_closest_marker('accelerator'):
        item.add_marker(pytest.mark.skip(reason=NEEDS_ACCELERATOR))
      only = item.get_closest_marker('cpu_only')
      if not on_cpu and only:
        item.add_marker(pytest.mark.skip(reason=f'CPU only, on {jax.default_backend()}: {only.args[0]}'))
      host = item.get_closest_marker('host_callback')
      if host and not callbacks:
        item.add_marker(pytest.mark.skip(reason=f'{NO_HOST_CALLBACKS}: {host.args[0]}'))
  if config.getoption('--long'):
    return
  long_items = [item for item in items if item.get_closest_marker('long')]
  if long_items:
    config.hook.pytest_deselected(items=long_items)
    items[:] = [item for item in items if not item.get_closest_marker('long')]


def pytest_collection_finish(session):
  """Start the subprocess checks early, so they run beside the other tests (one process only: under
  pytest-xdist each worker collects every test, so the tests start their subprocesses when they run)."""
  if os.environ.get('PYTEST_XDIST_WORKER'):
    return
  names = {item.name for item in session.items}
  if 'test_on_eight_simulated_devices' in names:
    background.start_eight_devices()
  if 'test_two_processes_over_loopback_match_one_process' in names:
    background.start_two_processes()
  if 'test_two_process_checkpoint_resumes_mid_window' in names:
    background.start_two_process_checkpoints()
  for n in background.NUM_MICRO_BATCH_FOR_BRAINPY_SUITE:
    if f'test_brainpy_own_bptt_tests_pass_with_accum_bptt[{n}]' in names:
      background.start_brainpy_suite(n)


@pytest.fixture(autouse=True, scope='session')
def _float32_matmuls_off_the_cpu():
  """On a GPU or TPU, every test runs with float32 matmuls (``jax_default_matmul_precision='highest'``).

  The tests compare AccumBPTT with bp.BPTT (or ``jax.grad``) on the whole batch at float32 round-off
  (``helpers.RTOL``), and at their default precision accelerators do not multiply float32 matrices in float32
  (see ``helpers.py`` for why that makes the two computations differ by more than the order of a sum). With
  float32 matmuls an accelerator agrees with a CPU to about seven digits, so the CPU's tolerances hold
  unchanged. Set once for the whole session and for every thread (the first-batch loss check traces on its
  own thread), so that every program a test measures or compares, fixtures' included, is traced alike.
  """
  import jax
  if jax.default_backend() == 'cpu':
    yield
    return
  before = jax.config.jax_default_matmul_precision
  jax.config.update('jax_default_matmul_precision', 'highest')
  try:
    yield
  finally:
    jax.config.update('jax_default_matmul_precision', before)
