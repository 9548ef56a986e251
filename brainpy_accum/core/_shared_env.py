"""BrainPy's shared environment (``bp.share``) put back as it was after a traced model step, so no tracer outlives
its trace.

BrainPy's time step writes the step's shared values into a global environment, ``bp.share.save(i=..., t=...,
dt=..., **shared_args)``, and models may save more. Inside a traced step those values are JAX tracers, and BrainPy
never removes them: after ``bp.BPTT``'s ``fit`` or ``predict``, ``bp.share.load('t')`` is a tracer of a finished
trace, and a run under :func:`jax.checking_leaks` fails with ``Leaked trace``. JAX checks for leaks when each
trace ends, the innermost first (the time loop's body), so the environment must be whole again before the traced
function returns, not after the compiled step::

  before = the environments' settings and context stacks
  out = step(...)            # bp.share.save(i=tracer, t=tracer, ...)
  put back what differs from before
  return out

``bp.share`` is built on :mod:`brainstate.environ`: brainpy 2.8's share keeps its values in an
``EnvironmentState`` of its own (``brainpy.math.defaults.env``), later ones in brainstate's global one; both are
put back, and so is anything a model writes with ``brainstate.environ.set``. The values a step saves are meant
for that step (the next one saves its own), so nothing a model can read inside the step changes.
"""

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, List, Tuple

import brainstate.environ

__all__ = ['restores_shared_env', 'shared_env_restored', 'shared_environments']

_Snapshot = List[Tuple[Any, Dict[Any, Any], Dict[Any, list]]]


def shared_environments() -> list:
  """The ``brainstate.environ.EnvironmentState`` objects that ``bp.share`` and brainstate's ``environ`` write."""
  found = [brainstate.environ._ENV_STATE]  # reassigned by brainstate.environ.reset(): read it at every call
  try:
    from brainpy.math import defaults
  except ImportError:  # a brainpy whose share lives in brainstate's global environment only
    return found
  own = getattr(defaults, 'env', None)
  if isinstance(own, brainstate.environ.EnvironmentState) and all(own is not env for env in found):
    found.append(own)
  return found


def _snapshot() -> _Snapshot:
  # EnvironmentState is thread-local: these are the calling thread's settings, the ones its trace writes
  return [(env, dict(env.settings), {key: list(stack) for key, stack in env.contexts.items()})
          for env in shared_environments()]


def _put_back(snapshot: _Snapshot) -> None:
  """Settings and context stacks as in ``snapshot``: values put back by identity (a tracer is never compared by
  value), keys added since removed; in place, since BrainPy and brainstate hold these very dicts."""
  for env, settings, contexts in snapshot:
    for key in [key for key in env.settings if key not in settings]:
      del env.settings[key]
    for key, value in settings.items():
      if env.settings.get(key, _MISSING) is not value:
        env.settings[key] = value
    for key, stack in env.contexts.items():
      saved = contexts.get(key, [])
      if len(stack) != len(saved) or any(a is not b for a, b in zip(stack, saved)):
        stack[:] = saved


_MISSING = object()


@contextlib.contextmanager
def shared_env_restored() -> Iterator[None]:
  """BrainPy's shared environment (``bp.share``, brainstate's ``environ``) as it was on entering, on leaving.

  Use it inside a function that JAX traces, around what calls ``bp.share.save``, so that the values saved there
  (tracers) are gone when the trace ends, also when it raises.

  Examples
  --------
  >>> import brainpy as bp, jax, jax.numpy as jnp
  >>> from brainpy_accum.core._shared_env import shared_env_restored
  >>> def step(t):
  ...   with shared_env_restored():
  ...     bp.share.save(t=t)
  ...     return bp.share.load('t') * 2.
  >>> bp.share.save(t=0.)
  >>> with jax.checking_leaks():
  ...   float(jax.jit(step)(jnp.float32(1.5)))
  3.0
  >>> bp.share.load('t')  # as before, not a tracer
  0.0
  """
  snapshot = _snapshot()
  try:
    yield
  finally:
    _put_back(snapshot)


def restores_shared_env(fn: Callable) -> Callable:
  """``fn`` run inside :func:`shared_env_restored`: a method or function that JAX traces and that saves to
  ``bp.share``.

  Examples
  --------
  >>> import brainpy as bp, jax, jax.numpy as jnp
  >>> from brainpy_accum.core._shared_env import restores_shared_env
  >>> @restores_shared_env
  ... def step(i):
  ...   bp.share.save(i=i)
  ...   return bp.share.load('i') + 1
  >>> bp.share.save(i=0)
  >>> with jax.checking_leaks():
  ...   int(jax.jit(step)(jnp.int32(1)))
  2
  >>> bp.share.load('i')
  0
  """

  @functools.wraps(fn)
  def restoring(*args, **kwargs):
    with shared_env_restored():
      return fn(*args, **kwargs)

  return restoring
