import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).parent / 'support'))
import background  # noqa: E402
sys.path[1:1] = background.TEST_FOLDERS  # test files import one another across the mirrored folders


def pytest_collection_finish(session):
  """Start the subprocess checks of ``test_mesh.py`` early, so they run beside the other tests."""
  import background
  names = {item.name for item in session.items}
  if 'test_on_eight_simulated_devices' in names:
    background.start_eight_devices()
  if 'test_two_processes_over_loopback_match_one_process' in names:
    background.start_two_processes()
  if 'test_two_process_checkpoint_resumes_mid_window' in names:
    background.start_two_process_checkpoints()
  if any(name.startswith('test_brainpy_own_bptt_tests_pass') for name in names):
    background.start_brainpy_suite()
