"""A pytest plugin that runs BrainPy's own BPTT tests with ``bp.BPTT`` switched to ``AccumBPTT``.

Loaded with ``-p brainpy_switch`` into a pytest session over the test file that
ships inside the installed brainpy (``brainpy/train/back_propagation_test.py``),
read where it lies, never copied. ``BRAINPY_ACCUM_N`` sets ``num_micro_batch``;
``BRAINPY_ACCUM_REPORT`` names a JSON file that receives how many tests ran and
passed and how many trainers were ``AccumBPTT`` (proof that the switch held).
"""

import json
import os

import brainpy
from brainpy_accum import AccumBPTT

_counts = {'collected': 0, 'passed': 0, 'failed': 0, 'accum_trainers': 0}


class SwitchedBPTT(AccumBPTT):
  """``AccumBPTT`` with this session's ``num_micro_batch`` unless the caller gives one."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault('num_micro_batch', int(os.environ['BRAINPY_ACCUM_N']))
    super().__init__(*args, **kwargs)
    _counts['accum_trainers'] += 1


def pytest_configure(config):
  brainpy.BPTT = SwitchedBPTT


def pytest_collection_finish(session):
  _counts['collected'] = len(session.items)


def pytest_runtest_logreport(report):
  if report.when == 'call' or report.outcome != 'passed':
    _counts[report.outcome] = _counts.get(report.outcome, 0) + 1


def pytest_sessionfinish(session, exitstatus):
  with open(os.environ['BRAINPY_ACCUM_REPORT'], 'w') as file:
    json.dump(dict(_counts, exitstatus=int(exitstatus)), file)
