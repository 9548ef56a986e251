"""The key of a cached plan: everything the memory planner's choice depends on, as JSON.

The model (its classes, the code of their ``update`` methods, every Variable's shape and dtype: parameters,
model states at the batch's size, optimizer state), the loss (its code), the batch (tree, shapes, dtypes), the
options (budget, remat, reduction, windows, clipping, ...), the versions of Python, jax, jaxlib, brainpy,
brainstate and this package, XLA's flags and the device kind. Code is hashed from its bytecode, constants and
names, which are exact for one Python version (the version is part of the key). Whatever the key misses (a constant a loss
captures, say) cannot make a plan unsafe: a cached plan's step is compiled again and must fit the budget.
"""

import hashlib
import json
import os
import platform
import types
from typing import Any, Callable, Iterable, Optional, Sequence

import brainpy
import brainpy.math as bm
import brainstate
import jax
import jaxlib
import numpy as np

__all__ = ['plan_key']

_FORMAT = 1  # the planner's own version: raise it when planning changes what it picks


def _code(fn: Any) -> Optional[str]:
  """A digest of ``fn``'s code (methods and partials unwrapped), or its type's name if it has none."""
  fn = getattr(fn, '__func__', fn)
  while hasattr(fn, 'func'):  # functools.partial
    fn = fn.func
  code = getattr(fn, '__code__', None)
  if code is None:
    return None if fn is None else type(fn).__qualname__
  return hashlib.sha256(json.dumps(_code_parts(code)).encode()).hexdigest()[:24]


def _code_parts(code: types.CodeType) -> list:
  """What a code object computes, as JSON: its bytecode, constants (nested code objects likewise), names and
  flags; not where it lies (file, lines). Not ``marshal.dumps``: its bytes depend on the reference counts of
  the constants at the moment (its reference flags), so one function could get two keys in one process."""
  return [code.co_code.hex(), [_const(c) for c in code.co_consts], list(code.co_names), list(code.co_varnames),
          list(code.co_freevars), list(code.co_cellvars), code.co_argcount, code.co_kwonlyargcount, code.co_flags]


def _const(value: Any) -> Any:
  if isinstance(value, types.CodeType):
    return _code_parts(value)
  if isinstance(value, (tuple, list)):
    return [type(value).__name__, [_const(v) for v in value]]
  if isinstance(value, (frozenset, set)):  # its order changes with the string hash seed: sorted
    return [type(value).__name__, sorted(json.dumps(_const(v)) for v in value)]
  return [type(value).__name__, repr(value)]


def _arrays(tree) -> list:
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  shapes = [[list(np.shape(x)), str(getattr(x, 'dtype', type(x).__name__))] for x in leaves]
  return [str(treedef), shapes]


def plan_key(model, variables: Iterable, losses: Sequence[Callable], options: dict, shared_args, inputs, targets
             ) -> dict:
  """The key of the plan of this batch: ``model`` (a DynamicalSystem: its nodes' classes and the code of their
  ``update``), ``variables`` (every Variable the step reads: shapes and dtypes), ``losses`` (the functions
  whose code the step runs: the loss, ``loss_weight_fn``), ``options`` (the trainer's options as JSON, the
  budget among them) and the batch."""
  nodes = list(model.nodes().unique().values())
  device = jax.devices()[0]
  return {
    'planner': _FORMAT,
    'versions': [platform.python_version(), jax.__version__, jaxlib.__version__, brainpy.__version__,
                 brainstate.__version__, _package_version()],
    'device': [device.platform, getattr(device, 'device_kind', ''), os.environ.get('XLA_FLAGS', '')],
    'model': [[type(n).__qualname__, _code(getattr(type(n), 'update', None))] for n in nodes],
    'variables': [[type(v).__name__, list(np.shape(v.value)), str(bm.as_jax(v.value).dtype)] for v in variables],
    'loss': [_code(fn) for fn in losses],
    'batch': [_arrays(inputs), _arrays(targets)],
    'shared_args': sorted((str(k), repr(v)) for k, v in dict(shared_args or {}).items()),
    'options': options,
  }


def _package_version() -> str:
  from .. import __version__
  return __version__
