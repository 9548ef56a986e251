"""Working memory: remat over time and the memory-budget planner, judged by XLA's compile-time analysis."""

import re
import warnings

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import pytest

from brainpy_accum import AccumBPTT, parse_memory, plan_micro_batches
from brainpy_accum.memory._budget import step_memory
from brainpy_accum.memory._live import temp_bytes_at_least
from helpers import NO_DEVICE_LIMIT, TINY_SIZES, TRACED_BOUND, assert_trees_close, make_batches, make_model, params_of

FIT = bp.tools.DotDict(fit=True)


def _batch(size=48, num_time=40):
  return make_batches((size,), num_time=num_time, n_in=8, n_out=4)[0]


def _trainer(**kwargs):
  model = make_model('rnn', n_in=8, n_hidden=64, n_out=4)
  return AccumBPTT(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                   **kwargs)


@pytest.mark.parametrize('remat', [True, pytest.param(7, marks=(pytest.mark.long, pytest.mark.extended))])
def test_remat_gives_the_same_training_as_storing_every_step(remat):
  batches = make_batches((10, 7), num_time=30)
  results = []
  for option in (False, remat):
    model = make_model('snn')
    trainer = AccumBPTT(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                        num_micro_batch=3, remat=option, progress_bar=False)
    trainer.fit(batches, num_epoch=2)
    results.append((params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert_trees_close(results[1], results[0])


@pytest.mark.long  # the long suite (--long): README suite time
@TINY_SIZES
def test_remat_halves_the_working_memory_of_long_sequences():
  # A hidden size of whole TPU tiles (256 = 2 x 128), so that the states each step stores, which remat keeps
  # one of per segment, are most of the working memory on every platform: a TPU pads the 8 inputs of each step
  # to 128, a copy that remat keeps too (here 0.17 of it on the CPU; about 0.3 by the TPU's tiles).
  x, y = _batch(num_time=200)
  temp = {}
  for remat in (False, True):
    trainer = AccumBPTT(make_model('rnn', n_in=8, n_hidden=256, n_out=4), bp.losses.mean_squared_error,
                        optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, num_micro_batch=2, remat=remat)
    trainer.target.reset(len(x))
    compiled = trainer.f_train.compile(FIT, x, y)
    temp[remat] = compiled.memory_analysis().temp_size_in_bytes
  assert temp[True] <= 0.5 * temp[False], temp


@pytest.mark.long  # the long suite (--long): README suite time
@TINY_SIZES
def test_memory_falls_with_the_micro_batch_size_even_with_a_short_micro_batch():
  x, y = _batch()
  trainer = _trainer(num_micro_batch='auto', memory_budget='1GiB')
  trainer.target.reset(len(x))
  # 48 whole, 40 + 8 and 32 + 16 (a short last micro-batch), 2 x 24, 3 x 16: multiples of 8, as a TPU tiles a
  # batch's rows (12 and 10 samples would both take 16 rows there: the same memory)
  sizes = [48, 40, 32, 24, 16]
  used = [trainer.compiled_step_bytes(plan_micro_batches(48, micro_batch_size=s), FIT, x, y) for s in sizes]
  assert used == sorted(used, reverse=True), dict(zip(sizes, used))


@TINY_SIZES
def test_planner_picks_the_fewest_micro_batches_that_fit():
  x, y = _batch()
  probe = _trainer(num_micro_batch='auto', memory_budget='1GiB')
  probe.target.reset(len(x))
  need = {s: probe.compiled_step_bytes(plan_micro_batches(48, micro_batch_size=s), FIT, x, y) for s in (16, 24)}
  budget = (need[16] + need[24]) // 2  # 16 samples per micro-batch fit, 24 do not (XLA's bytes on this device)
  assert need[16] < budget < need[24], need

  trainer = _trainer(num_micro_batch='auto', memory_budget=budget)
  trainer.fit([(x, y)], num_epoch=1)
  plan, used = trainer.memory_plans[48]
  assert plan.micro_batch_size == 16 and trainer.num_micro_batch_for(48) == 3
  assert used == need[16] <= budget < need[24]
  assert trainer.compilations['fit'] == 1  # the probes compile on the side; the step compiles once


def test_planner_names_the_budget_that_would_fit():
  x, y = _batch()
  trainer = _trainer(num_micro_batch='auto', memory_budget=1000)
  params = params_of(trainer.target)
  # below the parameters' own bytes, so on every platform (the batch's data alone exceeds 1000 bytes too: the
  # figure named is what streaming one sample at a time needs)
  assert 1000 < sum(p.nbytes for p in params)
  with pytest.raises(ValueError, match=r'memory_budget=1000 B \(1000 bytes\) is too small.* Raise memory_budget to '
                                       r'at least \d+') as error:
    trainer.fit([(x, y)], num_epoch=1)
  assert_trees_close(params_of(trainer.target), params, rtol=0, atol=0)
  # the figure named is enough: it named the fixed bytes alone once (a second error then named the step's)
  need = int(re.search(r'at least (\d+)', str(error.value)).group(1))
  _trainer(num_micro_batch='auto', memory_budget=need).fit([(x, y)], num_epoch=1)


@pytest.mark.parametrize('optimizer, via_window', [
  (lambda: bp.optim.Adam(lr=0.05), False), (lambda: bp.optim.Momentum(lr=0.05), True), (lambda: bp.optim.SGD(lr=0.05), False)])
def test_arithmetic_bound_of_the_fixed_bytes_never_exceeds_xlas(optimizer, via_window):
  """The planner skips compiling a batch (or chunk) whose arguments and updated parameters alone exceed the
  budget: that figure must be a lower bound of XLA's fixed bytes (arguments + outputs - aliases), and a close one.

  The arrays are whole TPU tiles ((8, 128): 128 inputs, units and outputs, 24 samples of 8 steps), where XLA
  counts the bytes the arithmetic counts on every platform; a TPU would pad 8 inputs to 128, which the bound,
  a figure of the arrays' own bytes, leaves out (still a lower bound, but not a close one there)."""
  x, y = make_batches((24,), num_time=8, n_in=128, n_out=128)[0]
  trainer = AccumBPTT(make_model('rnn', n_in=128, n_hidden=128, n_out=128), bp.losses.mean_squared_error,
                      optimizer=optimizer(), progress_bar=False, num_micro_batch='auto', memory_budget='1GiB')
  trainer.target.reset(24)
  fixed = step_memory(trainer.compile_step(x, y, plan=plan_micro_batches(24, num_micro_batch=2),
                                           via_window=via_window, quick=True)).fixed
  bound = trainer._fixed_bytes(x, y)
  assert trainer._argument_bytes(x, y) < bound <= fixed, (bound, fixed)
  if not via_window:  # a window's step also writes its sums, which the bound leaves out
    assert fixed < 1.2 * bound, (bound, fixed)


class _GRU(bp.DynamicalSystem):
  def __init__(self):
    super().__init__()
    self.rnn, self.out = bp.dyn.GRUCell(8, 16), bp.dnn.Dense(16, 4)

  def update(self, x):
    return self.out(self.rnn(x))


def _gru():
  bm.random.seed(0)
  with bm.training_environment():
    return _GRU()


@TRACED_BOUND
@pytest.mark.parametrize('model, num_time, remat', [
  ('rnn', 12, True), ('snn', 12, False), ('gru', 12, False),  # the others in the long suite: README suite time
  *[pytest.param(*case, marks=pytest.mark.long) for case in [('rnn', 12, False), ('rnn', 1, False), ('snn', 12, True)]]])
def test_traced_lower_bound_of_the_step_never_exceeds_xlas_memory(model, num_time, remat):
  """The planner rules out micro-batch sizes whose step's lower bound, read from its trace without compiling,
  exceeds the budget (:mod:`brainpy_accum.memory._live`): that bound must never exceed XLA's figure, for any
  model, sequence length (one step: XLA inlines the loop), remat, cut (whole, uneven) or window."""
  x, y = _batch(size=12, num_time=num_time)
  net = _gru() if model == 'gru' else make_model(model, n_in=8, n_hidden=16, n_out=4)
  trainer = AccumBPTT(net, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                      num_micro_batch='auto', memory_budget='1GiB', remat=remat)
  trainer.target.reset(12)
  for micro_batch_size, via_window in ((12, False), (5, True)):  # 12 = one piece; 5, 5, 2
    plan = plan_micro_batches(12, micro_batch_size=micro_batch_size)
    used = step_memory(trainer.compile_step(x, y, plan=plan, via_window=via_window, quick=True))
    bound = trainer.planner.compilers.bytes_at_least(plan, FIT, x, y, via_window)
    temp = bound - trainer._fixed_bytes(x, y)  # the part read from the trace
    assert temp <= used.total - used.fixed and bound <= used.total, (micro_batch_size, via_window, temp, used)


@TRACED_BOUND
def test_traced_lower_bound_is_close_enough_to_rule_sizes_out():
  """The bound counts the stacked residuals of the time loop, most of a long sequence's working memory: at least
  half of XLA's temporaries. The residuals are whole TPU tiles ((8, 128): 256 units, 16 samples), where they
  take the bytes the arithmetic counts on every platform; a TPU pads the 8 inputs and 4 outputs of each step to
  128, copies the bound does not count (on the CPU the bound is 0.98 of XLA's figure here; about 0.6 by the
  TPU's tiles)."""
  x, y = _batch(size=16, num_time=96)
  trainer = AccumBPTT(make_model('rnn', n_in=8, n_hidden=256, n_out=4), bp.losses.mean_squared_error,
                      optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, num_micro_batch='auto', memory_budget='1GiB')
  trainer.target.reset(16)
  plan = plan_micro_batches(16, micro_batch_size=16)
  used = step_memory(trainer.compile_step(x, y, plan=plan, quick=True))
  temp = trainer.planner.compilers.bytes_at_least(plan, FIT, x, y, False) - trainer._fixed_bytes(x, y)
  assert 0.5 * (used.total - used.fixed) <= temp <= used.total - used.fixed, (temp, used)


def test_lower_bound_of_a_loop_that_stacks_random_keys():
  """Random keys stacked for the backward loop (a model drawing numbers at each step, under remat) have no
  plain dtype: the bound counts them as 0 bytes and still counts the residuals, never above XLA's figure."""
  def loss(w, key):
    def body(carry, _):
      h, k = carry
      k, sub = jax.random.split(k)
      return (jnp.tanh(h * w + jax.random.uniform(sub, h.shape)), k), None
    (h, _), _ = jax.lax.scan(jax.checkpoint(body), (jnp.ones(64), key), None, length=20)
    return h.sum()

  traced = jax.jit(jax.grad(loss)).trace(1., jax.random.key(0))
  bound = temp_bytes_at_least(traced.jaxpr)
  assert 20 * 64 * 4 <= bound <= traced.lower().compile().memory_analysis().temp_size_in_bytes


def test_unplanned_batch_size_is_explained():
  with pytest.raises(ValueError, match=r'No micro-batch plan for batch_size=8 yet.*plan_memory'):
    _trainer(num_micro_batch='auto', memory_budget='1GiB').plan_for(8)


@pytest.mark.parametrize('text, size', [('2GiB', 2 ** 31), ('512 MiB', 2 ** 29), ('1.5GB', 1_500_000_000),
                                        (4096, 4096)])
def test_memory_budget_strings(text, size):
  assert parse_memory(text) == size


@pytest.mark.parametrize('kwargs, error, message', [
  pytest.param({'num_micro_batch': 'auto'}, ValueError, "needs memory_budget, e.g. memory_budget='2GiB'",
               marks=NO_DEVICE_LIMIT),
  ({'num_micro_batch': 'auto', 'memory_budget': '2 apples'}, ValueError, "memory_budget='2 apples' is not a size"),
  ({'num_micro_batch': 'auto', 'memory_budget': 2.5}, TypeError, 'memory_budget=2.5 must be bytes'),
  ({'num_micro_batch': 4, 'memory_budget': '1GiB'}, ValueError, "only used with num_micro_batch='auto'"),
  ({'num_micro_batch': 'many'}, TypeError, "num_micro_batch='many' must be a positive int"),
  ({'num_micro_batch': 2, 'remat': 0}, ValueError, 'remat=0 must be a positive int'),
  ({'num_micro_batch': 2, 'remat': 'yes'}, TypeError, "remat='yes'"),
])
def test_bad_memory_options_are_named(kwargs, error, message):
  with pytest.raises(error, match=message):
    _trainer(**kwargs)


def test_lower_bound_uses_no_deprecated_jax():
  """The bound is found with JAX's deprecation warnings as errors (once JAX removes what it deprecates, a bound
  taken through it would silently become 0: no size ruled out)."""
  def loss(w, xs):
    return jax.lax.scan(lambda h, x: (jnp.tanh(h * w + x),) * 2, jnp.zeros(64), xs)[1].sum()

  traced = jax.jit(jax.grad(loss)).trace(1., jnp.ones((100, 64)))
  with warnings.catch_warnings():
    warnings.simplefilter('error', DeprecationWarning)
    assert temp_bytes_at_least(traced.jaxpr) >= 100 * 64 * 4
