"""Batches larger than the device: streamed from the host in chunks, still one exact update per batch.

The whole batch's inputs and targets are arguments of the compiled train step, so beyond some batch size
they alone exceed ``memory_budget``, however finely the step cuts them. With ``num_micro_batch='auto'``
and a ``memory_budget`` such a batch is then cut on the host into chunks whose step fits; each chunk is
sent to the device and its weighted gradient sums added to the ``accumulate_steps`` window (no update),
and the last chunk closes the window: one optimizer update per batch, the update of the whole batch. The
largest trainable batch is then bounded by host memory only.

On an accelerator the same path carries every host batch that does not run in one piece: it flows to the
device in pieces (chunks) of one micro-batch each, each sent while the one before computes (see
:mod:`~brainpy_accum.trainer._feed`), so the device holds the running step and one piece more, whatever the
batch size.

These are the pieces of that path: which chunk sizes to try, slicing the batch, the model state of each chunk
(:class:`StreamedStates`), the batch statistics a loss marks (:class:`StreamedStatistics`), and combining the
chunks' losses and metrics into the batch's, as :class:`brainpy.BPTT` would report them, when they are read
(:func:`combine_later`): no batch end waits for the device.
"""

import contextlib
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np

from ..core._batch import is_array
from ..core._batch_stats import Marked, Statistics
from ..core._metrics import combine_on_host
from ..core._mesh import random_states
from ..core._states import (all_samples, batched_variables, declared_batch_axes, restore_values, values_of,
                            values_restored)
from ._budget import candidate_micro_batch_sizes

__all__ = ['StreamedStates', 'StreamedStatistics', 'best_chunk', 'chunk_candidates', 'chunk_sizes', 'chunk_starts',
           'combine', 'combine_later', 'host_chunk', 'host_pieces', 'likely_chunk']


def chunk_candidates(batch_size: int) -> List[int]:
  """Chunk sizes to try, largest first: the batch cut into 2, 4, 8, ... nearly equal chunks.

  Examples
  --------
  >>> chunk_candidates(10)
  [5, 3, 2, 1]
  """
  sizes, parts = [], 2
  while parts < 2 * batch_size:
    size = -(-batch_size // parts)
    if size not in sizes:
      sizes.append(size)
    parts *= 2
  return sizes


def best_chunk(batch_size: int, micro_batch_of: Callable[[int], Optional[int]], *,
               can_hold: Optional[Callable[[int, int], bool]] = None, first: Optional[int] = None) -> Optional[int]:
  """The chunk size to stream a batch in: of the :func:`chunk_candidates` whose step fits, the one with the
  largest micro-batches (the fewest sequential micro-batch steps per batch), then the largest chunk (the fewest
  transfers); ``None`` if none fits.

  ``micro_batch_of(chunk)`` plans a chunk size (compilations) and gives the largest micro-batch size whose
  step fits it, or ``None`` if none does. ``first`` is planned first (a guess of the winner, :func:`likely_chunk`), then the
  others largest first. A chunk is not planned when it cannot win: when it holds no more samples than the
  largest micro-batch found (a tie goes to the larger chunk), or when ``can_hold(chunk, micro)``, given,
  says that no step of micro-batches of ``micro`` samples fits it, for the smallest cut of the chunk that
  would win (memory grows with the micro-batch, so no larger cut fits either). So the answer is that of
  planning every candidate; the guess and ``can_hold`` only save planning.

  Examples
  --------
  >>> from brainpy_accum.memory._budget import candidate_micro_batch_sizes
  >>> def micro_batch_of(chunk):  # cuts of 12 samples or fewer fit
  ...   planned.append(chunk)
  ...   return max(s for s in candidate_micro_batch_sizes(chunk) if s <= 12)
  >>> planned = []
  >>> best_chunk(64, micro_batch_of)  # 32 in micro-batches of 11 (11, 11, 10)
  32
  >>> planned  # 16 may hold more than 11 (in one piece); 8 and smaller chunks cannot
  [32, 16]
  >>> planned = []
  >>> best_chunk(64, micro_batch_of, can_hold=lambda chunk, micro: micro <= 12)
  32
  >>> planned  # 16 would win only in one piece of 16, which does not fit
  [32]
  """
  candidates = chunk_candidates(batch_size)
  order = ([first] if first in candidates else []) + [c for c in candidates if c != first]
  fitting: Dict[int, int] = {}
  for chunk in order:
    if fitting:
      best_micro, best = max((micro, c) for c, micro in fitting.items())
      need = best_micro if chunk > best else best_micro + 1  # the micro-batch size that would win
      if need > chunk:
        continue
      if can_hold is not None and not can_hold(chunk, min(s for s in candidate_micro_batch_sizes(chunk) if s >= need)):
        continue
    micro = micro_batch_of(chunk)
    if micro is not None:
      fitting[chunk] = micro
  return max(fitting, key=lambda c: (fitting[c], c)) if fitting else None


def likely_chunk(batch_size: int, budget: int, fixed_of: Callable[[int], float], per_sample: Sequence[float]) -> int:
  """The chunk that a line predicts to hold the largest micro-batches (then the largest chunk): the step of
  a chunk of ``chunk`` samples cut in micro-batches of ``micro`` needs about ``fixed_of(chunk) + slope *
  micro`` bytes, for the best of the ``per_sample`` slopes (one per remat option). A guess for
  :func:`best_chunk` to plan first, never trusted: it only orders the planning.

  Examples
  --------
  >>> likely_chunk(256, 100, fixed_of=lambda chunk: 40 + chunk / 4, per_sample=[2.])  # 64: 56 + 2 * 22
  64
  """
  def predicted(chunk):
    room = budget - fixed_of(chunk)
    fitting = [s for s in candidate_micro_batch_sizes(chunk) if any(slope * s <= room for slope in per_sample)]
    return max(fitting, default=0), chunk
  return max(chunk_candidates(batch_size), key=predicted)


def chunk_sizes(batch_size: int, chunk: int) -> List[int]:
  """The chunks of a batch: full chunks of ``chunk`` samples and a shorter last one.

  Examples
  --------
  >>> chunk_sizes(10, 4)
  [4, 4, 2]
  """
  full, rest = divmod(batch_size, chunk)
  return [chunk] * full + ([rest] if rest else [])


def chunk_starts(batch_size: int, chunk: int) -> List[Tuple[int, int]]:
  """``(start, size)`` of each chunk of a batch (:func:`chunk_sizes`).

  Examples
  --------
  >>> chunk_starts(10, 4)
  [(0, 4), (4, 4), (8, 2)]
  """
  sizes = chunk_sizes(batch_size, chunk)
  return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]


