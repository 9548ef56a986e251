"""Measuring configurations in one process: compiled memory, and step times in interleaved rounds.

A shared machine's speed drifts by tens of percent within minutes, so timing each method in a block of
its own compares the load of one minute with the load of the next. Instead every configuration runs one
step per round, in alternating order (forwards, then backwards), and methods are compared by the median of
their per-round ratios: what the load does to a round, it does to both sides of the ratio.

The steps measured, one per benchmarked method, behind the same small interface (:func:`build_step`):

- ``bptt``: ``bp.BPTT`` on the whole batch.
- ``accum``: ``AccumBPTT`` with ``num_micro_batch=N`` (and ``remat``).
- ``recipe``: what a BrainPy user writes by hand: a jitted function scanning
  ``bm.grad`` over micro-batches with ``bm.scan`` (with the two fixes that
  brainpy 2.8.2 needs: a plain ``dict`` accumulator and the state reset at the
  micro-batch size).
- ``jax``: the same network in plain JAX + optax, ``lax.scan`` over time inside
  ``lax.scan`` over micro-batches.
"""

import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Sequence

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import optax

from ..diagnostics._compiles import count_compilations
from ..memory import compiled_step_bytes
from ..trainer import AccumBPTT
from .workloads import Shape, jax_loss, jax_params, last_step_only, make_batch, make_brainpy_model

__all__ = ['FIT', 'LEARNING_RATE', 'Prepared', 'Step', 'build_step', 'largest_batch_within', 'loss_of', 'measure_all',
           'per_round_ratio', 'plain_jax_step', 'prepare', 'time_in_rounds']

LEARNING_RATE = 1e-3
FIT = bp.tools.DotDict(fit=True)


class Step(NamedTuple):
  run: Callable[[], None]          # one optimizer update, blocked until done
  compile: Callable[[], object]    # the step compiled ahead of time (jax.stages.Compiled)
  compilations: Callable[[], int]  # XLA compilations its runs caused so far


def _counted(run: Callable[[], None], compile_: Callable[[], object]) -> Step:
  """A :class:`Step` of ``run`` and ``compile_`` whose ``compilations()`` is the step's executable and every
  compilation a later run causes (1 when nothing recompiled): the first run compiles the step or reuses what
  ``compile_`` compiled, as the jit's dispatch decides."""
  runs, recompiled = [0], [0]

  def counted_run():
    with count_compilations() as compiled:
      run()
    recompiled[0] += compiled() if runs[0] else 0
    runs[0] += 1

  return Step(counted_run, compile_, lambda: min(runs[0], 1) + recompiled[0])


def _block(trainer, out):
  jax.block_until_ready((out, [v.value for v in trainer.target.train_vars().unique().values()]))


def _device_batch(shape: Shape, workload: str = 'rnn'):
  """The batch as device arrays, made once: no method pays a host-to-device copy inside its timed step."""
  return tuple(jnp.asarray(a) for a in make_batch(shape, workload=workload))


def _trainer_step(trainer, shape: Shape, abstract_data: bool, workload: str = 'rnn') -> Step:
  x, y = make_batch(shape, abstract=True, workload=workload) if abstract_data else _device_batch(shape, workload)

  def run():
    trainer.target.reset(shape.batch)
    _block(trainer, trainer.f_train(FIT, x, y))

  def compile_():
    trainer.target.reset(shape.batch)
    return trainer.f_train.compile(FIT, x, y)

  return _counted(run, compile_)


def _mse(predicts, targets):
  return bp.losses.mean_squared_error(predicts, targets)


def _last_step_cross_entropy(predicts, targets):
  return bp.losses.cross_entropy_loss(predicts[:, -1], targets)


def loss_of(workload: str):
  """The workload's loss for ``bp.BPTT`` and ``AccumBPTT``: mean-squared error, or (``'_ce'``) the cross-entropy
  of the last step's read-out."""
  return _last_step_cross_entropy if last_step_only(workload) else _mse


