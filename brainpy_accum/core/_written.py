"""States without a batch axis that the forward pass writes: every micro-batch starts from the step's values.

``bp.BPTT`` runs the whole batch forward once. A write inside ``update`` (a weight clipped to a sign, masked
by Dale's law or rescaled; a counter of time steps; a record for plotting) happens once, from the values
the step started with, and the gradient is taken through it; the optimizer then updates the written value.
Cut into micro-batches, the write made by one micro-batch's forward would be where the next one starts: a
clipped weight entry at 0 would let the next micro-batch's gradient through ``where(0 < 0, 0, w)``. So::

  for each micro-batch i of N:
    forward and backward of micro-batch i          # writes them, from the values the step started with
    prints[i] <- a print of what it wrote
    written states <- what it wrote if i = N - 1, else the values it started with
  apart = any(prints != prints[0])

A write that does not depend on the data (a clip, a mask, a rescaling, a count of time steps) is the same in
every micro-batch and equals the whole batch's: exact. A write that depends on the data (a Hebbian term, a
batch statistic, a record of a sample) differs between micro-batches (``apart``): no micro-batch's write is
the whole batch's in general, so the step reports it and the host warns once per state, naming it, what it
holds and the fix (:class:`WriteReport`). Random keys are not put back: each micro-batch draws fresh numbers.

No step calls back to the host for this (on an accelerator with ``JAX_PLATFORMS=tpu`` there is no CPU backend to
run a callback, and elsewhere it is a device-to-host trip in every step): a trainer's steps OR their ``apart``
flags into a Variable (:class:`WriteEvidence`), an ordinary output of the step, which the host reads where the fit
loop reads the losses. Flags known on the host (a call outside ``jit``) are warned of at once; only the functional
core inside a user's ``jit``, which has no such place, sends them by a host callback, where JAX has a CPU backend.

The states are found as the micro-batch loop is traced, each micro-batch's prints leave the loop stacked,
and the last micro-batch keeps its writes: nothing needs to be known before the loop, so a model that writes
no such state traces once and compiles the program it compiled before.
"""

import functools
import os
import warnings
import weakref
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from ._combine import same_type

__all__ = ['WriteEvidence', 'WriteReport', 'Written', 'apart_across_devices', 'fingerprint', 'host_callbacks_run',
           'is_trainable', 'kept_last', 'progress_bars_run', 'restart', 'values_before', 'written_by']


class Written(NamedTuple):
  """The states without a batch axis that a step's micro-batches wrote.

  ``states``: the States, which hold what the last micro-batch wrote; ``starts``: their values when the step
  started, where every micro-batch started; ``apart``: for each, a traced bool, True where the micro-batches
  wrote different values.
  """
  states: Tuple = ()
  starts: Tuple = ()
  apart: Tuple = ()


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


def kept_last(trace: brainstate.StateTraceStack, skip: set, last) -> Tuple[list, list]:
  """After one micro-batch, traced in ``trace``: the states without a batch axis that it wrote (``skip``: the ids
  of the batched ones) and a print of what it wrote to each (:func:`fingerprint`); each is put back to the value
  it started from, unless ``last`` (the loop's last micro-batch keeps its writes)."""
  wrote = written_by(trace, skip)
  prints = [fingerprint(s.value) for s in wrote]
  for state, start in zip(wrote, values_before(trace, wrote)):
    state.value = jax.tree_util.tree_map(lambda new, old: same_type(jnp.where(last, new, old), old), state.value,
                                         start)
  return wrote, prints


def values_before(trace: brainstate.StateTraceStack, states: Sequence) -> Tuple:
  """The values that ``states`` had before ``trace`` first saw them."""
  before = dict(zip(map(id, trace.states), trace.original_state_values))
  return tuple(before[id(s)] for s in states)


def _mix(h):
  """MurmurHash3's finaliser on uint32: every input bit moves every output bit."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x) -> jax.Array:
  """The bits of every element of ``x`` as uint32 words (an element of 64 bits or more gives several)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).ravel()
  if x.dtype.itemsize >= 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
  return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[x.dtype.itemsize]).astype(jnp.uint32).ravel()


def fingerprint(value) -> jax.Array:
  """A uint32 of every bit of ``value`` (a pytree) and its place: equal values give equal prints in any program
  (sums of integers do not depend on their order), different ones differ but for one chance in 2**32.

  Examples
  --------
  >>> import jax.numpy as jnp
  >>> w = jnp.asarray([0.5, -0.3, 0.2])
  >>> bool(fingerprint(w) == fingerprint(jnp.where(w < 2, w, 0.))), bool(fingerprint(w) == fingerprint(w[::-1]))
  (True, False)
  """
  total = jnp.zeros((), jnp.uint32)
  for i, leaf in enumerate(jax.tree_util.tree_leaves(value)):
    bits = _bits(leaf)
    salt = jnp.arange(bits.size, dtype=jnp.uint32) * np.uint32(0x9E3779B9) + np.uint32((i * 0x632BE5AB) % 2 ** 32)
    total = total + jnp.sum(_mix(bits ^ _mix(salt)), dtype=jnp.uint32)
  return _mix(total)


