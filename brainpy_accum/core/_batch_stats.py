"""Batch statistics in a loss, exact over micro-batches: :func:`batch_mean` and :func:`batch_sum`.

A loss that takes a mean over the batch inside a nonlinearity couples the samples: e-prop's firing-rate
regulariser squares each neuron's rate, a mean over the batch and time. The micro-batches' losses then do not
combine into the batch's. Marking the mean is all a user does::

    rate = batch_mean(spikes, axis=(0, 1))        # instead of bm.mean(spikes, axis=(0, 1))

Outside a step of several micro-batches (``bp.BPTT``, a plain call, a batch in one piece) it is ``jnp.mean``.
Inside one, the step runs two passes over the micro-batches:

1. :func:`statistics_pass`: every micro-batch forward, its loss evaluated while :func:`batch_mean` records
   each marked statistic's sum over the micro-batch's samples (and how many elements it summed); only those sums
   are kept, added over the micro-batches (and devices): the whole batch's statistics ``S = T / C``;
2. the usual accumulation, each micro-batch's loss evaluated inside :func:`applying`, where the ``i``-th call of
   :func:`batch_mean` returns the whole batch's ``S_i`` with the gradient of the micro-batch's own share::

     used = S + (W / w_m) (t_m - stop_gradient(t_m)) / C

   (``t_m``: the micro-batch's sum, ``w_m``: its weight in the combined gradient, ``W``: the batch's total weight;
   ``'sum'``: ``W = w_m = 1``). Its value is ``S``; the combined gradient of a term ``F(S)`` is then
   ``F'(S) dS/dtheta``, the whole batch's.

With ``grad_reduction='sum'`` the update is exact the same way, but each micro-batch's loss holds the term
``F(S)`` of the statistics whole, so the micro-batches' sum holds it once per micro-batch: the step takes it away
``M - 1`` times (:func:`statistic_term`: ``F(S)`` from one sample's outputs, once and twice).

So a loss that is a mean over samples plus any function of batch statistics trains exactly as on the whole
batch (a weighted mean with ``loss_weight_fn``), at the memory of one micro-batch plus the statistics and one
extra forward pass. A term that reads a statistic per sample (``mean((x - batch_mean(x)) ** 2)``, a statistic of
a statistic) is not: its gradient through the statistic would need every micro-batch's. The default mode's
first-batch check computes the loss this way too, and warns where it differs from the whole batch's.
"""

import contextlib
import threading
from typing import Callable, List, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._accumulate import MicroResult, accumulate
from ._batch import first_samples, is_array, second_sizes, traced_shapes
from ._cut import MicroBatchPlan
from ._states import restore_values, values_of
from ._written import restart

__all__ = ['Marked', 'Statistics', 'StatisticsError', 'applying', 'batch_mean', 'batch_sum', 'marked_statistics',
           'seeing_statistics', 'statistic_calls', 'statistic_term', 'statistic_term_of_args', 'statistics_pass',
           'with_statistics']


class StatisticsError(ValueError):
  """A call of :func:`batch_mean` or :func:`batch_sum` that is not a statistic over the batch."""


class _Calls(threading.local):
  """The statistics context of the function being traced on this thread (``None``: none)."""
  context = None


_CURRENT = _Calls()


def _reduced_axes(x, axis) -> tuple:
  ndim = jnp.ndim(x)
  if axis is None:
    return tuple(range(ndim))
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  for a in axes:
    if not isinstance(a, (int, np.integer)) or isinstance(a, bool) or not -ndim <= a < ndim:
      raise ValueError(f'axis={axis!r} is not a valid axis (or tuple of axes) of an array of shape {jnp.shape(x)}: '
                       f'give the axes to average over, the batch axis among them, e.g. axis=(0, 1) for '
                       f'(batch, time, neurons).')
  return tuple(sorted({int(a) % ndim for a in axes}))


def _statistic(kind: str, x, axis, name: Optional[str]):
  from brainpy.math import as_jax  # (BrainPy's arrays in, JAX arrays out: the loss computes on)
  x = as_jax(x)
  axes = _reduced_axes(x, axis)
  context = _CURRENT.context
  if context is None:
    return jnp.mean(x, axis=axes) if kind == 'mean' else jnp.sum(x, axis=axes)
  return context.statistic(kind, x, axes, name)


