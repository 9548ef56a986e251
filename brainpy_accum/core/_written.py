"""States without a batch axis that the forward pass writes: every micro-batch starts from the step's values.

``bp.BPTT`` runs the whole batch forward once. A write inside ``update`` (a weight clipped to a sign, masked
by Dale's law or rescaled; a counter of time steps; a record for plotting) happens once, from the values
the step started with, and the gradient is taken through it; the optimizer then updates the written value.
Cut into micro-batches, the write made by one micro-batch's forward would be where the next one starts: a
clipped weight entry at 0 would let the next micro-batch's gradient through ``where(0 < 0, 0, w)``. So::

  starts = values of the written states when the step starts
  for each micro-batch i:
    written states <- starts                      # every forward starts where the whole batch's does
    forward and backward of micro-batch i         # writes them
    first <- what micro-batch 0 wrote;  apart |= (what micro-batch i wrote != first)
  written states <- first                          # what every micro-batch, and bp.BPTT, wrote

A write that does not depend on the data (a clip, a mask, a rescaling, a count of time steps) is the same in
every micro-batch and equals the whole batch's: exact. A write that depends on the data (a Hebbian term, a
batch statistic, a record of a sample) differs between micro-batches (``apart``): no micro-batch's write is
the whole batch's in general, so the step reports it and the host warns once per state, naming it, what it
holds and the fix (:class:`WriteReport`). Random keys are not restarted: each micro-batch draws fresh numbers.

The states are found while the micro-batch loop is traced (:func:`written_by`); a first trace that finds
some is given up and traced again with them (:class:`Unwatched`), so a model that writes none traces once
and compiles the program it compiled before.
"""

import functools
import warnings
import weakref
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from ._combine import same_type

__all__ = ['Unwatched', 'WriteReport', 'Written', 'apart_across_devices', 'differs', 'fingerprint', 'is_trainable',
           'restart', 'restarted', 'written_by']


class Written(NamedTuple):
  """The states without a batch axis that a step's micro-batches wrote.

  ``states``: the States; ``starts``: their values when the step started, where every micro-batch started;
  ``apart``: for each, a traced bool, True where the micro-batches wrote different values.
  """
  states: Tuple = ()
  starts: Tuple = ()
  apart: Tuple = ()


class Unwatched(Exception):
  """Raised while the micro-batch loop is traced: its micro-batches write ``states`` that it does not restart
  yet (caught by the loop, which traces again with them)."""

  def __init__(self, states: list):
    super().__init__(f'{len(states)} states written by a micro-batch')
    self.states = states


def is_trainable(state) -> bool:
  """A parameter: a brainpy ``TrainVar`` or a brainstate ``ParamState``."""
  return isinstance(state, (bm.TrainVar, brainstate.ParamState))


def written_by(trace: brainstate.StateTraceStack, skip: set) -> list:
  """The states ``trace`` saw written, random keys and those whose ids are in ``skip`` (the batched ones) aside."""
  return [s for s, wrote in zip(trace.states, trace.been_writen)
          if wrote and id(s) not in skip and not isinstance(s, brainstate.random.RandomState)]


def restart(states: Sequence, values: Sequence) -> None:
  """Give ``states`` the ``values`` (their dtypes and weak types kept: the scan carries them)."""
  for state, value in zip(states, values):
    state.value = jax.tree_util.tree_map(same_type, value, state.value)


def restarted(call: Callable, watched: Written, skip: set, index, firsts: list):
  """``call()``, one micro-batch (number ``index``) of the loop: the ``watched`` states first given their
  ``starts``; after it, the first micro-batch's writes kept in ``firsts`` and ``apart`` set where a later one
  wrote something else. Returns ``(call's result, firsts, apart)``. Raises :class:`Unwatched` if it wrote other
  states (``skip``: the ids of those the loop cuts, and of the watched ones)."""
  restart(watched.states, watched.starts)
  with brainstate.StateTraceStack() as trace:
    out = call()
  unwatched = written_by(trace, skip)
  if unwatched:
    trace.recovery_original_values()  # (without jit the micro-batch has run: what it wrote is put back)
    raise Unwatched(unwatched)
  later = index > 0
  written = [s.value for s in watched.states]
  apart = [a | (later & differs(new, first)) for new, first, a in zip(written, firsts, watched.apart)]
  firsts = [jax.tree_util.tree_map(lambda n, f: jnp.where(later, f, same_type(n, f)), new, first)
            for new, first in zip(written, firsts)]
  return out, firsts, apart


