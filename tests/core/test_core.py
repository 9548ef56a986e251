"""``micro_batched_grad`` against whole-batch ``brainstate.transform.grad`` and ``jax.grad``."""

import re

import brainpy as bp
import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from brainpy_accum import micro_batched_grad
from helpers import assert_trees_close, make_model


def data(*shape, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randn(*shape), jnp.float32)


PARAMS = {'w': data(3, 2, seed=1), 'b': data(2, seed=2)}


def pure_loss(params, x, y, reduce=jnp.mean):
  return reduce(jnp.sum((jnp.tanh(x @ params['w'] + params['b']) - y) ** 2, axis=-1))


def param_states():
  return {k: brainstate.ParamState(v) for k, v in PARAMS.items()}


def values(states):
  return {k: s.value for k, s in states.items()}


def state_values(model):
  """Every state of a brainpy model, and the global random key, as comparable arrays."""
  plain = lambda v: jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v
  return [plain(v.value) for v in model.vars().unique().values()] + [plain(brainstate.random.DEFAULT.value)]


def count_primitives(jaxpr, name):
  """How often a primitive appears in a printed jaxpr, nested ones included."""
  return len(re.findall(rf'\b{name}\[', str(jaxpr)))


# ----------------------------------------------------------------------------- pure functions of explicit params


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
@pytest.mark.parametrize('n', [1, 2, 3, 'B'])
@pytest.mark.parametrize('batch', [7, 8])
def test_matches_jax_grad_of_the_whole_batch(batch, n, reduction):
  states, reduce = param_states(), jnp.mean if reduction == 'mean' else jnp.sum
  grad_fn = micro_batched_grad(lambda x, y: pure_loss(values(states), x, y, reduce), states,
                               num_micro_batch=batch if n == 'B' else n, grad_reduction=reduction, return_value=True)
  x, y = data(batch, 3, seed=3), data(batch, 2, seed=4)
  loss, grads = jax.value_and_grad(pure_loss)(PARAMS, x, y, reduce)
  assert_trees_close(jax.jit(grad_fn)(x, y), (grads, loss))


def test_one_micro_batch_is_brainstate_grad_bit_for_bit():
  states = param_states()
  loss_fn = lambda x, y: pure_loss(values(states), x, y)
  x, y = data(7, 3, seed=3), data(7, 2, seed=4)
  got = micro_batched_grad(loss_fn, states, num_micro_batch=1, return_value=True)(x, y)
  expected = brainstate.transform.grad(loss_fn, states, return_value=True)(x, y)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, expected)


def test_micro_batch_size_with_a_short_last_micro_batch():
  states = param_states()
  grad_fn = micro_batched_grad(lambda x, y: pure_loss(values(states), x, y), states, micro_batch_size=3)
  x, y = data(8, 3, seed=3), data(8, 2, seed=4)  # 3 + 3 + 2
  assert_trees_close(grad_fn(x, y), jax.grad(pure_loss)(PARAMS, x, y))


@pytest.mark.parametrize('n', [2, 3])
def test_loss_weight_fn_gives_the_whole_batch_masked_mean(n):
  def masked(params, x, mask, y):
    err = jnp.sum((jnp.tanh(x @ params['w'] + params['b']) - y) ** 2, axis=-1)
    return jnp.sum(mask * err) / jnp.sum(mask)

  states = param_states()
  x, y = data(7, 5, 3, seed=3), data(7, 5, 2, seed=4)
  mask = jnp.asarray(np.random.RandomState(5).rand(7, 5) < np.linspace(0.1, 0.9, 7)[:, None], jnp.float32)
  loss_fn = lambda x, mask, y: masked(values(states), x, mask, y)
  weighted = micro_batched_grad(loss_fn, states, num_micro_batch=n, loss_weight_fn=lambda x, mask, y: mask.sum())
  expected = jax.grad(masked)(PARAMS, x, mask, y)
  assert_trees_close(jax.jit(weighted)(x, mask, y), expected)
  by_count = micro_batched_grad(loss_fn, states, num_micro_batch=n)(x, mask, y)
  assert not np.allclose(by_count['w'], expected['w'], rtol=1e-3)  # sample counts are the wrong weights here