def batch_mean(x, axis=None, *, name: Optional[str] = None):
  """The mean of ``x`` over ``axis`` (the batch axis among them), over the whole batch even inside a micro-batch.

  Outside a step of several micro-batches, ``jnp.mean(x, axis)``: a loss that uses it runs unchanged under
  ``bp.BPTT``. Inside one of :class:`~brainpy_accum.AccumBPTT`'s steps (or :func:`~brainpy_accum.micro_batched_grad`),
  its value is the mean over every sample of the batch, and the combined update is the whole batch's, for a
  loss that is a mean over samples plus any function of batch statistics (see the module).

  Parameters
  ----------
  x : array
    What to average, with the batch on one of ``axis``.
  axis : int, tuple of int or None
    The axes to average over; the batch's must be among them. ``None``: all.
  name : str, optional
    A name for the statistic in warnings and errors (default: its position among the loss's statistics).

  Returns
  -------
  jax.Array
    ``x`` averaged over ``axis``.

  Examples
  --------
  >>> import jax.numpy as jnp
  >>> from brainpy_accum import batch_mean
  >>> spikes = jnp.array([[[0., 1.], [1., 1.]], [[0., 0.], [1., 0.]]])   # (batch 2, time 2, neurons 2)
  >>> rate = batch_mean(spikes, axis=(0, 1))
  >>> rate.tolist()
  [0.5, 0.5]
  >>> round(float(jnp.sum((rate - 0.1) ** 2)), 6)   # e-prop's regulariser: a function of the statistic
  0.32
  """
  return _statistic('mean', x, axis, name)


def batch_sum(x, axis=None, *, name: Optional[str] = None):
  """The sum of ``x`` over ``axis`` (the batch axis among them), over the whole batch even inside a micro-batch:
  ``jnp.sum`` outside a step of several micro-batches; see :func:`batch_mean`.

  Examples
  --------
  >>> import jax.numpy as jnp
  >>> from brainpy_accum import batch_sum
  >>> float(batch_sum(jnp.ones((4, 3)), axis=0).sum())
  12.0
  """
  return _statistic('sum', x, axis, name)


@contextlib.contextmanager
def _entered(context):
  outer, _CURRENT.context = _CURRENT.context, context
  try:
    yield context
  finally:
    _CURRENT.context = outer


class _Collecting:
  """Pass 1: each call records its sum over the micro-batch (float32 or wider) and its element count, and returns
  the micro-batch's own value so that the loss can finish."""

  def __init__(self):
    self.sums, self.counts, self.kinds, self.names = [], [], [], []

  def statistic(self, kind: str, x, axes: tuple, name: Optional[str]):
    total = jnp.sum(x.astype(jnp.promote_types(x.dtype, jnp.float32)), axis=axes)
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    self.sums.append(total)
    self.counts.append(count)
    self.kinds.append(kind)
    self.names.append(name or f'#{len(self.names)}')
    return (total / count if kind == 'mean' else total).astype(_result_dtype(kind, x))


def _result_dtype(kind: str, x):
  return jnp.result_type(jnp.mean(jnp.zeros((), x.dtype))) if kind == 'mean' else jnp.sum(jnp.zeros((), x.dtype)).dtype


class Statistics(NamedTuple):
  """The whole batch's statistics: their sums ``totals``, element counts ``counts`` (lists, call order), the
  batch's total ``weight`` in the combined gradient (its micro-batches' weights added; ``'sum'`` does not use it),
  and each call's ``kinds``."""
  totals: List
  counts: List
  weight: jax.Array
  kinds: Sequence[str]

  def part(self, index: int, parts: int) -> 'Statistics':
    """Part ``index`` of ``parts`` equal parts: the statistics of a loss evaluated ``parts`` times in a row."""
    k = len(self.kinds) // parts
    cut = slice(index * k, (index + 1) * k)
    return Statistics(self.totals[cut], self.counts[cut], self.weight, self.kinds[cut])


class _Applying:
  """Pass 2: the ``i``-th call returns the whole batch's statistic, its gradient routed (see the module)."""

  def __init__(self, statistics: Statistics, scale):
    self.statistics, self.scale, self.index = statistics, scale, 0

  def statistic(self, kind: str, x, axes: tuple, name: Optional[str]):
    i, stats = self.index, self.statistics
    if i >= len(stats.totals) or stats.kinds[i] != kind:
      raise StatisticsError(f'loss_fun made batch statistic {name or f"#{i}"} ({kind}) where its first pass made '
                            f'{"no more" if i >= len(stats.totals) else stats.kinds[i]}: a loss must mark the same '
                            f'statistics in the same order on every micro-batch.')
    self.index += 1
    own = jnp.sum(x.astype(stats.totals[i].dtype), axis=axes)
    count = stats.counts[i] if kind == 'mean' else 1.
    whole = jax.lax.stop_gradient(stats.totals[i] / count)
    share = (own - jax.lax.stop_gradient(own)) * (self.scale / count)
    return (whole + share).astype(_result_dtype(kind, x))