def apart_across_devices(written: Written, mesh_axis: str) -> Tuple:
  """Inside ``shard_map``: for each state of ``written``, True where the devices of ``mesh_axis`` hold different
  values of it (each wrote it from its own share of the batch)."""
  prints = jnp.stack([fingerprint(s.value) for s in written.states])
  return tuple(jax.lax.pmax(prints, mesh_axis) != jax.lax.pmin(prints, mesh_axis))


class WriteEvidence:
  """The written-state evidence of a trainer's compiled steps, as an ordinary output of each step: a Variable of
  flags that every step writing a state ORs its ``apart`` flags into, read by the host when the fit loop reports
  (no host callback inside a step: on an accelerator with ``JAX_PLATFORMS=tpu`` there is no CPU to run one).

  ``watchable``: the States a step may write (a trainer's model Variables), one flag each, kept by identity;
  other States take one of ``extra`` flags in the order the steps' traces meet them (past those, the last is
  shared). ``mesh_axis``: inside ``shard_map`` over this axis (every step of a trainer with a mesh), each flag is
  set where any device's is, so the Variable stays replicated.

  Examples
  --------
  >>> import brainpy.math as bm, jax.numpy as jnp, numpy as np
  >>> w, count = bm.Variable(jnp.ones(3)), bm.Variable(jnp.zeros(()))
  >>> evidence = WriteEvidence([w, count])
  >>> evidence.record((w, count), 'what the last micro-batch wrote', (jnp.asarray(False), jnp.asarray(True)))
  >>> [(state is count, holds) for state, holds in evidence.flagged()]
  [(True, 'what the last micro-batch wrote')]
  """

  EXTRA = 8

  def __init__(self, watchable: Sequence = (), mesh_axis: Optional[str] = None, extra: int = EXTRA):
    self._slots = {id(state): i for i, state in enumerate(watchable)}
    self._size, self.mesh_axis = len(self._slots) + max(1, extra), mesh_axis
    # (made from NumPy zeros: copied to the device, no program compiled for them when a trainer is built)
    self.flags = bm.Variable(jax.device_put(np.zeros((self._size,), bool)))
    self._met: Dict[int, Dict[int, Tuple[weakref.ref, str]]] = {}  # flag -> {id: (the State, what it holds)}

  @property
  def recorded(self) -> bool:
    """Whether any step's trace wrote a flag (else nothing is read)."""
    return bool(self._met)

  def _slot(self, state) -> int:
    slot = self._slots.get(id(state))
    if slot is None:  # not watchable: the next of the extra flags, once
      slot = min(len(self._slots), self._size - 1)
      self._slots[id(state)] = slot
    return slot

  def record(self, states: Sequence, holds: str, apart: Sequence) -> None:
    """While a step is traced: OR each traced ``apart`` flag into its state's flag (``holds``: what such a
    state holds after the step, for the warning)."""
    flags = self.flags.value
    for state, flag in zip(states, apart):
      if self.mesh_axis is not None:  # every device's micro-batches, and the devices' shares
        flag = jax.lax.pmax(jnp.asarray(flag, jnp.int32), self.mesh_axis) > 0
      slot = self._slot(state)
      met = self._met.setdefault(slot, {})
      before = met.get(id(state))
      met[id(state)] = (weakref.ref(state), holds if before is None or before[1] == holds else _SOME_HOLDS)
      flags = flags.at[slot].set(flags[slot] | flag)
    self.flags.value = flags

  def flagged(self) -> list:
    """On the host: ``(state, holds)`` of every state whose flag a step set (waits for the last step that wrote
    the flags: read it where the fit loop reads the losses)."""
    if not self._met:
      return []
    flags = np.asarray(self.flags.value)
    found = []
    for slot, met in sorted(self._met.items()):
      if flags[slot]:
        found += [(ref(), holds) for ref, holds in met.values() if ref() is not None]
    return found


# what a state holds after steps whose traces said different things (batches of several sizes)
_SOME_HOLDS = 'what the last micro-batch of a step wrote'