def test_a_micro_batch_that_loss_weight_fn_weighs_0_adds_nothing():
  """The last of 3 micro-batches holds padding alone (mask 0): its masked mean is 0 / 0, its gradient nan. The
  whole batch's gradient holds no such term, and neither do the combined gradient, loss and metrics."""
  def masked(params, x, mask, y):
    err = jnp.sum((jnp.tanh(x @ params['w'] + params['b']) - y) ** 2, axis=-1)
    loss = jnp.sum(mask * err) / jnp.sum(mask)
    return loss, {'err': loss}

  states = param_states()
  x, y = data(8, 5, 3, seed=3), data(8, 5, 2, seed=4)
  mask = jnp.asarray(np.arange(8)[:, None] < np.full((1, 5), 5), jnp.float32)  # samples 6, 7: the last cut
  loss_fn = lambda x, mask, y: masked(values(states), x, mask, y)  # noqa: E731
  grad_fn = micro_batched_grad(loss_fn, states, num_micro_batch=3, loss_weight_fn=lambda x, mask, y: mask.sum(),
                               has_aux=True, return_value=True)
  grads, loss, aux = jax.jit(grad_fn)(x, mask, y)
  (expected_loss, expected_aux), expected = jax.value_and_grad(masked, has_aux=True)(PARAMS, x, mask, y)
  assert_trees_close(grads, expected)
  np.testing.assert_allclose([loss, aux['err']], [expected_loss, expected_aux['err']], rtol=1e-6)


def test_streamed_chunks_of_weight_0_add_nothing_on_the_host():
  """A streamed batch's chunk of padding alone (weight 0, its own loss and metric nan) adds nothing to the
  batch's loss and weighted metrics; chunks all of weight 0 give nan, as their whole batch's 0 / 0 would."""
  from brainpy_accum.core._metrics import MetricRule, combine_on_host
  from brainpy_accum.memory._stream import combine
  results = [(np.float32(2.), {'m': np.float32(4.)}), (np.float32(np.nan), {'m': np.float32(np.nan)})]
  loss, aux = combine(results, [3., 0.], 'mean')
  assert (loss, aux['m']) == (2., 4.)
  assert np.isnan(combine(results, [0., 0.], 'mean')[0])
  rule = MetricRule(None, 'mean')
  assert combine_on_host([r[1] for r in results], [3., 0.], [3, 3], [rule], True) == {'m': 4.}


def test_a_one_dimensional_short_term_state_of_the_batch_length_is_not_cut_unasked():
  """A ShortTermState of 8 values at batch 8: an adaptive threshold of 8 neurons, not one value per sample. It
  was cut 4 + 4 silently, each half moved by its own micro-batch's mean activity; left whole, its write (a batch
  statistic) is reported, as at batch 10. A HiddenState of one value per sample is cut, and exact."""
  w = brainstate.ParamState(data(3, 8, seed=1))
  threshold = brainstate.ShortTermState(jnp.full(8, .5))

  def homeostatic(x, y):
    h = jnp.tanh(x @ w.value)
    threshold.value = threshold.value + 0.1 * (jnp.mean(h) - 0.2)
    return jnp.mean((h - y) ** 2) + jnp.mean(threshold.value ** 2)

  x, y = data(8, 3, seed=3), data(8, 8, seed=4)
  with pytest.warns(UserWarning, match=r'ShortTermState\(shape=\(8,\)\) has no batch axis.*states=\[\(state, 0\)\]'):
    micro_batched_grad(homeostatic, {'w': w}, num_micro_batch=2)(x, y)
  assert len(set(np.asarray(threshold.value).tolist())) == 1  # one value for every neuron, as a whole batch leaves

  per_sample = brainstate.HiddenState(jnp.zeros(8))

  def leaky(x, y):
    per_sample.value = 0.5 * per_sample.value + jnp.tanh(x @ w.value).sum(-1)
    return jnp.mean((per_sample.value[:, None] - y) ** 2)

  grads = micro_batched_grad(leaky, {'w': w}, num_micro_batch=2)(x, y)
  after = per_sample.value
  per_sample.value = jnp.zeros(8)
  assert_trees_close(grads, brainstate.transform.grad(leaky, {'w': w})(x, y))
  assert_trees_close(after, per_sample.value)


