"""Which model states a micro-batch cuts, and along which axis.

Each micro-batch must start from its own samples of the batch's model state and leave its final state there,
so that the state after the batch is the whole batch's. The rule, for the states the loss touches when it is
traced (not run) on the whole batch:

- a brainpy ``Variable`` with a ``batch_axis`` (BrainPy's layers set it), not a ``TrainVar``: cut on that axis;
- a brainpy ``Variable`` without one (``bm.Variable(bm.zeros((batch_size, n)))``, as some of BrainPy's
  examples write), not a ``TrainVar`` nor a random state, whose leading axis holds as many rows as the
  batch has samples (and the batch more than one): cut on axis 0, with a one-time warning that names it
  (see :func:`implicit_batch_axis`);
- a brainstate ``ShortTermState`` (``HiddenState`` is one) whose every leaf holds the batch on axis 0 once the
  whole-batch loss has run: cut on axis 0;
- random keys: carried from one micro-batch to the next, so each draws fresh numbers;
- any other state the loss writes (a parameter clipped in the forward pass, a counter, a record without the
  batch): every micro-batch starts from its value before the batch, and it ends as the last micro-batch wrote
  it (:mod:`~brainpy_accum.core._written`).

A cut state that holds one sample, or none, on its batch axis (``model.reset(1)``, ``init_all_states(model)``)
is broadcast to the batch first, as the whole-batch run broadcasts it. A state the loss creates itself
(``init_all_states(model, size)`` inside the loss) is caught as it is created; those with the micro-batch on
axis 0 are stitched back into whole-batch values. ``states=`` replaces the rule.

When a state stops the cut:

- A gradient with respect to a state the micro-batches would cut (a batched ``HiddenState``) would come in
  pieces, one per micro-batch: refused by name before anything changes (:func:`refuse_batched_grads`).
- An error while the micro-batches are traced leaves every state the loss touches as it was before the call
  (:func:`states_put_back`), so that the corrected call starts from the same model. Where a state left whole
  holds as many entries as the batch has samples on some axis, the error (a shape that does not broadcast, a
  ``cond`` whose branches differ, JAX's or the loss's) is re-raised as a ``ValueError`` that also names that
  state and ``states=``: a per-sample state the discovery rule does not cut (a plain ``ShortTermState`` of
  ``(B,)``, a delay line of ``(L, B, H)``) writes the whole batch's shape in a micro-batch.
"""

import contextlib
import warnings
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from ._cut import is_int

__all__ = ['all_samples', 'batched_variables', 'declared_batch_axes', 'whole_batch_variables', 'implicit_batch_axis', 'variable_batch_axis', 'batch_axis_of', 'batch_shapes', 'discover_states', 'is_state', 'loss_catching_new_states', 'named_states',
           'prepare_states', 'refuse_batched_grads', 'restore_values', 'states_put_back', 'values_of', 'values_restored',
           'whole_batch']


def is_state(x) -> bool:
  return isinstance(x, brainstate.State)


def named_states(states):
  """``states=`` as ``(State, axis)`` pairs: a bare State takes its ``batch_axis`` if it has one, else 0."""
  if states is None:
    return None
  items = states.values() if isinstance(states, dict) else states if isinstance(states, (list, tuple)) else [states]
  pairs = []
  for item in items:
    state, axis = item if isinstance(item, tuple) and len(item) == 2 else (item, getattr(item, 'batch_axis', None) or 0)
    if not is_state(state) or not is_int(axis):
      raise TypeError(f'states= holds {item!r:.60}: give a dict or list of States, or of (State, batch_axis) pairs.')
    pairs.append((state, int(axis)))
  return pairs


_warned_implicit = set()


