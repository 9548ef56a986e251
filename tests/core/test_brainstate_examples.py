"""The brainstate examples (``notebooks/brainstate.ipynb``, ``docs/without_trainer.md``) at small sizes.

Micro-batched training with ``micro_batched_grad`` and ``braintools.optim`` must end where whole-batch
``brainstate.transform.grad`` training ends, after several optimizer steps, for a ``brainstate.nn.GRUCell``
network and a ``brainpy.state.LIF`` spiking network on scikit-learn's digits; and a
``braintools.trainer.LightningModule`` whose training step uses the core must train as the whole batch does.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from packaging.version import Version

NEEDS = ('the brainstate examples need brainpy >= 2.9 (brainpy.state), brainstate >= 0.6 and braintools >= 0.4 '
         '(Python >= 3.12)')


def require(name, minversion):
  """The module ``name`` at ``minversion`` or later; else skip this file, saying what is missing."""
  module = pytest.importorskip(name, reason=f'{NEEDS}; {name} is not installed')
  if Version(module.__version__) < Version(minversion):
    pytest.skip(f'{NEEDS}; found {name} {module.__version__}', allow_module_level=True)
  return module


brainpy = require('brainpy', '2.9')
brainstate = require('brainstate', '0.6')
braintools = require('braintools', '0.4')
pytest.importorskip('sklearn', reason='the examples train on the digits that ship with scikit-learn')
import brainpy.state  # noqa: E402

from brainpy_accum import micro_batched_grad  # noqa: E402
from brainpy_accum.demo import load_digits_sequences  # noqa: E402
from helpers import assert_trees_close  # noqa: E402

BATCH, NUM_MICRO_BATCH, STEPS = 20, 3, 3  # 7 + 7 + 6 samples per batch
GUIDE = pathlib.Path(__file__).resolve().parents[2] / 'docs' / 'without_trainer.md'


@pytest.fixture(scope='module')
def digits():
  data = load_digits_sequences(seed=0)
  x, y = data.x_train[:BATCH * STEPS], data.y_train[:BATCH * STEPS]
  return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


class GRUNet(brainstate.nn.Module):
  def __init__(self, num_in=8, num_hidden=16, num_class=10):
    super().__init__()
    self.gru = brainstate.nn.GRUCell(num_in, num_hidden)
    self.readout = brainstate.nn.Linear(num_hidden, num_class)

  def update(self, x):
    return self.readout(self.gru(x))


class SpikingNet(brainstate.nn.Module):
  def __init__(self, num_in=8, num_hidden=32, num_class=10):
    super().__init__()
    self.inp = brainstate.nn.Linear(num_in, num_hidden, w_init=braintools.init.KaimingNormal(scale=20.))
    self.rec = brainstate.nn.Linear(num_hidden, num_hidden, w_init=braintools.init.KaimingNormal(), b_init=None)
    self.lif = brainpy.state.LIF(num_hidden, R=1., tau=2., V_th=1., V_reset=0., V_rest=0.,
                                 V_initializer=braintools.init.Constant(0.), spk_fun=braintools.surrogate.Arctan())
    self.readout = brainstate.nn.Linear(num_hidden, num_class)

  def update(self, x):
    return self.readout(self.lif(self.inp(x) + self.rec(self.lif.get_spike())))


def gru_logits(model, x):
  brainstate.nn.init_all_states(model, x.shape[0])
  return brainstate.transform.for_loop(model, jnp.transpose(x, (1, 0, 2)))[-1]


def spiking_logits(model, x):
  brainstate.nn.init_all_states(model, x.shape[0])
  x = jnp.repeat(x, 2, axis=1)  # each row held for 2 steps
  return brainstate.transform.for_loop(model, jnp.transpose(x, (1, 0, 2))).mean(axis=0)


NETWORKS = {'gru': (GRUNet, gru_logits), 'spiking': (SpikingNet, spiking_logits)}


def cross_entropy(logits, labels):
  return braintools.metric.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(name, batches, num_micro_batch):
  """Parameters and losses after one Adam step per batch, and the initial parameters.

  ``num_micro_batch=None``: whole-batch ``brainstate.transform.grad``.
  """
  net, logits_fn = NETWORKS[name]
  brainstate.random.seed(0)
  model = net()
  params = model.states(brainstate.ParamState)
  initial = {k: s.value for k, s in params.items()}
  optimizer = braintools.optim.Adam(lr=1e-2)
  optimizer.register_trainable_weights(params)
  loss_fn = lambda x, y: cross_entropy(logits_fn(model, x), y)
  if num_micro_batch is None:
    grad_fn = brainstate.transform.grad(loss_fn, params, return_value=True)
  else:
    grad_fn = micro_batched_grad(loss_fn, params, num_micro_batch=num_micro_batch, return_value=True)

  @brainstate.transform.jit
  def step(x, y):
    grads, loss = grad_fn(x, y)
    optimizer.update(grads)
    return loss

  losses = [step(x, y) for x, y in batches]
  return {k: s.value for k, s in params.items()}, losses, initial


@pytest.mark.parametrize('name', ['gru', 'spiking'])
def test_micro_batched_training_ends_where_whole_batch_training_ends(name, digits):
  with brainstate.environ.context(dt=1.0):
    whole = train(name, digits, None)
    micro = train(name, digits, NUM_MICRO_BATCH)
  assert_trees_close(micro, whole)
  moved = [not np.allclose(a, b, atol=1e-3) for a, b in zip(jax.tree.leaves(whole[0]), jax.tree.leaves(whole[2]))]
  assert all(moved), 'every parameter must have trained'


# ----------------------------------------------------------------------------- braintools.trainer


def with_gradient(value, grads, params):
  """A scalar equal to ``value`` whose gradient with respect to ``params`` is ``grads``."""
  value, grads = jax.lax.stop_gradient((value, grads))
  leaves = jax.tree.leaves({name: state.value for name, state in params.items()})
  return value + sum(jnp.vdot(g, p - jax.lax.stop_gradient(p)) for g, p in zip(jax.tree.leaves(grads), leaves))


class DigitsGRU(braintools.trainer.LightningModule):
  """``num_micro_batch=None``: the plain training step, whose loss the Trainer differentiates whole."""

  def __init__(self, num_micro_batch):
    super().__init__()
    self.net = GRUNet()
    self.num_micro_batch = num_micro_batch

  def loss(self, x, y):
    logits = gru_logits(self.net, x)
    return cross_entropy(logits, y), {'acc': jnp.mean(jnp.argmax(logits, axis=-1) == y)}

  def training_step(self, batch, batch_idx):
    if self.num_micro_batch is None:
      loss, metrics = self.loss(batch['x'], batch['y'])
    else:
      params = self.states(brainstate.ParamState)
      grads, loss, metrics = micro_batched_grad(self.loss, params, num_micro_batch=self.num_micro_batch,
                                                has_aux=True, return_value=True)(batch['x'], batch['y'])
      loss = with_gradient(loss, grads, params)
    self.log('acc', metrics['acc'])
    return {'loss': loss}

  def configure_optimizers(self):
    return braintools.optim.Adam(lr=1e-2)


def fit(num_micro_batch, batches):
  brainstate.random.seed(0)
  module = DigitsGRU(num_micro_batch)
  data = {'x': np.concatenate([x for x, _ in batches]), 'y': np.concatenate([y for _, y in batches])}
  trainer = braintools.trainer.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
                                       enable_checkpointing=False)
  trainer.fit(module, braintools.trainer.DataLoader(data, batch_size=BATCH))
  return module, trainer


def test_lightning_training_step_trains_as_the_whole_batch(digits):
  micro, micro_trainer = fit(NUM_MICRO_BATCH, digits)
  whole, whole_trainer = fit(None, digits)
  assert micro_trainer.global_step == whole_trainer.global_step == STEPS
  assert_trees_close(micro.state_dict(), whole.state_dict())
  for key in ('train_loss', 'train_acc'):
    np.testing.assert_allclose(micro_trainer.callback_metrics[key], whole_trainer.callback_metrics[key], rtol=1e-5)


def test_lightning_training_step_keeps_the_memory_of_a_micro_batch():
  """What the Trainer compiles (the gradient of ``training_step``) does not reach into the micro-batch loop."""
  x = jnp.asarray(np.random.RandomState(0).rand(8 * BATCH, 8, 8), jnp.float32)
  y = jnp.arange(8 * BATCH) % 10
  temp_bytes = {}
  for num_micro_batch in (None, 8):
    brainstate.random.seed(0)
    module = DigitsGRU(num_micro_batch)
    params = module.states(brainstate.ParamState)
    step = brainstate.transform.grad(lambda batch: module.training_step(batch, 0)['loss'], params)
    temp_bytes[num_micro_batch] = compiled_temp_bytes(step, {'x': x, 'y': y})
  core = micro_batched_grad(module.loss, params, num_micro_batch=8, has_aux=True)
  temp_bytes['core alone'] = compiled_temp_bytes(core, x, y)
  assert temp_bytes[8] <= 1.1 * temp_bytes['core alone'], temp_bytes
  assert temp_bytes[8] < temp_bytes[None] / 2, temp_bytes


def compiled_temp_bytes(fn, *args):
  """XLA's working memory of ``fn`` compiled for ``args``."""
  return brainstate.transform.jit(fn).compile(*args).memory_analysis().temp_size_in_bytes


# ----------------------------------------------------------------------------- the guide


def test_the_guide_code_runs():
  """The code blocks of ``docs/without_trainer.md`` from its first example on, one after another (they assert)."""
  text = GUIDE.read_text()
  blocks = re.findall(r'```python\n(.*?)```', text[text.index('## A train step'):], re.S)
  assert len(blocks) >= 4
  had_dt = 'dt' in brainstate.environ.all()
  namespace = {'__name__': 'without_trainer'}
  try:
    for block in blocks:
      exec(compile(block, str(GUIDE), 'exec'), namespace)
  finally:
    if not had_dt:
      brainstate.environ.pop('dt', None)  # the guide sets the time step globally
  assert np.isfinite(float(namespace['loss']))
