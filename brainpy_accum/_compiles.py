"""Counting XLA compilations as they happen, from JAX's own monitoring events.

A jitted step compiled for sharded inputs can grow JAX's dispatch cache
without compiling again, so the trainer counts the backend compilations
themselves (``/jax/core/compile/backend_compile_duration``) that happen while
one of its steps is called.
"""

import contextlib
from typing import Callable, Iterator

import jax.monitoring

__all__ = ['count_compilations']

_BACKEND_COMPILE = '/jax/core/compile/backend_compile_duration'
_seen = [0]


def _listener(event: str, duration_secs: float, **kwargs) -> None:
  if event == _BACKEND_COMPILE:
    _seen[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


@contextlib.contextmanager
def count_compilations() -> Iterator[Callable[[], int]]:
  """``with count_compilations() as counted: ...``; ``counted()`` is the number of XLA compilations so far inside."""
  start = _seen[0]
  yield lambda: _seen[0] - start