def implicit_batch_axis(name: str, var, batch: int) -> Optional[int]:
  """0 when ``var``, a state Variable without a ``batch_axis``, holds one row per sample of the batch.

  BrainPy's ``bp.BPTT`` never cuts a batch, so it trains such a state whatever its axes; cutting it into
  micro-batches needs to know which axis holds the samples. The rule: a non-trainable, non-random Variable
  with no ``batch_axis``, of two or more dimensions, whose leading axis equals the batch size (after
  ``reset``) and which is not square in the batch size (``(B, B)``, ``(B, B, B)``), for a batch of more than
  one sample, holds the batch on axis 0 (``bm.Variable(bm.zeros((batch_size, n)))``). It warns once per
  Variable, naming it and the fix (``batch_axis=0`` in its declaration). One-dimensional states are never
  cut (a per-neuron statistic such as BatchNorm's running mean of 8 features at batch 8 is not per-sample);
  a ``(batch_size,)`` per-sample state needs ``batch_axis=0``. Ambiguous case: a non-per-sample state of
  two or more dimensions whose leading axis happens to equal the batch size (a ``(64, 10)`` table at batch
  64) would be cut too: use another batch size, or keep such tables as ``TrainVar`` or constants.
  """
  if isinstance(var, (bm.TrainVar, brainstate.random.RandomState)) or getattr(var, 'batch_axis', None) is not None:
    return None
  shape = np.shape(var.value)
  if batch <= 1 or len(shape) < 2 or shape[0] != batch or all(n == batch for n in shape):
    return None
  if id(var) not in _warned_implicit:
    _warned_implicit.add(id(var))
    warnings.warn(f'Model state {name} of shape {shape} has no batch_axis, but its leading axis holds the '
                  f'{batch} samples of the batch: each micro-batch gets its rows (axis 0), as bp.BPTT on the '
                  f'whole batch would use them. Declare it with batch_axis=0 (bm.Variable(..., batch_axis=0)) to '
                  f'say so and silence this warning; if it is not per-sample, use a batch size other than '
                  f'{shape[0]}.', UserWarning, stacklevel=3)
  return 0


def variable_batch_axis(name: str, var, batch: int) -> Optional[int]:
  """The axis along which micro-batches cut the brainpy Variable ``var`` (``None``: not cut)."""
  if isinstance(var, bm.TrainVar):
    return None
  axis = getattr(var, 'batch_axis', None)
  return axis if axis is not None else implicit_batch_axis(name, var, batch)


@contextlib.contextmanager
def declared_batch_axes(pairs):
  """While inside, each brainpy Variable of the ``(state, axis)`` pairs that has no ``batch_axis`` has ``axis``.

  A brainpy Variable without a ``batch_axis`` refuses values of another shape, so a state found by
  :func:`implicit_batch_axis` could not hold a micro-batch's rows; declaring its axis for the duration of
  the step lets it, as ``batch_axis=0`` in the user's declaration would. Restored on exit.
  """
  undeclared = [(s, a) for s, a in pairs if isinstance(s, bm.Variable) and getattr(s, 'batch_axis', None) is None]
  for state, axis in undeclared:
    object.__setattr__(state, '_batch_axis', axis)
  try:
    yield
  finally:
    for state, _ in undeclared:
      object.__setattr__(state, '_batch_axis', None)


def batch_axis_of(state, batch: int, final) -> Optional[int]:
  """The discovery rule: the axis along which micro-batches cut ``state``; ``final``: its shapes after the loss.

  A brainstate ``ShortTermState`` whose leaves all hold the batch on axis 0 after the loss is cut there; but one of
  one dimension only if it is a ``HiddenState`` (made per sample): a plain ``ShortTermState`` of ``(B,)`` is as
  likely per neuron (an adaptive threshold of 8 neurons at batch 8), as BrainPy's rule has it
  (:func:`implicit_batch_axis`). Left whole, a write of it that depends on the samples is reported (its warning
  names ``states=``)."""
  if isinstance(state, bm.Variable):
    return variable_batch_axis(getattr(state, 'name', type(state).__name__), state, batch)
  ends = jax.tree_util.tree_leaves(final) if isinstance(state, brainstate.ShortTermState) else []
  if not ends or not all(len(x.shape) and x.shape[0] == batch for x in ends):
    return None
  return 0 if isinstance(state, brainstate.HiddenState) or any(len(x.shape) > 1 for x in ends) else None


def batch_shapes(state, axis: int, batch: int):
  """The shapes of ``state``'s leaves with ``batch`` samples on ``axis``, for a state named by ``states=``."""
  def shape(x):
    if np.ndim(x) <= axis:
      raise ValueError(f'states= names a {type(state).__name__} of shape {np.shape(x)}, which has no batch axis '
                       f'{axis}. Give (state, axis) with the axis that holds the samples.')
    return jax.ShapeDtypeStruct(np.shape(x)[:axis] + (batch,) + np.shape(x)[axis + 1:], jnp.result_type(x))
  return jax.tree_util.tree_map(shape, state.value)


def whole_batch(state, axis: int, shapes):
  """The state's value with the batch on ``axis`` as in ``shapes``; a single sample (or none) is broadcast."""
  def fit(x, like):
    if np.shape(x) == like.shape:
      return x
    if np.ndim(x) <= len(like.shape) and all(a in (1, b) for a, b in zip(np.shape(x)[::-1], like.shape[::-1])):
      return jnp.broadcast_to(x, like.shape)
    raise ValueError(f'A batched {type(state).__name__} has shape {np.shape(x)}, but the batch needs {like.shape} '
                     f'(batch on axis {axis}). Reset the states at the batch size first (brainpy: model.reset('
                     f'{like.shape[axis]}); brainstate: brainstate.nn.init_all_states(model, {like.shape[axis]})), '
                     f'or name the batched states and their axes with states=.')
  return jax.tree_util.tree_map(fit, state.value, shapes)