def _recipe_step(workload: str, shape: Shape, num_micro_batch: int) -> Step:
  model = make_brainpy_model(workload, shape)
  optimizer = bp.optim.Adam(lr=LEARNING_RATE, train_vars=model.train_vars().unique())
  train_vars = model.train_vars().unique()
  micro = shape.batch // num_micro_batch
  x, y = _device_batch(shape, workload)
  xs = x.reshape((num_micro_batch, micro) + x.shape[1:])
  ys = y.reshape((num_micro_batch, micro) + y.shape[1:])

  def loss(xb, yb):
    outs = bm.for_loop(model.step_run, (jnp.arange(shape.time), jnp.swapaxes(xb, 0, 1)))
    return loss_of(workload)(jnp.swapaxes(outs, 0, 1), yb)

  def body(acc, batch):
    model.reset(micro)
    grads, value = bm.grad(loss, grad_vars=train_vars, return_value=True)(*batch)
    return {k: acc[k] + grads[k] for k in acc}, value

  @bm.jit
  def step(xs, ys):
    zeros = {k: jnp.zeros_like(v.value) for k, v in train_vars.items()}
    acc, losses = bm.scan(body, zeros, (xs, ys))
    optimizer.update({k: g / num_micro_batch for k, g in acc.items()})
    return losses.mean()

  def run():
    model.reset(micro)
    jax.block_until_ready((step(xs, ys), [v.value for v in train_vars.values()]))

  def compile_():
    model.reset(micro)
    return step.compile(xs, ys)

  return _counted(run, compile_)


