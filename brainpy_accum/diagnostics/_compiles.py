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

__all__ = ['Compilations', 'Compiling', 'QUICK_COMPILE', 'count_compilations']

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
  """XLA compilations of a trainer's train (``'fit'``) and evaluation (``'loss'``) steps, counted as fit calls
  them (:attr:`~brainpy_accum.AccumBPTT.compilations`).

  Examples
  --------
  >>> from brainpy_accum.diagnostics._compiles import Compilations
  >>> counts = Compilations()
  >>> counts.note('fit', 2)
  >>> counts.counts
  {'fit': 2, 'loss': 0}
  """

  def __init__(self):
    self.counts: Dict[str, int] = {'fit': 0, 'loss': 0}

  def note(self, phase: str, count: int) -> None:
    """Add ``count`` XLA compilations to ``phase`` (``'fit'`` or ``'loss'``)."""
    self.counts[phase] += count


class Compiling:
  """``lowered`` (a ``jax.stages.Lowered``) compiled into JAX's caches on a thread of its own, so that the thread
  that lowered it goes on meanwhile; a later call of the same jitted function with the same arguments finds it
  compiled. :meth:`wait` joins the thread and gives ``noted(1)`` where it compiled; a failure (out of device memory)
  is left to that call, which compiles again and raises it where it is handled.

  Examples
  --------
  >>> import jax, jax.numpy as jnp
  >>> f = jax.jit(lambda x: x * 2)
  >>> noted = []
  >>> Compiling(f.lower(jnp.ones(3)), noted.append).wait()
  >>> with count_compilations() as counted:
  ...   y = f(jnp.ones(3))
  >>> noted, counted()
  ([1], 0)
  """

  def __init__(self, lowered, noted: Callable[[int], None]):
    self._noted, self._compiled = noted, False
    self._thread = threading.Thread(target=self._compile, args=(lowered,), name='brainpy_accum compile', daemon=True)
    self._thread.start()

  def _compile(self, lowered) -> None:
    try:
      lowered.compile()
    except Exception:  # noqa: BLE001 -- see the class's docstring
      return
    self._compiled = True

  def wait(self) -> None:
    """Wait for the compilation; note it where it succeeded."""
    self._thread.join()
    self._noted(int(self._compiled))