@pytest.mark.parametrize('batch, n', [(12, 2), (10, 4)])
def test_a_per_sample_aux_leaf_is_refused_by_name(batch, n):
  """aux holding one value per sample: a weighted mean over the micro-batches would give the average of their
  rows (shape (6,) of a batch of 12, silently), or with a short last micro-batch fail in JAX's cond; it is refused
  by name. Per-batch summaries combine exactly."""
  states = param_states()

  def loss(x, y):
    per = jnp.sum((jnp.tanh(x @ values(states)['w'] + values(states)['b']) - y) ** 2, axis=-1)
    return jnp.mean(per), {'per_sample': per, 'above': jnp.mean(per > 1.)}

  x, y = data(batch, 3, seed=3), data(batch, 2, seed=4)
  with pytest.raises(ValueError, match=r"aux\['per_sample'\] has shape \(\d+,\) in a micro-batch .* and "
                                       rf"\({batch},\) in the batch of {batch}"):
    micro_batched_grad(loss, states, num_micro_batch=n, has_aux=True)(x, y)
  summary = lambda x, y: (loss(x, y)[0], {'above': loss(x, y)[1]['above']})  # noqa: E731
  grads, aux = micro_batched_grad(summary, states, num_micro_batch=n, has_aux=True)(x, y)
  expected, expected_aux = brainstate.transform.grad(summary, states, has_aux=True)(x, y)
  assert_trees_close((grads, aux), (expected, expected_aux))


@pytest.mark.parametrize('time_first', [False, True])
def test_dict_and_tuple_args_with_their_own_batch_axes(time_first):
  def loss(params, inputs, y, scale):
    x = inputs['a'] + scale * inputs['b'][0]
    x = x.transpose(1, 0, 2) if time_first else x
    return pure_loss(params, x.mean(1), y)

  states, axis = param_states(), 1 if time_first else 0
  shape = (4, 7, 3) if time_first else (7, 4, 3)
  inputs, y = {'a': data(*shape, seed=3), 'b': (data(*shape, seed=4),)}, data(7, 2, seed=5)
  grad_fn = micro_batched_grad(lambda inputs, y, scale: loss(values(states), inputs, y, scale), states,
                               num_micro_batch=3, batch_axis=({'a': axis, 'b': (axis,)}, 0, None), return_value=True)
  got = jax.jit(grad_fn)(inputs, y, jnp.float32(0.5))
  expected_loss, expected = jax.value_and_grad(loss)(PARAMS, inputs, y, 0.5)
  assert_trees_close(got, (expected, expected_loss))


@pytest.mark.parametrize('return_value', [False, True])
@pytest.mark.parametrize('has_aux', [False, True])
def test_output_has_brainstate_grads_structure(has_aux, return_value):
  states = param_states()

  def loss_fn(x, y):
    out = jnp.tanh(x @ states['w'].value + states['b'].value)
    loss = jnp.mean(jnp.sum((out - y) ** 2, axis=-1))
    return (loss, {'mean_out': out.mean(), 'abs_err': jnp.abs(out - y).mean()}) if has_aux else loss

  x, y = data(10, 3, seed=3), data(10, 2, seed=4)
  kwargs = dict(has_aux=has_aux, return_value=return_value)
  got = micro_batched_grad(loss_fn, states, num_micro_batch=4, **kwargs)(x, y)
  expected = brainstate.transform.grad(loss_fn, states, **kwargs)(x, y)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
  assert_trees_close(got, expected)


@pytest.mark.parametrize('batch, branches', [(8, 0), (10, 1)])
def test_one_scan_whatever_the_batch_size(batch, branches):
  states = param_states()
  grad_fn = micro_batched_grad(lambda x, y: pure_loss(values(states), x, y), states, num_micro_batch=4)
  jaxpr = jax.make_jaxpr(grad_fn)(data(batch, 3), data(batch, 2))
  assert (count_primitives(jaxpr, 'scan'), count_primitives(jaxpr, 'cond')) == (1, branches)


