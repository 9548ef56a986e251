"""States written without a batch axis (``core/_written.py``): the prints that compare writes, and the engine's
rule against a plain loop over the micro-batches."""

import warnings

import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brainpy_accum.core import MicroResult, accumulate, plan_micro_batches
from brainpy_accum.core._written import WriteEvidence, WriteReport, fingerprint
from helpers import assert_trees_close


VALUES = [jnp.asarray([0.5, -0.3, 0.2]), jnp.arange(6, dtype=jnp.int32).reshape(2, 3), jnp.asarray([True, False]),
          jnp.asarray([1., 2.], jnp.bfloat16), {'a': jnp.ones(2), 'b': jnp.zeros((), jnp.int8)}]


def test_equal_values_print_alike_in_any_program():
  """Each value printed as it is, and in another program that computes it another way: one print."""
  direct = jax.jit(lambda values: [fingerprint(v) for v in values])(VALUES)
  rebuilt = jax.jit(lambda values: [fingerprint(jax.tree_util.tree_map(lambda x: jnp.flip(jnp.flip(x) + 0), v))
                                    for v in values])(VALUES)
  assert [int(p) for p in direct] == [int(p) for p in rebuilt]


def test_any_changed_bit_or_place_changes_the_print():
  """One ulp, -0. for 0., a NaN, the order of the elements, a second leaf: each gives another print."""
  w = jnp.asarray([0.5, -0.3, 0.2, 0.], jnp.float32)
  changed = [w.at[0].set(jnp.nextafter(w[0], 1.)), w.at[3].set(-0.), w.at[1].set(jnp.nan), w[::-1], (w, w)]
  prints = [int(p) for p in jax.jit(lambda values: [fingerprint(v) for v in values])([w] + changed)]
  assert len(set(prints)) == len(prints), prints


def _micro_fn(w, count, record):
  """A loss of one micro-batch that clips ``w``, counts its calls and records its first sample."""

  def micro_fn(args, size):
    (x,) = args
    w.value = jnp.where(w.value < 0, 0., w.value)
    count.value += 1
    record.value = x[0, 0]
    loss, grads = jax.value_and_grad(lambda v: jnp.mean((x @ v) ** 2))(w.value)
    return MicroResult({'w': grads}, loss, {}, jnp.asarray(size, jnp.float32))

  return micro_fn


@pytest.mark.parametrize('sizes', [(2, 10), (3, 10)], ids=['even', 'uneven'])
def test_every_micro_batch_starts_from_the_values_before_the_loop(sizes):
  """Against a plain loop that puts the states back before each micro-batch: the same weighted gradient sum, and
  the states as the last micro-batch wrote them; the record, whose writes differ, is reported."""
  num, batch = sizes
  x = jnp.asarray(np.random.RandomState(0).randn(batch, 3), jnp.float32)
  w, count, record = brainstate.ParamState(jnp.asarray([0.5, -0.3, 0.2])), brainstate.State(jnp.zeros((), jnp.int32)), \
      brainstate.State(jnp.zeros(()))
  plan = plan_micro_batches(batch, num_micro_batch=num)
  start = [s.value for s in (w, count, record)]
  expected, total = jnp.zeros(3), 0
  for begin, size in zip(np.cumsum((0,) + plan.sizes[:-1]), plan.sizes):
    for state, value in zip((w, count, record), start):
      state.value = value
    out = _micro_fn(w, count, record)((x[begin:begin + size],), size)
    expected, total = expected + size * out.grads['w'], total + size
  written = [s.value for s in (w, count, record)]
  for state, value in zip((w, count, record), start):
    state.value = value
  report = WriteReport({id(record): 'record'}, evidence=WriteEvidence([w, count, record]))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    grad_sum = brainstate.transform.jit(lambda x: accumulate(_micro_fn(w, count, record), (x,), [0], plan,
                                                            grads_like={'w': w.value}, report=report).grad_sum)(x)
    assert not caught  # the step's flags are an output of it, read on the host when asked
    report.read()
  assert_trees_close((grad_sum['w'], [s.value for s in (w, count, record)]), (expected, written))
  assert int(count.value) == 1
  assert [str(c.message).split(' has')[0] for c in caught] == ['Model state record']


def _record_batch(num_states=1):
  """States of a loss that records its first sample (a data-dependent write), and a batch of 10."""
  states = [brainstate.State(jnp.zeros(())) for _ in range(num_states)]

  def micro_fn(args, size):
    (x,) = args
    for state in states:
      state.value = x[0, 0]
    return MicroResult(None, jnp.mean(x), {}, jnp.asarray(size, jnp.float32))

  return states, micro_fn, jnp.asarray(np.random.RandomState(0).randn(10, 3), jnp.float32)


def test_flags_known_on_the_host_are_warned_of_at_once_without_a_callback(monkeypatch):
  """Outside jit the loop's flags are concrete: the report warns as it is called, with no callback (none could
  run here: the callbacks are made to fail)."""
  states, micro_fn, x = _record_batch()
  monkeypatch.setattr(jax.debug, 'callback', lambda *a, **k: pytest.fail('a host callback'))
  report = WriteReport({id(states[0]): 'record'})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    accumulate(micro_fn, (x,), [0], plan_micro_batches(10, num_micro_batch=2), report=report)
  assert [str(c.message).split(' has')[0] for c in caught] == ['Model state record']


def test_a_traced_report_without_evidence_or_a_cpu_backend_says_it_cannot_check(monkeypatch):
  """The functional core inside a user's jit, where JAX has no CPU backend (JAX_PLATFORMS=tpu): no callback is
  bound; one warning names the written states and how to have them checked."""
  from brainpy_accum.core import _written
  states, micro_fn, x = _record_batch(2)
  monkeypatch.setattr(_written, 'host_callbacks_run', lambda: False)
  monkeypatch.setattr(jax.debug, 'callback', lambda *a, **k: pytest.fail('a host callback'))
  report = WriteReport({id(states[0]): 'first', id(states[1]): 'second'})
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    brainstate.transform.jit(lambda x: accumulate(micro_fn, (x,), [0], plan_micro_batches(10, num_micro_batch=2),
                                                  report=report).loss_sum)(x)
  (message,) = [str(c.message) for c in caught]
  assert 'writes first, second' in message and 'cannot be checked inside jit' in message, message
