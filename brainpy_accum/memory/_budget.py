"""Choosing the number of micro-batches from XLA's compile-time memory analysis.

Instead of running steps until one runs out of memory, the planner compiles
the train step ahead of time for candidate micro-batch sizes (no step is
executed) and keeps the largest micro-batch, i.e. the fewest micro-batches,
whose compiled step fits the budget. The memory of a compiled step is
``argument + output + temp - alias`` bytes of
``jax.stages.Compiled.memory_analysis()``: deterministic and available on CPU. The size the search picks is
then compiled as training runs it, and must fit by that compilation's measure too (:func:`fewest_fitting`).
"""

import math
import re
from typing import Any, Callable, ContextManager, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import brainpy.math as bm
import jax
import numpy as np
from tqdm import tqdm

from ..core._cut import is_int, plan_micro_batches
from ._switch import DeviceSwitch

__all__ = ['parse_memory', 'format_memory', 'compiled_step_bytes', 'candidate_micro_batch_sizes', 'state_bytes',
           'largest_fitting', 'choose_micro_batch_size', 'fewest_fitting', 'StepMemory', 'PlannedStep', 'memory_parts',
           'step_memory', 'argument_bytes', 'fixed_bytes_at_least', 'plural', 'TooSmall', 'compiles_whole_first',
           'whole_first']

_UNITS = {'': 1, 'B': 1, 'KB': 10 ** 3, 'MB': 10 ** 6, 'GB': 10 ** 9, 'TB': 10 ** 12,
          'KIB': 2 ** 10, 'MIB': 2 ** 20, 'GIB': 2 ** 30, 'TIB': 2 ** 40}


def parse_memory(value: Union[int, str]) -> int:
  """Bytes from an int or a string such as ``'512MiB'``, ``'2GiB'`` or ``'1.5GB'``.

  Examples
  --------
  >>> from brainpy_accum import parse_memory
  >>> parse_memory('2GiB'), parse_memory('512 MiB'), parse_memory(1000)
  (2147483648, 536870912, 1000)
  """
  if not is_int(value) and not isinstance(value, str):
    raise TypeError(f"memory_budget={value!r} must be bytes (int) or a string like '512MiB' or '2GiB'.")
  if is_int(value):
    number, unit = int(value), ''
  else:
    match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*', value)
    if match is None or match.group(2).upper() not in _UNITS:
      raise ValueError(f"memory_budget={value!r} is not a size: write bytes or e.g. '512MiB', '2GiB', '1.5GB'.")
    number, unit = float(match.group(1)), match.group(2).upper()
  size = int(number * _UNITS[unit])
  if size <= 0:
    raise ValueError(f'memory_budget={value!r} must be positive.')
  return size


def plural(count: int, noun: str) -> str:
  """``'1 micro-batch'``, ``'3 micro-batches'``."""
  return f'{count} {noun}' + ('' if count == 1 else 'es' if noun.endswith('ch') else 's')