def host_pieces(inputs, targets, layout, chunk: int) -> List[Tuple[int, int, Callable[[], tuple]]]:
  """``(start, size, piece)`` of each chunk of a batch whose ``layout`` (its size and batch axes) is given;
  ``piece()`` slices the chunk's ``(inputs, targets)`` where the data lives (NumPy slices are views; slices of
  device data are copies: made one at a time, when needed).

  Examples
  --------
  >>> import numpy as np
  >>> from brainpy_accum.core._batch import batch_layout
  >>> x, y = np.arange(10.).reshape(5, 2), np.arange(5.)
  >>> pieces = host_pieces(x, y, batch_layout(x, y, 'B', None), 2)
  >>> [(start, size) for start, size, _ in pieces], pieces[2][2]()
  ([(0, 2), (2, 2), (4, 1)], (array([[8., 9.]]), array([4.])))
  """
  return [(start, size, functools.partial(_piece, inputs, targets, layout, start, size))
          for start, size in chunk_starts(layout.batch_size, chunk)]


def _piece(inputs, targets, layout, start: int, size: int) -> tuple:
  return host_chunk(inputs, layout.input_axes, start, size), host_chunk(targets, layout.target_axes, start, size)


def host_chunk(tree, axes, start: int, size: int):
  """Samples ``start .. start + size`` of every leaf, sliced where the data lives (NumPy stays on the host)."""
  def take(x, axis):
    if isinstance(x, jax.Array):  # one program for every start (a static slice compiles once per start)
      return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)
    index = (slice(None),) * axis + (slice(start, start + size),)
    return x[index]
  return jax.tree_util.tree_map(take, tree, axes, is_leaf=is_array)


