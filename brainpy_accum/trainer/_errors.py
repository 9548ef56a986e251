"""Error classes that are both Python's and BrainPy's, so ``except`` clauses written for ``bp.BPTT`` still catch them.

Where :class:`brainpy.BPTT` raises one of BrainPy's own classes for a mistake,
``AccumBPTT`` raises a class that derives from it *and* from the built-in
``ValueError`` / ``TypeError`` that says what kind of mistake it is, with a
message that names the argument and the fix.
"""

from brainpy._errors import NoLongerSupportError, UnsupportedError

__all__ = ['RemovedArgumentError', 'BareBatchError', 'ReportCallbackError']


class RemovedArgumentError(TypeError, NoLongerSupportError):
  """An argument that :class:`brainpy.BPTT` no longer supports (BrainPy raises ``NoLongerSupportError``)."""


class BareBatchError(TypeError, UnsupportedError):
  """Training data given as one bare ``(X, Y)`` pair (BrainPy raises ``UnsupportedError``)."""


class ReportCallbackError(TypeError, AssertionError):
  """A ``fun_after_report`` that cannot be called (BrainPy fails an ``assert``, hence ``AssertionError``)."""