@contextlib.contextmanager
def applying(statistics: Optional[Statistics], weight, reduction: str):
  """Inside: the loss of a micro-batch of weight ``weight`` sees ``statistics`` (``None``: nothing changes)."""
  if statistics is None:
    yield
    return
  total = statistics.weight if reduction == 'mean' else jnp.ones((), jnp.float32)
  weight = jnp.asarray(weight, jnp.float32)
  scale = jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.), 0.)
  with _entered(_Applying(statistics, scale)):
    yield


class Marked(NamedTuple):
  """The batch statistics a loss marks, in call order: their ``names``, ``kinds`` (``'mean'``, ``'sum'``) and the
  shapes and dtypes of their sums (``sums``: ``jax.ShapeDtypeStruct``)."""
  names: List[str]
  kinds: Sequence[str]
  sums: Sequence


def marked_statistics(loss_of: Callable, args: tuple, axes, states, plan: MicroBatchPlan) -> Marked:
  """The statistics ``loss_of(micro_args, size)`` (a micro-batch's loss) marks (no names: none), from traces at two
  micro-batch sizes (nothing runs). Raises :class:`StatisticsError` for a call whose ``axis`` leaves the batch out:
  its sum changes shape with the micro-batch, so it is not a statistic of the batch."""
  sizes, calls = second_sizes(plan), []

  def named(micro_args, n):
    with _entered(_Collecting()) as collecting:
      loss_of(micro_args, n)
    calls[:] = [collecting]
    return collecting.sums

  (small,) = traced_shapes(named, args, axes, states, sizes[:1])  # (one trace where the loss marks none)
  names, kinds = calls[0].names, calls[0].kinds
  if not names:
    return Marked([], (), ())
  (large,) = traced_shapes(named, args, axes, states, sizes[1:])
  for name, a, b in zip(names, small, large):
    if a.shape != b.shape:
      raise StatisticsError(f'batch statistic {name} of loss_fun has shape {a.shape} for a micro-batch of {sizes[0]} '
                            f'samples and {b.shape} for one of {sizes[1]}: its axis leaves the batch out, so it is '
                            f'not a statistic of the batch. Put the batch axis in its axis, or use jnp.mean (bm.mean) '
                            f'for a mean within each sample.')
  return Marked(list(names), tuple(kinds), tuple(small))


def statistic_calls(loss_of: Callable, args: tuple, axes, states, plan: MicroBatchPlan) -> List[str]:
  """The names of the statistics ``loss_of(micro_args, size)`` marks (:func:`marked_statistics`; empty: none)."""
  return marked_statistics(loss_of, args, axes, states, plan).names


def statistics_pass(loss_of: Callable, weigh: Callable, args: tuple, axes, plan: MicroBatchPlan, states,
                    replayed: Sequence, across: Optional[Callable] = None) -> Statistics:
  """Pass 1: the whole batch's statistics, from every micro-batch's ``loss_of(micro_args, size)`` run forward
  (no gradient), and the batch's total weight (``weigh(micro_args, size)`` summed). ``replayed``: the states
  (model states, random keys) put back afterwards, so that pass 2 runs the same forward passes; states written
  without a batch axis start again too. ``across``: adds a tree over the devices of a mesh (one all-reduce)."""
  before = values_of(replayed)
  kinds = []

  def micro_fn(micro_args, size):
    with _entered(_Collecting()) as calls:
      loss_of(micro_args, size)
    kinds[:] = calls.kinds
    sums = calls.sums + [jnp.asarray(c, jnp.float32) for c in calls.counts]
    return MicroResult(None, jnp.zeros((), jnp.float32), (sums, weigh(micro_args, size)), jnp.ones((), jnp.float32))

  out = accumulate(micro_fn, args, axes, plan, states)
  restore_values(replayed, before)
  if out.written is not None:
    restart(out.written.states, out.written.starts)
  sums, weight = out.aux_sum if across is None else across(out.aux_sum)
  return Statistics(sums[:len(kinds)], sums[len(kinds):], weight, tuple(kinds))


def with_statistics(micro_fn: Callable, statistics: Statistics, weigh: Callable, reduction: str) -> Callable:
  """``micro_fn(micro_args, size)`` (the engine's) whose loss sees the whole batch's ``statistics``, each
  micro-batch's share of their gradient weighted by ``weigh(micro_args, size)`` (:func:`applying`)."""

  def seeing(micro_args, size):
    with applying(statistics, weigh(micro_args, size), reduction):
      return micro_fn(micro_args, size)

  return seeing