def combine(results: Sequence[Tuple[Any, dict]], weights: Optional[Sequence[float]], reduction: str,
            metrics=None, counts: Optional[Sequence[int]] = None):
  """The batch's ``(loss, aux)`` from its chunks': weighted means (``'mean'``; ``weights`` are the chunks'
  sample counts or ``loss_weight_fn`` values) or sums (``'sum'``). ``metrics`` (a
  :class:`~brainpy_accum.core._metrics.MetricPlan`), given, combines each metric by its rule (per-sample
  metrics concatenated; ``counts``: the chunks' sample counts)."""
  if reduction == 'sum':
    scale = [1.] * len(results)
  else:  # (a chunk of weight 0 adds nothing, as a micro-batch: see core/_combine.py; all of weight 0: nan)
    total = float(np.sum(weights))
    scale = [float(w) / total if total else np.nan for w in weights]
  scaled = lambda s, value: 0. if s == 0 else s * np.asarray(value, np.float64)  # noqa: E731
  loss = sum(scaled(s, r[0]) for s, r in zip(scale, results))
  dtype = np.asarray(results[0][0]).dtype
  if metrics is not None:
    aux = combine_on_host([r[1] for r in results], weights if reduction == 'mean' else [1.] * len(results),
                          counts, metrics.rules, metrics.mean_by_weight)
    return np.asarray(loss, dtype), aux
  aux = {k: sum(scaled(s, r[1][k]) for s, r in zip(scale, results)) for k in results[0][1]}
  return np.asarray(loss, dtype), {k: np.asarray(v, np.asarray(results[0][1][k]).dtype) for k, v in aux.items()}


class StreamedStates:
  """The model state of one batch streamed in chunks.

  Each chunk starts from its samples' slice of the whole batch's state (as fit reset it at the batch size: the
  same random draws as ``bp.BPTT``'s), and the chunks' final states are joined after the last, where the whole
  batch's would be. Device memory: the whole batch's state and the chunks' final states (the planner counts them
  beside a piece's step).

  Parameters
  ----------
  states : dict
    ``{name: (Variable, batch axis)}``, the model's states that hold the batch.
  batch_size : int
    Samples of the whole batch.
  """

  def __init__(self, states: Dict[str, Tuple[Any, int]], batch_size: int, unbatched: Sequence = ()):
    self.states, self.batch_size = states, batch_size
    self.whole = {name: all_samples(name, var, axis, batch_size) for name, (var, axis) in states.items()}
    # the model's other Variables (no batch axis; not random states), as the batch found them: an evaluation
    # step, which has no window to put back what the forward pass wrote to them, gets them back after every chunk
    # but the last, as a micro-batched one does (the training steps' window does it for training)
    self.unbatched, self.at_start = list(unbatched), values_of(unbatched)
    # each chunk's final state, joined after the last: every chunk starts from a slice of the state as fit left
    # it (weakly typed after a reset, as bp.BPTT's step takes it), so every chunk's step is the same program
    self.finals: Dict[str, list] = {name: [] for name in states}

  @contextlib.contextmanager
  def declared(self):
    """While inside, the states may hold a chunk's rows (:func:`~brainpy_accum.core._states.declared_batch_axes`)."""
    with declared_batch_axes(self.states.values()):
      yield

  def enter(self, start: int, size: int) -> None:
    """The states of the chunk of samples ``start .. start + size`` (one program for all starts)."""
    for name, (var, axis) in self.states.items():
      var.value = jax.lax.dynamic_slice_in_dim(self.whole[name], start, size, axis=axis)

  @classmethod
  def of(cls, model, batch_size: int) -> 'StreamedStates':
    """The streamed states of ``model`` at ``batch_size``: its batched states, and its others (random states
    aside) to put back between the chunks of an evaluation."""
    states = batched_variables(model, batch_size)
    skip = {id(var) for var, _ in states.values()} | {id(var) for var in random_states(model)}
    return cls(states, batch_size, [var for var in model.vars().unique().values() if id(var) not in skip])

  def leave(self, put_back: bool = False) -> None:
    """Keep the chunk's final states; ``put_back``: the model's other Variables as the batch found them."""
    for name, (var, _) in self.states.items():
      self.finals[name].append(bm.as_jax(var.value))
    if put_back:
      restore_values(self.unbatched, self.at_start)

  def join(self) -> None:
    """The whole batch's final state: the chunks' joined."""
    for name, (var, axis) in self.states.items():
      var.value = jnp.concatenate(self.finals[name], axis=axis)

  @contextlib.contextmanager
  def first_samples(self, count: int):
    """While inside, the states of the batch's first ``count`` samples; the chunk's are put back after."""
    with values_restored([var for var, _ in self.states.values()], any_shape=True):
      self.enter(0, count)
      yield