def differs(a, b) -> jax.Array:
  """True where two values of a state differ anywhere (NaN equals NaN: a write of NaN is still the same write)."""
  def leaf(x, y):
    same = x == y
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      same = same | (jnp.isnan(x) & jnp.isnan(y))
    return jnp.any(~same)
  return functools.reduce(jnp.logical_or, jax.tree_util.tree_leaves(jax.tree_util.tree_map(leaf, a, b)),
                          jnp.asarray(False))


def _mix(h):
  """MurmurHash3's finaliser on uint32: every input bit moves every output bit."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x) -> jax.Array:
  """The bits of every element of ``x`` as uint32 words (64-bit elements give two)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).ravel()
  width = x.dtype.itemsize * 8
  unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}[min(width, 64)]
  if width == 64 or jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


def fingerprint(value) -> jax.Array:
  """A uint32 of every bit of ``value`` (a pytree) and its position: equal values give equal prints in any
  program (integer sums do not depend on their order), different ones differ but for one chance in 2**32."""
  total = jnp.zeros((), jnp.uint32)
  for i, leaf in enumerate(jax.tree_util.tree_leaves(value)):
    bits = _bits(leaf)
    salt = jnp.arange(bits.size, dtype=jnp.uint32) * np.uint32(0x9E3779B9) + np.uint32(i * 0x632BE5AB)
    total = total + jnp.sum(_mix(bits ^ _mix(salt)), dtype=jnp.uint32)
  return _mix(total)


def apart_across_devices(written: Written, mesh_axis: str) -> Tuple:
  """Inside ``shard_map``: for each state of ``written``, True where the devices of ``mesh_axis`` hold different
  values of it (each wrote it from its own share of the batch)."""
  prints = jnp.stack([fingerprint(s.value) for s in written.states])
  return tuple(jax.lax.pmax(prints, mesh_axis) != jax.lax.pmin(prints, mesh_axis))


class WriteReport:
  """The host's side of :class:`Written`: a warning for every state whose writes differed, once per state.

  ``names``: ``{id(state): name}`` for the warnings (a trainer's ``model.vars()`` paths, the keys of
  ``grad_states``); other states are named by their type and shape. ``holds``: what such a state holds after
  a step, where the caller knows better than the micro-batch loop (a trainer whose updates close a window).
  """

  def __init__(self, names: Optional[Dict[int, str]] = None, holds: Optional[str] = None):
    self.names, self.holds = dict(names or {}), holds
    self._warned = weakref.WeakValueDictionary()  # id -> the state: an id freed and reused warns again

  def name_of(self, state) -> str:
    """The state's name for a warning: given, its own, or its type and shape (``State(shape=(3,))``)."""
    name = self.names.get(id(state)) or getattr(state, 'name', None)
    return name or f'{type(state).__name__}(shape={jax.tree_util.tree_map(np.shape, state.value)})'

  def report(self, written: Optional[Written], holds: str) -> None:
    """Inside the step: the host warns for each state of ``written`` whose micro-batches wrote different values
    (``holds``: what such a state holds after the step); nothing when none was written."""
    if written is None or not written.states:
      return
    states = tuple(written.states)
    jax.debug.callback(functools.partial(self._warn, states, self.holds or holds), jnp.stack(written.apart))

  def _warn(self, states: tuple, holds: str, apart) -> None:
    for state, flag in zip(states, np.asarray(apart)):
      if not flag or self._warned.get(id(state)) is state:
        continue
      self._warned[id(state)] = state
      warnings.warn(_message(self.name_of(state), is_trainable(state), holds), UserWarning, stacklevel=1)


def _message(name: str, trainable: bool, holds: str) -> str:
  if trainable:
    return (f'The trainable {name} is written in the forward pass with values that depend on the data (they '
            f'differed between micro-batches: a Hebbian term, a batch statistic, ...). A whole-batch step '
            f'(bp.BPTT) writes it once from the whole batch; here each micro-batch\'s forward pass and gradient saw '
            f'its own write, and {name} holds {holds}, then the optimizer\'s update: training differs from '
            f'whole-batch training. Use num_micro_batch=1 (and accumulate_steps=1) for this model, or move the '
            f'write out of the forward pass (apply it to the parameters between steps).')
  return (f'Model state {name} has no batch axis, and the forward pass writes it with values that depend on the '
          f'samples (they differed between micro-batches: a record of a sample, a batch statistic, a sum over '
          f'samples). After the step it holds {holds}; a whole-batch step (bp.BPTT) leaves what the whole batch '
          f'writes, the same only where the write reads the first samples alone (a record of sample 0). If it '
          f'holds one value per sample, give it a batch axis (bm.Variable(..., batch_axis=0)); for a batch '
          f'statistic use num_micro_batch=1, or compute it outside the training step.')