def loss_catching_new_states(loss_fn, has_aux: bool, log: list):
  """``loss_fn`` returning ``(loss, (aux, new state values))``; ``log`` gets each trace's new States."""

  def loss_and_new_states(*args):
    with brainstate.catch_new_states() as caught:
      out = loss_fn(*args)
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(f'With has_aux=True loss_fn must return (loss, aux); it returned a {type(out).__name__}.')
    if not has_aux and isinstance(out, (tuple, list, dict)):
      raise TypeError(f'loss_fn returned a {type(out).__name__}, not a scalar loss: set has_aux=True if it returns '
                      f'(loss, aux).')
    loss, aux = out if has_aux else (out, None)
    if np.shape(loss) != ():
      raise ValueError(f'loss_fn must return a scalar loss; it returned shape {np.shape(loss)}. Average or sum it '
                       f'over the samples, or set has_aux=True if it returns (loss, aux).')
    log.append(list(caught.states))
    return loss, (aux, [s.value for s in caught.states])

  return loss_and_new_states


def discover_states(loss_and_new, args, batch: int, skip: set, weigh):
  """Trace the loss on the whole batch (tracing only).

  Returns the batched states as ``(State, axis, shapes)``, the indices of the new states to stitch (the
  micro-batch on axis 0), their whole-batch shapes, and the shapes of the loss's ``aux`` on the whole batch.
  """

  def probe(*whole):
    weigh(whole, batch)  # a bad loss_weight_fn fails here, before any state changes
    _, (aux, new) = loss_and_new(*whole)
    return new, aux

  traced = brainstate.transform.StatefulFunction(probe, return_only_write=False)
  traced.make_jaxpr(*args)
  (new_shapes, aux_like), state_shapes = traced.get_out_shapes(*args)
  found = [(s, batch_axis_of(s, batch, final), final)
           for s, final in zip(traced.get_states(*args), state_shapes) if id(s) not in skip]
  keep = [i for i, tree in enumerate(new_shapes)
          if all(len(x.shape) and x.shape[0] == batch for x in jax.tree_util.tree_leaves(tree))]
  return [f for f in found if f[1] is not None], keep, [new_shapes[i] for i in keep], aux_like


def prepare_states(named, loss_and_new, args, batch: int, skip: set, weigh):
  """Set the batched states to whole-batch values; return them as ``(State, axis)``, the new states to stitch
  (indices, whole-batch shapes), the shapes of the loss's ``aux`` on the whole batch, and the batched states'
  values before (``(State, value)``, to put back after an error)."""
  if named is not None:  # named states fail before anything is traced
    named = [(s, a, batch_shapes(s, a, batch)) for s, a in named]
    values = [whole_batch(s, a, shapes) for s, a, shapes in named]
  found, keep, samples_like, aux_like = discover_states(loss_and_new, args, batch, skip, weigh)
  if named is None:
    named, values = found, [whole_batch(s, a, shapes) for s, a, shapes in found]
  before = [(state, state.value) for state, _, _ in named]
  for (state, _, _), value in zip(named, values):
    state.value = value
  return [(s, a) for s, a, _ in named], keep, samples_like, aux_like, before


def batched_variables(model, batch_size: Optional[int]) -> dict:
  """``{name: (Variable, batch axis)}`` of ``model``'s brainpy Variables that micro-batches cut."""
  found = {k: (v, variable_batch_axis(k, v, batch_size or 0)) for k, v in model.vars().unique().items()}
  return {k: (v, axis) for k, (v, axis) in found.items() if axis is not None}


@contextlib.contextmanager
def whole_batch_variables(model, batch_size: int, whole: bool = True):
  """``model``'s batched Variables as ``(Variable, axis)`` pairs, their axes declared while inside
  (:func:`declared_batch_axes`); with ``whole`` first set to the whole batch's values (a single sample is
  repeated, as the whole-batch run broadcasts it; another size raises)."""
  states = batched_variables(model, batch_size)
  with declared_batch_axes(states.values()):
    for name, (var, axis) in states.items() if whole else ():
      var.value = all_samples(name, var, axis, batch_size)
    yield list(states.values())