def format_memory(num_bytes: int) -> str:
  """``'12.3 MiB'``-style text."""
  for unit, size in (('GiB', 2 ** 30), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
    if num_bytes >= size:
      return f'{num_bytes / size:.1f} {unit}'
  return f'{num_bytes} B'


def compiled_step_bytes(compiled) -> int:
  """Memory of a compiled step: arguments, outputs and temporaries, less buffers aliased in place.

  Parameters
  ----------
  compiled : jax.stages.Compiled
    What ``jax.jit(f).lower(...).compile()`` (or a BrainPy trainer's ``f_train.compile(...)``) returns.

  Examples
  --------
  >>> import jax, jax.numpy as jnp
  >>> from brainpy_accum import compiled_step_bytes
  >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(1024, jnp.float32)).compile()
  >>> compiled_step_bytes(compiled) >= 2 * 4096  # the argument and the output
  True
  """
  return step_memory(compiled).total


def argument_bytes(variables: Iterable, inputs, targets) -> int:
  """Bytes of what a train step takes: every Variable of ``variables`` (each once: parameters, optimizer and
  model state, random keys) and the batch. A lower bound of the compiled step's memory, known without compiling."""
  unique = {id(v): v for v in variables}
  leaves = [v.value for v in unique.values()] + jax.tree_util.tree_leaves((inputs, targets))
  return sum(int(getattr(x, 'nbytes', 0)) for x in leaves)  # typed random keys: the bytes of their data


def fixed_bytes_at_least(variables: Iterable, params: Sequence, optimizer_variables: Iterable, inputs, targets) -> int:
  """A lower bound of the fixed part of a train step's memory (:class:`StepMemory`'s ``fixed``), known without
  compiling: its arguments (:func:`argument_bytes`) and the outputs that every update writes anew, the trained
  ``params`` and the optimizer's state shaped like them (its moments). No argument is donated, so no output
  shares an argument's buffer; whatever else the step writes only adds to the figure."""
  kind = lambda var: (np.shape(var.value), bm.as_jax(var.value).dtype)
  shapes = {kind(v) for v in params}
  moments = [v for v in optimizer_variables if kind(v) in shapes]
  written = {id(v): v for v in list(params) + moments}
  return argument_bytes(variables, inputs, targets) + sum(int(bm.as_jax(v.value).nbytes) for v in written.values())


def device_tile() -> int:
  """The grain of micro-batch sizes on the default device: 128 on a TPU, whose matrix units work on tiles of
  128 rows (8 below 128), so that other sizes are padded (a TPU v5e trained the benchmark's spiking network 11%
  slower in micro-batches of 1093 than of 1024); 1 elsewhere (any size)."""
  return 128 if jax.default_backend() == 'tpu' else 1


def _rounded(size: int, tile: int) -> int:
  """``size`` rounded up to a multiple of ``tile`` (of 8 below ``tile``; as it is below 8)."""
  grain = tile if size >= tile else 8 if size >= 8 and tile > 8 else 1
  return -(-size // grain) * grain


def state_bytes(states: dict, batch_size: Optional[int] = None) -> int:
  """Device bytes of a model's batched ``states`` (``{name: (Variable, batch axis)}``) at ``batch_size`` samples,
  whatever size they hold now (``None``: as they are).

  Examples
  --------
  >>> import brainpy.math as bm, numpy as np
  >>> states = {'V': (bm.Variable(np.zeros((4, 8), np.float32)), 0)}
  >>> state_bytes(states), state_bytes(states, 16)
  (128, 512)
  """
  total = 0
  for var, axis in states.values():
    value = bm.as_jax(var.value)
    total += value.nbytes if batch_size is None else value.nbytes // max(1, value.shape[axis]) * batch_size
  return total


def candidate_micro_batch_sizes(batch_size: int, tile: Optional[int] = None) -> List[int]:
  """The distinct ``ceil(batch_size / N)`` for ``N = 1 .. batch_size``, largest first (fewest micro-batches);
  each rounded up to a multiple of ``tile`` (default :func:`device_tile`: 128 on a TPU, else 1, every size),
  never beyond the batch.

  Examples
  --------
  >>> candidate_micro_batch_sizes(10, tile=1)
  [10, 5, 4, 3, 2, 1]
  >>> candidate_micro_batch_sizes(16384, tile=128)[:6]
  [16384, 8192, 5504, 4096, 3328, 2816]
  """
  tile = device_tile() if tile is None else tile
  return sorted({min(batch_size, _rounded(-(-batch_size // n), tile)) for n in range(1, batch_size + 1)},
                reverse=True)


class TooSmall(ValueError):
  """A budget that not even one sample per micro-batch fits; ``need``: the bytes that would."""

  def __init__(self, message: str, need: int):
    super().__init__(message)
    self.need = need


class StepMemory(NamedTuple):
  """A compiled step's memory: ``total`` must fit the budget; ``fixed`` (arguments + outputs - aliases: the
  parameters, the optimizer state, the whole batch's data) does not change with the micro-batch size."""
  total: int
  fixed: int = 0


class PlannedStep(NamedTuple):
  """A train step compiled for one plan, fully optimised, as :meth:`fit` would compile it."""
  memory: StepMemory        # its memory by XLA's analysis: what verifies that the plan fits
  run: Callable[[], Any]    # a trial of it that changes nothing (``remat='auto'``'s timing)
  keep: Callable[[], None]  # make fit run this very executable for the batch size (no second compilation)


def memory_parts(value) -> Tuple[int, int]:
  """``(total, fixed)`` of a :class:`StepMemory`, or ``(value, 0)`` of plain bytes."""
  return (value.total, value.fixed) if isinstance(value, StepMemory) else (int(value), 0)


def step_memory(compiled) -> StepMemory:
  """A compiled step's memory (arguments, outputs and temporaries, less buffers aliased in place: the ``total``
  of :func:`compiled_step_bytes`), and the part of it that does not grow with the micro-batch."""
  stats = compiled.memory_analysis()
  fixed = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
  return StepMemory(fixed + stats.temp_size_in_bytes, fixed)


def largest_fitting(sizes: Sequence[int], budget: int, measure: Callable[[int], Union[int, StepMemory, None]], *,
                    measure_pick: Optional[Callable[[int], Union[int, StepMemory, None]]] = None,
                    guess: Optional[Callable[[int], float]] = None) -> Optional[Tuple[int, int]]:
  """``(size, bytes)`` of the largest of ``sizes`` (largest first) whose ``measure`` fits ``budget``, or ``None``.

  Few measurements (each is a compilation): a step's memory is close to affine in the micro-batch size, so
  each probe is the largest size that a line through the measurements nearest the budget predicts to fit::

    probe the largest size (with a guess: the largest size it predicts to fit); if it fits, done
    repeat: line through the two measurements nearest the budget (from one: through the fixed bytes at
            size 0); probe the largest size between those known to fit and not to that it predicts to fit
            (after two wrong predictions in a row: the middle of the sizes left)
    until the largest size known to fit is next to the smallest known not to

  Every answer is measured, never predicted: the size returned was measured to fit. Only the next larger
  size may go unmeasured, when the line, whose error at the answer is known, puts it over the budget by a
  margin (the larger of 5% of the budget and that error), and so does the guess's growth from the answer if
  there is a guess (one that was within 5% of the budget at the answer; else the next size is measured);
  then that size is taken as not fitting (at
  worst one micro-batch more than needed, never a step that does not fit). After two probes in a row that
  contradict their prediction the next is a bisection step, so the search stays within a few probes of a
  bisection even where memory is far from a line. Assumes memory grows with the size, as bisection does.
  ``measure_pick``, if given, measures the sizes the line predicts to fit (the likely answer; the trainer compiles
  those as training runs them, so that the answer's compilation is the one training uses); ``measure``
  the others (the first probe and bisection steps). ``guess(size)``, if given, predicts the bytes from other
  measurements (the same step at another chunk of a streamed batch): the first probe is then the largest size
  it predicts to fit, measured as a likely answer, instead of the largest size. A guess only orders the
  probes: the answer is measured as without it, and a wrong guess costs a probe, not a wrong answer.
  ``measure(size)`` may give ``None``: known not to fit, with no figure (say its data alone exceed the budget,
  by arithmetic). Such a size bounds the search but is no point of a line (a made-up figure just over the budget
  would draw the line far below the step's memory, and each probe it predicts would fail).

  Examples
  --------
  >>> sizes = list(range(100, 0, -1))
  >>> probed = []
  >>> largest_fitting(sizes, 500, lambda s: probed.append(s) or 100 + 5 * s)
  (80, 500)
  >>> len(probed) < 7  # bisection of 100 sizes probes 7
  True
  >>> probed = []
  >>> largest_fitting(sizes, 500, lambda s: probed.append(s) or 100 + 5 * s, guess=lambda s: 100 + 5 * s), probed
  ((80, 500), [80, 81])
  >>> probed = []  # sizes over 90 known not to fit by arithmetic, without a figure
  >>> largest_fitting(sizes, 500, lambda s: probed.append(s) or (None if s > 90 else 100 + 5 * s)), len(probed) < 7
  ((80, 500), True)
  """
  measured = {}  # size -> total bytes
  fixed = 0
  bad, good = -1, len(sizes)  # indices: sizes[bad] known not to fit, sizes[good] known to fit
  index, predicted, contradicted = 0, None, 0
  if guess is not None:
    index = next((i for i, size in enumerate(sizes) if guess(size) <= budget), len(sizes) - 1)
    predicted = guess(sizes[index])
  while True:
    likely_answer = predicted is not None and predicted <= budget and measure_pick is not None
    measure_now = measure_pick if likely_answer else measure
    value = measure_now(sizes[index])
    if value is None:  # known not to fit, with no figure: no point of any line
      fits = False
    else:
      total, fixed_part = memory_parts(value)
      measured[sizes[index]], fixed = total, max(fixed, fixed_part)
      fits = total <= budget
    contradicted = contradicted + 1 if predicted is not None and (predicted <= budget) != fits else 0
    if fits:
      good = index
    else:
      bad = index
    if good == bad + 1:
      break
    line = _line(measured, fixed, budget)
    if fits and predicted is not None and line is not None:
      next_up, error = sizes[good - 1], abs(total - predicted)
      over = line(next_up)
      if guess is not None:
        # with a guess, its growth from the answer must say so too (a line from the fixed bytes through one
        # measurement overshoots where temporaries do not grow in proportion to the size), and only a guess
        # that was right at the answer, within 5% of the budget, is heard
        right = abs(total - guess(sizes[good])) <= 0.05 * budget
        over = min(over, total + guess(next_up) - guess(sizes[good])) if right else -math.inf
      if over > budget + max(error, 0.05 * budget):
        break  # the next larger size is over the budget by far more than the line's error at the answer
    index, predicted = _next_probe(sizes, bad, good, budget, line, bisect=contradicted >= 2 or line is None)
  if good == len(sizes):
    return None
  return sizes[good], measured[sizes[good]]


def _line(measured: dict, fixed: int, budget: int) -> Optional[Callable[[int], float]]:
  """Bytes as a line in the size through the two measurements nearest the budget in bytes (from one: through
  the fixed bytes at size 0); ``None`` if it does not rise or nothing is measured. The nearest, not the
  bracket's ends: a far end (the whole batch) would pull the line off where memory bends, and the search would
  creep."""
  points = sorted(measured, key=lambda size: abs(measured[size] - budget))[:2]
  if not points:
    return None
  if len(points) == 1:
    (s1, m1), (s0, m0) = (points[0], measured[points[0]]), (0, fixed)
  else:
    (s0, m0), (s1, m1) = sorted((s, measured[s]) for s in points)
  if s1 == s0 or m1 <= m0:
    return None
  slope = (m1 - m0) / (s1 - s0)
  return lambda size: m0 + slope * (size - s0)


def _next_probe(sizes, bad: int, good: int, budget: int, line, bisect: bool) -> Tuple[int, Optional[float]]:
  """The index to measure next, strictly between ``bad`` and ``good``, and the bytes the line predicts there."""
  if bisect:
    return (bad + good) // 2, None
  inside = [i for i in range(bad + 1, good) if line(sizes[i]) <= budget]
  index = inside[0] if inside else good - 1
  return index, line(sizes[index])


def choose_micro_batch_size(batch_size: int, budget: int, measure: Callable[[int], Union[int, StepMemory]], *,
                            measure_pick: Optional[Callable[[int], Union[int, StepMemory]]] = None,
                            below: Optional[int] = None, guess: Optional[Callable[[int], float]] = None
                            ) -> Tuple[int, int]:
  """Return ``(micro_batch_size, bytes)``: the largest candidate whose ``measure`` fits ``budget``.

  :func:`largest_fitting` over :func:`candidate_micro_batch_sizes`, assuming memory
  grows with the micro-batch size; each probe is one ahead-of-time compilation. ``measure_pick``: see
  :func:`largest_fitting`; ``below``: only sizes smaller than this (after a wrong measurement was corrected);
  ``guess``: see :func:`largest_fitting`.

  Raises
  ------
  ValueError
    If even one sample per micro-batch does not fit, naming the smallest figure that would.
  """
  measured = {}

  def recorded(measure_):
    def measure_recorded(size):
      value = measure_(size)
      measured[size] = memory_parts(value)[0]
      return value
    return measure_recorded

  sizes = [size for size in candidate_micro_batch_sizes(batch_size) if below is None or size < below]
  found = largest_fitting(sizes, budget, recorded(measure), guess=guess,
                          measure_pick=None if measure_pick is None else recorded(measure_pick)) if sizes else None
  if found is None:
    need = measured.get(1, budget + 1)
    raise TooSmall(f'memory_budget={format_memory(budget)} ({budget} bytes) is too small: even micro-batches of '
                   f'one sample need {format_memory(need)} ({need} bytes) for a batch of '
                   f'{batch_size}. Raise memory_budget to at least {need}, or use remat=True.', need)
  return found


_WHOLE_FIRST = DeviceSwitch(lambda: jax.default_backend() == 'tpu')


def compiles_whole_first() -> bool:
  """Whether the planner's search compiles its first candidate, a batch in one micro-batch, for training rather
  than quickly: as :func:`whole_first` says, else on a TPU. Where that step fits, it is the plan, compiled once
  (a quick probe and then a second compilation for training cost two); where it does not, XLA:TPU refuses it
  at buffer assignment, as early as a quick probe measures it. A CPU or GPU compiles a program that does not
  fit to the end, which costs more than the quick probe (on the 2-core CPU: 1.07 s against 0.64 s at batch
  256 of the start-up bench's rate RNN)."""
  return _WHOLE_FIRST()


def whole_first(enabled: Optional[bool]) -> ContextManager[None]:
  """Within the ``with``, the planner compiles a batch in one micro-batch for training first (``True``, also on
  a CPU: for the tests), or probes it quickly (``False``); ``None``: by the device (:func:`compiles_whole_first`).

  Examples
  --------
  >>> from brainpy_accum.memory._budget import compiles_whole_first, whole_first
  >>> with whole_first(True):
  ...   compiles_whole_first()
  True
  """
  return _WHOLE_FIRST.set(enabled)


def first_probe_trains(compilers, via_window: bool = False) -> bool:
  """Whether a search's first candidate, a batch in one micro-batch, is compiled for training: where
  :func:`compiles_whole_first` and fit can run that step itself (``compilers.keepable(via_window)``, see
  :class:`~brainpy_accum.memory._planner.Compilers`); else it is probed quickly."""
  return compiles_whole_first() and compilers.keepable(via_window)


def fewest_fitting(share: int, budget: int, compilers, batch: tuple, via_window: bool,
                   whole: Optional[PlannedStep] = None) -> Tuple[int, int, Optional[PlannedStep]]:
  """``(micro_batch_size, bytes, compiled step or None)``: the fewest micro-batches of a share of ``share`` samples
  whose step fits ``budget``, measured by the planner's ``compilers``
  (:class:`~brainpy_accum.memory._planner.Compilers`) on ``batch`` (``shared_args, inputs, targets``).

  Sizes the search predicts to be the answer are compiled as training runs them (when fit can run that
  executable), the others quickly; an answer measured quickly is compiled for training afterwards, and
  its memory must fit too, else the search goes on below it. Where :func:`compiles_whole_first`, the first
  probe, the share in one micro-batch, is compiled for training: where it fits, that is the plan, and its one
  compilation is training's. ``whole``: that step, compiled for training already (by the decision whether to
  stream in pieces).
  """
  plan_of = lambda size: plan_micro_batches(share, micro_batch_size=size)
  keepable, kept = compilers.keepable(via_window), {}
  if whole is not None:
    kept[share] = whole
  elif first_probe_trains(compilers, via_window):  # the search's first probe, compiled for training
    kept[share] = compilers.trial(plan_of(share), *batch, via_window)
  if share in kept and kept[share].memory.total <= budget:
    return share, kept[share].memory.total, kept[share]

  def probe(size):
    return kept[size].memory if size in kept else compilers.step_bytes(plan_of(size), *batch, via_window)

  def compile_for_training(size):
    if size not in kept:
      kept[size] = compilers.trial(plan_of(size), *batch, via_window)
    return kept[size].memory

  guess = None if compilers.guess(plan_of(share)) is None else (lambda size: compilers.guess(plan_of(size)))
  below = None
  while True:
    size, used = choose_micro_batch_size(share, budget, probe, below=below, guess=guess,
                                         measure_pick=compile_for_training if keepable else None)
    if not keepable:
      return size, used, None  # fit runs a step of its own (a window, a mesh): the probe's figure is XLA's measure
    planned = kept.get(size) or compilers.trial(plan_of(size), *batch, via_window)
    if planned.memory.total <= budget:
      return size, planned.memory.total, planned
    tqdm.write(f'memory plan: micro-batches of {size} need {format_memory(planned.memory.total)} compiled for '
               f'training, not the {format_memory(used)} of the quick compilation; searching below')
    below = size