class WriteReport:
  """The host's side of :class:`Written`: a warning for every state whose writes differed, once per state.

  ``names``: ``{id(state): name}`` for the warnings (a trainer's ``model.vars()`` paths, the keys of
  ``grad_states``); other states are named by their type and shape. ``holds``: what such a state holds after
  a step, where the caller knows better than the micro-batch loop (a trainer whose updates close a window).
  ``evidence``: where a traced step's flags go (:class:`WriteEvidence`; the host reads them with :meth:`read`).
  Without one, a traced step's flags reach the host by a host callback where the platform has a CPU backend
  (the functional core, inside a user's ``jit``), and otherwise the trace warns that they cannot be checked.
  Flags known on the host already (a call outside ``jit``) are warned of at once.
  """

  def __init__(self, names: Optional[Dict[int, str]] = None, holds: Optional[str] = None,
               evidence: Optional[WriteEvidence] = None):
    self.names, self.holds, self.evidence = dict(names or {}), holds, evidence
    self._warned = weakref.WeakValueDictionary()  # id -> the state: an id freed and reused warns again

  def name_of(self, state) -> str:
    """The state's name for a warning: given, its own, or its type and shape (``State(shape=(3,))``)."""
    name = self.names.get(id(state)) or getattr(state, 'name', None)
    return name or f'{type(state).__name__}(shape={jax.tree_util.tree_map(np.shape, state.value)})'

  def report(self, written: Optional[Written], holds: str) -> None:
    """The states of ``written`` whose micro-batches wrote different values (``holds``: what such a state holds
    after the step): warned of now where the flags are known, else recorded for :meth:`read` (or sent to the
    host); nothing when none was written."""
    if written is None or not written.states:
      return
    states, holds = tuple(written.states), self.holds or holds
    if not any(isinstance(flag, jax.core.Tracer) for flag in written.apart):
      self._warn(states, holds, [bool(flag) for flag in written.apart])
    elif self.evidence is not None:
      self.evidence.record(states, holds, written.apart)
    elif host_callbacks_run():
      jax.debug.callback(functools.partial(self._warn, states, holds), jnp.stack(written.apart))
    else:
      self._cannot_check(states)

  def read(self) -> None:
    """On the host, where the losses are read: warn of the states whose flags the steps set
    (:class:`WriteEvidence`)."""
    if self.evidence is not None and self.evidence.recorded:
      for state, holds in self.evidence.flagged():
        self._warn((state,), holds, (True,))

  def _warn(self, states: tuple, holds: str, apart) -> None:
    for state, flag in zip(states, np.asarray(apart)):
      if not flag or self._warned.get(id(state)) is state:
        continue
      self._warned[id(state)] = state
      warnings.warn(_message(self.name_of(state), is_trainable(state), holds, _is_batch_statistic(state)),
                    UserWarning, stacklevel=1)

  def _cannot_check(self, states: tuple) -> None:
    new = [s for s in states if self._warned.get(id(s)) is not s]
    if not new:
      return
    for state in new:
      self._warned[id(state)] = state
    warnings.warn(f'The forward pass writes {", ".join(map(self.name_of, new))}, which have no batch axis: each '
                  f'micro-batch starts from their values before the call and the last one\'s writes are kept, exact '
                  f'for a write that does not depend on the data (a clip, a mask, a counter). Whether the '
                  f'micro-batches wrote different values cannot be checked inside jit here: JAX has no CPU backend '
                  f'for a host callback (JAX_PLATFORMS={os.environ.get("JAX_PLATFORMS", "")!r}). Add cpu to '
                  f'JAX_PLATFORMS, or call the gradient function once outside jit to have it checked.',
                  UserWarning, stacklevel=2)


def host_callbacks_run() -> bool:
  """Whether a host callback can run inside a compiled program here: JAX has a CPU backend to place its inputs
  on (``JAX_PLATFORMS=tpu`` or ``cuda`` leaves none)."""
  try:
    return bool(jax.devices('cpu'))
  except RuntimeError:
    return False


def progress_bars_run(variables) -> bool:
  """Whether BrainPy's per-time-step progress bar, an ordered host callback compiled into the run, can run in a
  program over ``variables``: JAX has a CPU backend (:func:`host_callbacks_run`) and none of them is laid over
  several devices (as ``fit`` on a mesh leaves the parameters: JAX refuses ordered effects in such a program)."""
  spread = any(len(getattr(getattr(var.value, 'sharding', None), 'device_set', ())) > 1 for var in variables)
  return not spread and host_callbacks_run()


def _is_batch_statistic(state) -> bool:
  """A brainstate ``BatchState``: what normalisation layers keep (BatchNorm's running mean and variance)."""
  return isinstance(state, getattr(brainstate, 'BatchState', ()))


def _message(name: str, trainable: bool, holds: str, batch_statistic: bool = False) -> str:
  if batch_statistic:
    return (f'{name} is a batch statistic (a BatchState: a BatchNorm layer\'s running mean or variance) that the '
            f'forward pass writes from the samples. A layer that normalises by batch statistics in training '
            f'normalises each micro-batch by its own statistics, not the batch\'s: the gradient and the loss '
            f'differ from whole-batch training, and {name} holds {holds}. For exact training use a layer without '
            f'batch statistics (LayerNorm), or num_micro_batch=1; the layer in evaluation mode (fit=False) reads '
            f'its statistics only, which is exact.')
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
          f'writes, the same only where the write reads the last samples alone (a record of the last sample, not '
          f'of sample 0). If it holds one value per sample, give it a batch axis (bm.Variable(..., batch_axis=0); '
          f'a brainstate state: micro_batched_grad(..., states=[(state, 0)])); '
          f'for a batch statistic use num_micro_batch=1, or compute it outside the training step.')