def all_samples(name: str, var, axis: int, batch_size: int):
  """The Variable's value holding every sample of the batch: a single sample is repeated (as the whole-batch
  run broadcasts it); another size raises, naming the fix."""
  value = bm.as_jax(var.value)
  if value.shape[axis] not in (1, batch_size):
    raise ValueError(f'Model state {name} holds {value.shape[axis]} samples along its batch axis {axis}, but '
                     f'the batch has {batch_size}. Call model.reset({batch_size}) first, or fit with '
                     f'reset_state=True.')
  return value if value.shape[axis] == batch_size else jnp.repeat(value, batch_size, axis=axis)


def values_of(variables) -> list:
  """The current values of ``variables`` (Variables, random states), to give back with :func:`restore_values`."""
  return [v.value for v in variables]


def restore_values(variables, values, *, any_shape: bool = False) -> None:
  """Give ``variables`` the ``values`` that :func:`values_of` took.

  Inside a traced function this is a traced write, like any ``value`` assignment. ``any_shape`` restores
  with brainstate's ``restore_value`` instead, which does not check the shape, for Variables whose shape
  changed since (a model reset at another batch size); outside traced functions only.
  """
  for var, value in zip(variables, values):
    if any_shape:
      var.restore_value(value)
    else:
      var.value = value


@contextlib.contextmanager
def values_restored(variables, *, any_shape: bool = False):
  """While inside, ``variables`` may change (trial compilations, resets that draw random numbers); on exit,
  also after an error, they have their values back (:func:`restore_values`)."""
  saved = values_of(variables)
  try:
    yield
  finally:
    restore_values(variables, saved, any_shape=any_shape)


def refuse_batched_grads(grad_states: Sequence, named: Optional[Sequence], batch: int, name_of: Callable) -> None:
  """Refuse, naming it, a state of ``grad_states`` that micro-batches would cut: one named in ``states=``
  (``named``: ``(State, axis)``), or else one the discovery rule cuts (a ``HiddenState`` holding the ``batch``)."""
  axes = {id(s): a for s, a in named} if named is not None else {}
  for state in grad_states:
    axis = axes.get(id(state)) if named is not None else batch_axis_of(state, batch, state.value)
    if axis is not None:
      shape = jax.tree_util.tree_map(np.shape, state.value)
      raise ValueError(f'{name_of(state)} holds the batch (shape {shape}, samples on axis '
                       f'{axis}): micro-batches cut it, so its gradient would come in pieces. Differentiate '
                       f'states that do not hold the samples (a learned initial state as a ParamState of one row, '
                       f'broadcast to the batch in loss_fn), or use num_micro_batch=1 for this gradient.')


@contextlib.contextmanager
def states_put_back(before: List[Tuple], batched: Sequence, batch: int, name_of: Callable):
  """While inside, the states of ``before`` (``(State, value)``) may change; if an error leaves, they get their
  values back first, and a JAX or user error with a state left whole that may hold the samples (see the module)
  becomes a ``ValueError`` naming it (``batched``: the ``(State, axis)`` pairs that are cut)."""
  try:
    yield
  except BaseException as error:
    for state, value in before:
      state.restore_value(value)
    hint = _uncut_hint([s for s, _ in before], batched, batch, name_of)
    if hint and isinstance(error, (TypeError, ValueError)):
      raise ValueError(f'A micro-batch failed: {type(error).__name__}: {error}\n{hint}') from error
    raise


def _uncut_hint(states: Iterable, batched: Sequence, batch: int, name_of: Callable) -> str:
  """The states left whole with ``batch`` entries on an axis, and the ``states=`` that would cut them; ``''``."""
  cut = {id(s) for s, _ in batched}
  found = []
  for state in states:
    if id(state) in cut or isinstance(state, (brainstate.ParamState, bm.TrainVar, brainstate.random.RandomState)):
      continue
    axes = {a for leaf in jax.tree_util.tree_leaves(state.value) for a, n in enumerate(np.shape(leaf)) if n == batch}
    if batch > 1 and axes:
      found.append((state, min(axes)))
  if not found:
    return ''
  named = ', '.join(f'{name_of(s)} (axis {a})' for s, a in found)
  every = ', '.join(f'({name_of(s)}, {a})' for s, a in list(batched) + found)
  return (f'{named}: as many entries as the batch has samples ({batch}) on that axis, but not cut into '
          f'micro-batches (the rule cuts HiddenStates, and ShortTermStates of two or more dimensions with the '
          f'samples on axis 0). A state that holds one value per sample must be named with its axis, with every '
          f'other batched state: micro_batched_grad(..., states=[{every}]) (states= replaces the rule).')