def plain_jax_step(workload: str, num_micro_batch: int, tx=None) -> Callable:
  """The plain JAX + optax train step ``step(params, opt_state, x, y) -> (params, opt_state, loss)``, jitted:
  the whole batch ``x, y`` cut inside into ``num_micro_batch`` equal micro-batches (a reshape, no copy), whose
  gradients a ``lax.scan`` sums (``lax.scan`` over time inside), then one Adam update (``tx``, by default
  ``optax.adam(LEARNING_RATE)``)."""
  tx = tx or optax.adam(LEARNING_RATE)
  grad_fn = jax.value_and_grad(lambda p, xb, yb: jax_loss(workload, p, xb, yb))

  @jax.jit
  def step(params, opt_state, x, y):
    xs = x.reshape((num_micro_batch, x.shape[0] // num_micro_batch) + x.shape[1:])
    ys = y.reshape((num_micro_batch, y.shape[0] // num_micro_batch) + y.shape[1:])

    def body(acc, batch):
      value, grads = grad_fn(params, *batch)
      return jax.tree_util.tree_map(jnp.add, acc, grads), value
    acc, losses = jax.lax.scan(body, jax.tree_util.tree_map(jnp.zeros_like, params), (xs, ys))
    updates, opt_state = tx.update(jax.tree_util.tree_map(lambda g: g / num_micro_batch, acc), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses.mean()

  return step


def _jax_step(workload: str, shape: Shape, num_micro_batch: int) -> Step:
  tx = optax.adam(LEARNING_RATE)
  state = {'params': jax_params(shape)}
  state['opt'] = tx.init(state['params'])
  x, y = _device_batch(shape, workload)
  step = plain_jax_step(workload, num_micro_batch, tx)

  def run():
    state['params'], state['opt'], loss = step(state['params'], state['opt'], x, y)
    jax.block_until_ready((state['params'], loss))

  return _counted(run, lambda: step.lower(state['params'], state['opt'], x, y).compile())


def build_step(method: str, workload: str, shape: Shape, num_micro_batch: int = 1, remat: bool = False,
               abstract_data: bool = False) -> Step:
  """The train step of ``method`` on ``workload`` at ``shape`` (batch = effective batch).

  ``abstract_data=True`` (``bptt`` and ``accum`` only) compiles on shapes alone, for memory probes.
  """
  if method == 'recipe':
    return _recipe_step(workload, shape, num_micro_batch)
  if method == 'jax':
    return _jax_step(workload, shape, num_micro_batch)
  model = make_brainpy_model(workload, shape)
  optimizer = bp.optim.Adam(lr=LEARNING_RATE)
  if method == 'bptt':
    trainer = bp.BPTT(model, loss_of(workload), optimizer=optimizer, progress_bar=False)
  else:
    trainer = AccumBPTT(model, loss_of(workload), optimizer=optimizer, num_micro_batch=num_micro_batch, remat=remat,
                        progress_bar=False)
  return _trainer_step(trainer, shape, abstract_data, workload)

class Prepared(NamedTuple):
  config: dict
  step: Step
  memory: Dict[str, int]
  compile_s: float


def _memory(compiled) -> Dict[str, int]:
  stats = compiled.memory_analysis()
  return {'temp': stats.temp_size_in_bytes, 'argument': stats.argument_size_in_bytes,
          'output': stats.output_size_in_bytes, 'total': compiled_step_bytes(compiled)}


def prepare(config: dict) -> Prepared:
  """Build ``config``'s step and read its memory from XLA's compile-time analysis (deterministic).

  ``config`` holds ``method``, ``workload``, ``shape`` (a :class:`Shape` as a list), ``num_micro_batch``
  and ``remat``.
  """
  step = build_step(config['method'], config['workload'], Shape(*config['shape']), config.get('num_micro_batch', 1),
                    config.get('remat', False))
  start = time.perf_counter()
  memory = _memory(step.compile())
  return Prepared(config, step, memory, time.perf_counter() - start)


def time_in_rounds(steps: Sequence[Step], rounds: int, warm_up: bool = True) -> List[List[float]]:
  """Seconds of one step of each of ``steps`` in each of ``rounds`` rounds, after one warm-up step each
  (``warm_up=False``: none, the steps have run already).

  Round ``r`` runs the steps forwards when ``r`` is even and backwards when it is odd, so that no step
  always follows the same neighbour.
  """
  for step in steps if warm_up else ():
    step.run()  # the real call compiles (or reuses) the step
  times: List[List[float]] = [[] for _ in steps]
  order = list(range(len(steps)))
  for r in range(rounds):
    for i in (order if r % 2 == 0 else order[::-1]):
      start = time.perf_counter()
      steps[i].run()
      times[i].append(time.perf_counter() - start)
  return times


def per_round_ratio(times: Sequence[float], base: Sequence[float]) -> float:
  """The median over rounds of ``times[r] / base[r]``: the drift of the machine's speed cancels."""
  return statistics.median(t / b for t, b in zip(times, base))


def measure_all(configs: Sequence[dict], rounds: int = 5) -> List[dict]:
  """Compile every configuration, then time them all in ``rounds`` interleaved rounds in this process.

  Each result is its config with ``memory`` (bytes: ``temp``, ``argument``, ``output``, ``total``),
  ``compile_s``, ``step_times`` (one per round, aligned across results), ``step_s`` (their median) and
  ``compilations`` (XLA executables behind the step, 1 when nothing recompiled).
  """
  prepared = [prepare(config) for config in configs]
  times = time_in_rounds([p.step for p in prepared], rounds)
  return [{**p.config, 'memory': p.memory, 'compile_s': p.compile_s, 'step_s': statistics.median(t),
           'step_times': t, 'compilations': p.step.compilations()} for p, t in zip(prepared, times)]


def largest_batch_within(budget: int, method: str, workload: str, shape: Shape, num_micro_batch: int = 1,
                         precision: float = 0.01) -> int:
  """Largest effective batch (a multiple of ``num_micro_batch``) whose compiled step fits ``budget`` bytes.

  Doubling from the benchmark's batch, then bisection down to ``precision``
  (relative); every probe is an ahead-of-time compilation on abstract inputs,
  so nothing is allocated or run. Returns the largest batch verified to fit.
  """
  def fits(multiple: int) -> bool:
    probe = shape._replace(batch=multiple * num_micro_batch)
    step = build_step(method, workload, probe, num_micro_batch, abstract_data=True)
    return compiled_step_bytes(step.compile()) <= budget

  low, high = 0, max(1, shape.batch // num_micro_batch)  # in multiples of num_micro_batch
  while fits(high):
    low, high = high, 2 * high
  while high - low > max(1, precision * low):
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
  return low * num_micro_batch