def test_low_precision_params_get_float32_sums_and_their_dtype():
  w = brainstate.ParamState(PARAMS['w'].astype(jnp.bfloat16))
  loss_fn = lambda x, y: jnp.mean((x @ w.value.astype(jnp.float32) - y) ** 2)
  x, y = data(10, 3, seed=3), data(10, 2, seed=4)
  grads = micro_batched_grad(loss_fn, {'w': w}, num_micro_batch=4)(x, y)
  assert grads['w'].dtype == jnp.bfloat16
  expected = jax.grad(lambda v: jnp.mean((x @ v - y) ** 2))(w.value.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(grads['w'], np.float32), expected, rtol=1e-2, atol=1e-2)


def test_micro_batches_draw_fresh_random_numbers():
  w = brainstate.ParamState(jnp.ones(()))

  def loss_fn(x):
    noise = brainstate.random.rand(x.shape[0])
    return jnp.mean(w.value * noise * x), {'square': jnp.mean(noise ** 2)}

  brainstate.random.seed(0)
  grads, aux = micro_batched_grad(loss_fn, {'w': w}, num_micro_batch=4, has_aux=True)(jnp.ones(4))
  # The gradient is the mean draw; equal draws would give mean(noise)**2 == mean(noise**2).
  assert float(aux['square']) - float(grads['w']) ** 2 > 1e-3


# ----------------------------------------------------------------------------- models with batched states


def brainpy_rnn(batch, seed=0):
  model = make_model('rnn', seed=seed)
  model.reset(batch)
  model.rnn.state.value = data(batch, 8, seed=9)  # each sample starts from its own state
  return model


def brainpy_loss(model):
  def loss_fn(x, y):
    for t in range(x.shape[1]):
      bp.share.save(t=t * bm.get_dt(), i=t, dt=bm.get_dt())  # what bp.BPTT gives the spiking neurons
      out = model(x[:, t])
    return jnp.mean((out - y) ** 2), {'mean_out': out.mean()}
  return loss_fn


def unnamed(out):
  """``(grads, ...)`` with the grads as a list: two brainpy models name the same parameters differently."""
  return (list(out[0].values()),) + tuple(out[1:])


def jax_jit_with_states(fn, states):
  """``jax.jit`` of ``fn`` that carries ``states`` in and out explicitly."""
  def pure(values, *args):
    for s, v in zip(states, values):
      s.value = v
    return fn(*args), [s.value for s in states]

  def call(*args):
    out, new = jax.jit(pure)([s.value for s in states], *args)
    for s, v in zip(states, new):
      s.value = v
    return out
  return call


JITS = {'eager': lambda f, model: f, 'bm.jit': lambda f, model: bm.jit(f),
        'brainstate.jit': lambda f, model: brainstate.transform.jit(f),
        'jax.jit': lambda f, model: jax_jit_with_states(f, list(model.vars().unique().values()))}


@pytest.mark.parametrize('jit, batch, n', [('bm.jit', 7, 3), ('brainstate.jit', 8, 2), ('jax.jit', 7, 7),
                                           ('eager', 7, 2)])
def test_brainpy_variables_match_whole_batch_grad_and_state(jit, batch, n):
  x, y = data(batch, 3, 3, seed=3), data(batch, 2, seed=4)
  model = brainpy_rnn(batch)
  params = model.train_vars().unique()
  expected = JITS[jit](brainstate.transform.grad(brainpy_loss(model), params, has_aux=True, return_value=True),
                       model)(x, y)
  expected_state = model.rnn.state.value
  model = brainpy_rnn(batch)
  grad_fn = micro_batched_grad(brainpy_loss(model), model.train_vars().unique(), num_micro_batch=n, has_aux=True,
                               return_value=True)
  assert_trees_close(unnamed(JITS[jit](grad_fn, model)(x, y)), unnamed(expected))
  assert_trees_close(model.rnn.state.value, expected_state)