class StreamedStatistics:
  """The batch statistics (:func:`~brainpy_accum.batch_mean`, :func:`~brainpy_accum.batch_sum`) of a batch
  streamed from the host in chunks, in Variables: a pass over every chunk first adds up each chunk's sums
  (:meth:`add`), then every chunk's step reads the whole batch's (:meth:`statistics`), as the micro-batches of
  a batch on the device read theirs. The chunks' steps then combine into the whole batch's update, as the
  micro-batches of one step do.

  Parameters
  ----------
  marked : Marked
    The statistics the loss marks (:func:`~brainpy_accum.core._batch_stats.marked_statistics`): their kinds and
    their sums' shapes.
  """

  def __init__(self, marked: Marked):
    self.kinds = tuple(marked.kinds)
    self.totals = [bm.Variable(jnp.zeros(s.shape, s.dtype)) for s in marked.sums]
    self.counts = [bm.Variable(jnp.zeros((), jnp.float32)) for _ in marked.sums]
    self.weight = bm.Variable(jnp.zeros((), jnp.float32))
    # 1 once a chunk's step has kept the statistics' term in its loss sum (grad_reduction='sum': the batch's loss
    # holds it once, so the later chunks take it away from every micro-batch's loss)
    self.counted = bm.Variable(jnp.zeros((), jnp.float32))

  def add(self, found: Tuple[Sequence, Sequence, Any], first: bool = False) -> None:
    """Add one chunk's ``(totals, counts, weight)``, its statistics' sums over its samples (on the device);
    ``first``: the batch's first chunk, whose sums replace what the store held."""
    totals, counts, weight = found
    for var, value in zip((*self.totals, *self.counts, self.weight), (*totals, *counts, weight)):
      var.value = jnp.asarray(value, var.dtype) if first else var.value + jnp.asarray(value, var.dtype)
    if first:
      self.counted.value = jnp.zeros_like(self.counted.value)

  def statistics(self) -> Statistics:
    """The whole batch's statistics, read inside a chunk's step."""
    return Statistics([v.value for v in self.totals], [c.value for c in self.counts], self.weight.value, self.kinds)

  def keep_term(self) -> jax.Array:
    """How many times this chunk's loss sum keeps the statistics' term (1 for the first chunk, 0 after; read
    inside its step, which marks it kept)."""
    kept = 1. - self.counted.value
    self.counted.value = jnp.ones_like(self.counted.value)
    return kept


class _Combined:
  """One streamed batch's ``(loss, aux)``, combined from its chunks' (:func:`combine`) the first time it is read."""

  def __init__(self, results, weights, reduction: str, metrics, counts):
    self._parts = (results, weights, reduction, metrics, counts)
    self._value = None

  def value(self):
    if self._value is None:
      results, weights, reduction, metrics, counts = self._parts
      self._value = combine(results, [float(w) for w in weights], reduction, metrics, counts)
      self._parts = None
    return self._value


class _Later:
  """One value of a :class:`_Combined`, read as a NumPy array (``np.asarray``) when a report needs it."""

  def __init__(self, combined: _Combined, key: Optional[str] = None):
    self.combined, self.key = combined, key

  def __array__(self, dtype=None, copy=None):
    loss, aux = self.combined.value()
    return np.asarray(loss if self.key is None else aux[self.key], dtype=dtype)


def combine_later(results: Sequence[Tuple[Any, dict]], weights: Sequence[Any], reduction: str, metrics=None,
                  counts: Optional[Sequence[int]] = None):
  """:func:`combine`'s ``(loss, aux)``, each value read as a NumPy array only when a report or a checkpoint
  needs it: the chunks' results and weights stay on the device until then, so the end of a streamed batch
  waits for nothing (the device still runs its last chunks while the next batch's first goes ahead).

  Examples
  --------
  >>> import numpy as np
  >>> from brainpy_accum.memory._stream import combine_later
  >>> loss, aux = combine_later([(1., {'acc': 0.5}), (2., {'acc': 1.})], [3, 1], 'mean')
  >>> float(np.asarray(loss)), float(np.asarray(aux['acc']))
  (1.25, 0.625)
  """
  combined = _Combined(list(results), list(weights), reduction, metrics, counts)
  return _Later(combined), {key: _Later(combined, key) for key in results[0][1]}