def seeing_statistics(micro_fn: Callable, loss_of: Callable, weigh: Callable, reduction: str, args: tuple, axes,
                      plan: MicroBatchPlan, states, replayed: Sequence, across: Optional[Callable] = None,
                      devices: int = 1, term_of: Optional[Callable] = None, found: Optional[Statistics] = None,
                      kept=1.):
  """Pass 1 (:func:`statistics_pass`), then ``micro_fn`` seeing the whole batch's statistics
  (:func:`with_statistics`), and what the micro-batches' loss sum holds too much: with ``'sum'`` the statistics'
  term ``term_of(statistics)`` (:func:`statistic_term`) once per micro-batch but ``kept``, counted once over the
  ``devices`` that each add theirs; else ``None``. ``found``, given, are the statistics, taken before (a batch
  streamed in chunks: the whole batch's, over every chunk; ``kept``: 1 for its first chunk, 0 for the others).
  Returns ``(micro_fn, extra)``."""
  if found is None:
    found = statistics_pass(loss_of, weigh, args, axes, plan, states, replayed, across)
  seeing = with_statistics(micro_fn, found, weigh, reduction)
  if reduction != 'sum':
    return seeing, None
  return seeing, (plan.num_micro_batches - kept / devices) * term_of(found)


def statistic_term(forward: Callable, loss_of: Callable, args: tuple, axes, plan: MicroBatchPlan, states,
                   statistics: Statistics, replayed: Sequence) -> jax.Array:
  """``F(S)``, the part of a ``'sum'`` loss that is not a sum over samples, at the whole batch's ``statistics``:
  for a loss ``L = sum_b l_b + F(S)``, ``F = 2 L(y_1) - L(y_1, y_1)``, with ``y_1`` one sample's outputs
  (``forward(micro_args, 1)`` on the batch's first sample, its model state the first sample's) and ``loss_of(
  outputs, targets) -> (loss, aux)`` seeing ``statistics``. Where the outputs hold the batch shows in their shapes
  at two micro-batch sizes (traced only). ``replayed``: the states put back afterwards. No gradient."""
  before = values_of(replayed)
  small, large = traced_shapes(forward, args, axes, states, second_sizes(plan))
  out_axes = [_moved_axis(a, b) for a, b in zip(jax.tree_util.tree_leaves(small), jax.tree_util.tree_leaves(large))]
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)
  one = treedef.unflatten([x if a is None else first_samples(x, a, 1) for x, a in zip(leaves, axes)])
  for state, axis in states:
    state.value = first_samples(state.value, axis, 1)
  outputs = forward(one, 1)
  restore_values(replayed, before)
  targets = one[1]
  target_axes = axes[len(jax.tree_util.tree_leaves(one[0], is_leaf=is_array)):]
  one_weight = jnp.ones((), jnp.float32)
  with applying(statistics, one_weight, 'sum'):
    single = loss_of(outputs, targets)[0]
  with applying(statistics, one_weight, 'sum'):
    double = loss_of(_twice(outputs, out_axes), _twice(targets, target_axes))[0]
  return jax.lax.stop_gradient(2. * jnp.asarray(single, jnp.float32) - jnp.asarray(double, jnp.float32))


def statistic_term_of_args(loss_of: Callable, args: tuple, axes, states, statistics: Statistics,
                           replayed: Sequence) -> jax.Array:
  """:func:`statistic_term` where the loss and the model are one function, ``loss_of(*args)``: ``F = 2 L(a_1) -
  L(a_1, a_1)`` from the batch's first sample of ``args`` (axes ``axes``) once and twice. The model runs on the
  two copies; one that draws random numbers draws different ones for them, which changes the reported loss (not
  the gradient) of a ``'sum'`` loss with batch statistics."""
  before = values_of(replayed)
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)
  one = [x if a is None else first_samples(x, a, 1) for x, a in zip(leaves, axes)]
  values = []
  for copies in (one, _twice(one, axes)):
    for state, axis in states:
      state.value = first_samples(state.value, axis, 1)
      if copies is not one:
        state.value = _twice([state.value], [axis])[0]
    with applying(statistics, jnp.ones((), jnp.float32), 'sum'):
      values.append(jnp.asarray(loss_of(*treedef.unflatten(copies)), jnp.float32))
    restore_values(replayed, before)
  return jax.lax.stop_gradient(2. * values[0] - values[1])


def _moved_axis(a, b) -> Optional[int]:
  moved = [i for i, (n, m) in enumerate(zip(a.shape, b.shape)) if n != m]
  return moved[0] if len(moved) == 1 else None


def _twice(tree, axes):
  """Every leaf of ``tree`` with its samples on ``axes`` (a list, ``None``: none) repeated once more."""
  from brainpy.math import as_jax
  leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_array)
  return treedef.unflatten([x if a is None else jnp.concatenate([as_jax(x), as_jax(x)], axis=a)
                            for x, a in zip(leaves, axes)])