def test_spiking_net_states_match_the_whole_batch():
  x, y = data(7, 3, 3, seed=3), data(7, 2, seed=4)
  runs = []
  for n in (1, 3):
    model = make_model('snn')
    model.reset(7)
    params = model.train_vars().unique()
    grads, _ = bm.jit(micro_batched_grad(brainpy_loss(model), params, num_micro_batch=n, has_aux=True))(x, y)
    # in the model's own order: the names (and so a sorted order) depend on how many models were built before
    runs.append(([grads[name] for name in params], state_values(model)[:-1]))
  assert_trees_close(runs[1], runs[0])


class GRUNet(brainstate.nn.Module):
  def __init__(self):
    super().__init__()
    self.cell = brainstate.nn.GRUCell(3, 5)
    self.out = brainstate.nn.Linear(5, 2)

  def update(self, x):
    return self.out(self.cell(x))


def brainstate_gru(batch, init_in_loss=False):
  brainstate.random.seed(0)
  model = GRUNet()
  brainstate.nn.init_all_states(model, batch)
  model.cell.h.value = data(batch, 5, seed=9)

  def loss_fn(x, y):  # x is (time, batch, features)
    if init_in_loss:
      brainstate.nn.init_all_states(model, x.shape[1])
    return jnp.mean((brainstate.transform.for_loop(model, x)[-1] - y) ** 2)
  return model, loss_fn


@pytest.mark.parametrize('batch, n', [(7, 3), (8, 2)])
def test_brainstate_hidden_states_match_whole_batch_grad_and_state(batch, n):
  x, y = data(3, batch, 3, seed=3), data(batch, 2, seed=4)
  model, loss_fn = brainstate_gru(batch)
  params = model.states(brainstate.ParamState)
  expected = brainstate.transform.jit(brainstate.transform.grad(loss_fn, params, return_value=True))(x, y)
  expected_state = model.cell.h.value
  model, loss_fn = brainstate_gru(batch)
  grad_fn = micro_batched_grad(loss_fn, model.states(brainstate.ParamState), num_micro_batch=n, return_value=True,
                               batch_axis=(1, 0))
  assert_trees_close(brainstate.transform.jit(grad_fn)(x, y), expected)
  assert_trees_close(model.cell.h.value, expected_state)


@pytest.mark.parametrize('jit', ['eager', 'brainstate.jit'])
def test_states_the_loss_creates_end_holding_the_whole_batch(jit):
  x, y = data(4, 7, 3, seed=3), data(7, 2, seed=4)
  model, loss_fn = brainstate_gru(7, init_in_loss=True)
  params = model.states(brainstate.ParamState)
  expected = brainstate.transform.grad(loss_fn, params)(x, y)
  brainstate.nn.init_all_states(model, 7)
  brainstate.transform.for_loop(model, x)
  expected_state = model.cell.h.value
  grad_fn = micro_batched_grad(loss_fn, params, num_micro_batch=3, batch_axis=(1, 0))
  if jit == 'eager':
    grads, state = grad_fn(x, y), model.cell.h.value
  else:  # a state created inside a traced function lives only there, so read it there
    grads, state = brainstate.transform.jit(lambda x, y: (grad_fn(x, y), model.cell.h.value))(x, y)
  assert_trees_close((grads, state), (expected, expected_state))


class Leaky(brainstate.nn.Module):
  """``h = h / 2 + tanh(x W)``: a hidden state of the given initial value, batch on axis 0 or (``transposed``) 1."""

  def __init__(self, h, transposed=False):
    super().__init__()
    self.w, self.h, self.transposed = brainstate.ParamState(data(3, 5, seed=1)), brainstate.HiddenState(h), transposed

  def loss(self, x):
    drive = jnp.tanh(x @ self.w.value)
    self.h.value = 0.5 * self.h.value + (drive.T if self.transposed else drive)
    return jnp.mean(self.h.value ** 2)


