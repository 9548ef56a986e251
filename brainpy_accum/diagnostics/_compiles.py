"""Counting XLA compilations as they happen, from JAX's own monitoring events.

A jitted step compiled for sharded inputs can grow JAX's dispatch cache
without compiling again, so the trainer counts the backend compilations
themselves (``/jax/core/compile/backend_compile_duration``) that happen while
one of its steps is called.
"""

import contextlib
import threading
from typing import Callable, Dict, Iterator

import jax.monitoring

__all__ = ['Compilations', 'QUICK_COMPILE', 'count_compilations']

# XLA options of a compilation whose code runs once or never (the planner's memory probes, the first batch's
# loss check): code generation unoptimised, about half the compile time on CPU; the optimised HLO, and so the
# buffer assignment and every memory figure, are those of a full compilation.
QUICK_COMPILE = {'xla_backend_optimization_level': 0}

_BACKEND_COMPILE = '/jax/core/compile/backend_compile_duration'
_seen = [0]
# Threads whose compilations are not a step's: the first-batch check compiles on one beside the first step.
UNCOUNTED_THREAD_PREFIX = 'brainpy_accum uncounted:'


def _listener(event: str, duration_secs: float, **kwargs) -> None:
  # JAX records the event on the thread that compiled
  if event == _BACKEND_COMPILE and not threading.current_thread().name.startswith(UNCOUNTED_THREAD_PREFIX):
    _seen[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


@contextlib.contextmanager
def count_compilations() -> Iterator[Callable[[], int]]:
  """``with count_compilations() as counted: ...``; ``counted()`` is the number of XLA compilations so far inside
  (but those of threads named ``UNCOUNTED_THREAD_PREFIX...``, such as the first-batch check's)."""
  start = _seen[0]
  yield lambda: _seen[0] - start


class Compilations:
  """:attr:`compilations` of :class:`~brainpy_accum.AccumBPTT` (a mixin that keeps its own counts)."""

  @property
  def compilations(self) -> Dict[str, int]:
    """XLA compilations so far of the train (``'fit'``) and evaluation (``'loss'``) steps run by :meth:`fit`.

    Counted from JAX's backend-compilation events while a step is called, so it
    is exact with or without a mesh: one per distinct batch shape (and, with
    ``accumulate_steps`` on a mesh, one more for the step that only collects).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(3, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2, progress_bar=False)
    >>> trainer.fit([(np.ones((4, 5, 3), 'float32'), np.ones((4, 5, 2), 'float32'))] * 3, num_epoch=2)
    ... # doctest: +ELLIPSIS
    Train 0 epoch, ...
    Train 1 epoch, ...
    >>> trainer.compilations
    {'fit': 1, 'loss': 0}
    """
    return dict(self._compilation_counts)

  @property
  def _compilation_counts(self) -> Dict[str, int]:
    return self.__dict__.setdefault('_compilations', {'fit': 0, 'loss': 0})

  def _note_compilations(self, phase: str, count: int) -> None:
    """Add ``count`` XLA compilations to :attr:`compilations` (``phase`` is ``'fit'`` or ``'loss'``)."""
    self._compilation_counts[phase] += count