def leaky_runs(h, transposed=False, name_state=False):
  """``(grads, final h)`` of the whole batch, then micro-batched."""
  x, runs = data(7, 3, seed=3), []
  for micro in (False, True):
    model = Leaky(h, transposed)
    if micro:
      grad = micro_batched_grad(model.loss, {'w': model.w}, num_micro_batch=3,
                                states=[(model.h, 1)] if name_state else None)
    else:
      grad = brainstate.transform.grad(model.loss, {'w': model.w})
    runs.append((grad(x), model.h.value))
  return runs


@pytest.mark.parametrize('shape', [(1, 5), (5,)])
def test_a_state_without_the_batch_is_broadcast_as_the_whole_batch_does(shape):
  expected, got = leaky_runs(data(*shape, seed=2))
  assert got[1].shape == (7, 5)
  assert_trees_close(got, expected)


def test_states_argument_names_a_batch_on_another_axis():
  # (features, batch): the rule does not find it, states= does.
  expected, got = leaky_runs(data(5, 7, seed=2), transposed=True, name_state=True)
  assert_trees_close(got, expected)


# ----------------------------------------------------------------------------- errors


def pure_grad_fn(**kwargs):
  states = param_states()
  return micro_batched_grad(lambda x, y: pure_loss(values(states), x, y), states, **kwargs)


@pytest.mark.parametrize('kwargs, error, match', [
  (dict(num_micro_batch=2, micro_batch_size=3), ValueError, 'exactly one of num_micro_batch'),
  (dict(), ValueError, 'exactly one of num_micro_batch'),
  (dict(num_micro_batch=0), ValueError, 'num_micro_batch=0'),
  (dict(num_micro_batch=2.5), TypeError, 'num_micro_batch=2.5'),
  (dict(num_micro_batch=2, grad_reduction='avg'), ValueError, "grad_reduction='avg'"),
  (dict(num_micro_batch=2, grad_reduction='sum', loss_weight_fn=len), ValueError, "grad_reduction='sum'"),
  (dict(num_micro_batch=2, has_aux='yes'), TypeError, "has_aux='yes'"),
  (dict(num_micro_batch=2, states=[jnp.ones(3)]), TypeError, 'states='),
  (dict(num_micro_batch=2, loss_weight_fn='mask'), TypeError, "loss_weight_fn='mask'"),
])
def test_bad_options_raise_when_the_transform_is_made(kwargs, error, match):
  with pytest.raises(error, match=match):
    pure_grad_fn(**kwargs)


def test_grad_states_must_be_states():
  with pytest.raises(TypeError, match='grad_states'):
    micro_batched_grad(lambda x: x.sum(), {'w': jnp.ones(3)}, num_micro_batch=2)


@pytest.fixture(scope='module')
def shared_rnn():
  return brainpy_rnn(7)


@pytest.mark.parametrize('x_shape, y_shape, kwargs, match', [
  ((7, 4, 3), (6, 2), {}, 'same samples'),
  ((0, 4, 3), (0, 2), {}, 'empty batch'),
  ((7, 4, 3), (7, 2), dict(batch_axis=3), 'no batch_axis 3'),
  ((7, 4, 3), (7, 2), dict(batch_axis=(0, 0, 0)), '3 entries for 2 arguments'),
  ((5, 4, 3), (5, 2), dict(states='the rnn state'), r'model.reset\(5\)'),
  ((7, 4, 3), (7, 2), dict(loss=lambda out, y: (out - y) ** 2), 'scalar loss'),
])
def test_bad_calls_raise_and_change_nothing(x_shape, y_shape, kwargs, match, shared_rnn):
  model = shared_rnn  # shared: these calls must leave it unchanged
  before = state_values(model)
  loss = kwargs.pop('loss', lambda out, y: jnp.mean((out - y) ** 2))
  if 'states' in kwargs:
    kwargs['states'] = [model.rnn.state]

  def loss_fn(x, y):
    for t in range(x.shape[1]):
      out = model(x[:, t])
    return loss(out, y)

  grad_fn = micro_batched_grad(loss_fn, model.train_vars().unique(), num_micro_batch=2, **kwargs)
  with pytest.raises(ValueError, match=match):
    grad_fn(jnp.ones(x_shape), jnp.ones(y_shape))
  assert_trees_close(state_values(model), before)
