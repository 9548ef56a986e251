"""Training examples of BrainPy's gallery (github.com/brainpy/examples), ported for ``test_gallery.py``.

Each section names the original file. Model classes, loss functions (regularisers included) and
trainer settings are kept as written; what changed is listed in the section's comment. Common
changes everywhere:

* sizes (neurons, time steps, batch, batches per epoch, epochs) are shrunk so that one example
  trains in a few seconds on a 2-core CPU, and batch sizes are not multiples of 3, so that
  ``num_micro_batch=3`` cuts every batch unevenly;
* data are made here with a fixed NumPy seed (the originals download MNIST-like datasets or draw
  from BrainPy's global random key) and made once, before training, so that ``bp.BPTT`` and
  ``AccumBPTT`` see the very same batches;
* the original module-level ``bm.set_environment(...)`` becomes :attr:`Example.env`, entered
  around construction and training only (a global setting would leak into the other tests);
* examples that were written with a hand-made ``bm.grad`` loop are driven by ``bp.BPTT`` here
  (the object under test is a drop-in replacement for it): the loss function is the original
  loss method's body applied to the ``predicts`` that ``bp.BPTT`` hands over.
"""

import contextlib
import dataclasses
import math
from enum import Enum
from typing import Any, Callable, Dict, List, Optional

import brainpy as bp
import brainpy.math as bm
import numpy as np
from jax.lax import stop_gradient

__all__ = ['Example', 'EpochData', 'EXAMPLES']


class EpochData:
  """``train_data`` given as a function (as the gallery does): the k-th call returns epoch k's batches.

  The batches of every epoch are made up front from a fixed seed, so every trainer that calls this
  once per epoch sees the same data.
  """

  def __init__(self, epochs: List[list]):
    self.epochs = epochs
    self.calls = 0

  def __call__(self):
    batches = self.epochs[self.calls % len(self.epochs)]
    self.calls += 1
    return iter(batches)  # a generator-like iterable without __len__, as the gallery's generators


@contextlib.contextmanager
def numpy_global_seed(seed):
  """Seed NumPy's global generator (which the gallery's task generators draw from), then restore it."""
  state = np.random.get_state()
  np.random.seed(seed)
  try:
    yield
  finally:
    np.random.set_state(state)


@dataclasses.dataclass
class Example:
  """One ported example: how to build it, its loss, optimizer, data and trainer settings."""
  name: str
  original: str                                   # path in github.com/brainpy/examples
  build: Callable[[], bp.DynamicalSystem]         # called inside ``env`` after ``bm.random.seed(seed)``
  loss: Callable[[bp.DynamicalSystem], Callable]  # model -> loss_fun (some losses read the model)
  optimizer: Callable[[], bp.optim.Optimizer]
  train_data: Callable[[], Any]                   # a fresh ``train_data`` argument of ``fit``
  test_data: Optional[Callable[[], Any]] = None
  trainer_kwargs: Callable[[bp.DynamicalSystem], Dict] = lambda model: {}
  fit_kwargs: Dict = dataclasses.field(default_factory=dict)
  after_report: Optional[Callable[[bp.DynamicalSystem], Callable]] = None  # model -> fun_after_report
  env: Dict = dataclasses.field(default_factory=lambda: {'mode': bm.training_mode})
  seed: int = 0


# =====================================================================================================
# 1. Integrator RNN.  Original: recurrent_networks/integrator_rnn.ipynb
#    Changed: num_batch 128 -> 10, hidden 100 -> 16, 100 batches per epoch -> 3, num_epoch 30 -> 3,
#    num_report 200 -> 2 (as in the original, a report window straddles the epoch end: there 100
#    batches per epoch and num_report=200); data from a NumPy RandomState instead of the jitted
#    bm.random generator (same formulas); bp.layers.RNNCell -> bp.dyn.RNNCell (renamed in
#    BrainPy 2.4+); the global ``model`` read by the loss becomes the trained model (closure);
#    a test set (absent in the original) so that ``test_losses`` are compared too.
# =====================================================================================================

integrator_dt = 0.04
integrator_num_step = int(1.0 / integrator_dt)
integrator_num_batch = 10


def build_inputs_and_targets(rng, mean=0.025, scale=0.01, batch_size=10):
  # Create the white noise input
  sample = rng.normal(size=(batch_size, 1, 1))
  bias = mean * 2.0 * (sample - 0.5)
  samples = rng.normal(size=(batch_size, integrator_num_step, 1))
  noise_t = scale / integrator_dt ** 0.5 * samples
  inputs = bias + noise_t
  targets = np.cumsum(inputs, axis=1)
  return inputs.astype(np.float32), targets.astype(np.float32)


# Ported from brainpy/examples: recurrent_networks/integrator_rnn.ipynb
class IntegratorRNN(bp.DynamicalSystem):  # ``RNN`` in the original
  def __init__(self, num_in, num_hidden):
    super(IntegratorRNN, self).__init__()
    self.rnn = bp.dyn.RNNCell(num_in, num_hidden, train_state=True)
    self.out = bp.layers.Dense(num_hidden, 1)

  def update(self, x):
    return self.out(self.rnn(x))


def integrator_loss(model):
  # define loss function
  def loss(predictions, targets, l2_reg=2e-4):
    mse = bp.losses.mean_squared_error(predictions, targets)
    l2 = l2_reg * bp.losses.l2_norm(model.train_vars().unique().dict()) ** 2
    return mse + l2

  return loss


def integrator_optimizer():
  # define optimizer
  lr = bp.optim.ExponentialDecay(lr=0.025, decay_steps=1, decay_rate=0.99975)
  return bp.optim.Adam(lr=lr, eps=1e-1)


def integrator_epochs(num_epoch, num_batches, batch_size, seed):
  rng = np.random.RandomState(seed)
  return [[build_inputs_and_targets(rng, batch_size=batch_size) for _ in range(num_batches)]
          for _ in range(num_epoch)]


INTEGRATOR = Example(
  name='integrator_rnn',
  original='recurrent_networks/integrator_rnn.ipynb',
  build=lambda: IntegratorRNN(1, 16),
  loss=integrator_loss,
  optimizer=integrator_optimizer,
  train_data=lambda: EpochData(integrator_epochs(3, 3, integrator_num_batch, seed=0)),
  test_data=lambda: EpochData(integrator_epochs(1, 3, 5, seed=1)),
  fit_kwargs=dict(num_epoch=3, num_report=2),
)


# =====================================================================================================
# 2. E-prop evidence accumulation (spiking, adaptive LIF), BPTT variant (eprop=False as trained
#    there).  Original: recurrent_networks/Bellec_2020_eprop_evidence_accumulation.ipynb
#    Its firing-rate regulariser  sum_n (mean over batch and time of spikes - f0)^2  couples the
#    samples of a batch.
#    Changed: n_batch 128 -> 7, num_in 40 -> 8, num_rec 100 -> 10, t_cue_spacing (t_interval)
#    150 -> 6, t_cue 100 -> 4, recall_duration 150 -> 6, seq_len t_interval * 7 + 1200 ->
#    t_interval * 7 + 12, 10 batches per epoch -> 4 (``num_batches`` of get_data), num_epoch 40 -> 2,
#    num_report 10 -> 2 (there it equals the batches per epoch; here it divides them, so no report
#    window straddles an epoch end and this port depends on ``whole_batch_loss`` alone);
#    generate_click_task_data runs as plain Python (``bp.tools.numba_jit`` falls back to it without
#    numba) from a seeded np.random.
# =====================================================================================================

# training parameters
n_batch = 7  # batch size

# neuron model and simulation parameters
reg_f = 1.  # regularization coefficient for firing rate
reg_rate = 10  # target firing rate for regularization [Hz]

# Experiment parameters
t_cue_spacing = 6  # distance between two consecutive cues in ms

# Frequencies
input_f0 = 40. / 1000.  # poisson firing rate of input neurons in khz
regularization_f0 = reg_rate / 1000.  # mean target network firing frequency


# Ported from brainpy/examples: recurrent_networks/Bellec_2020_eprop_evidence_accumulation.ipynb
class EligSNN(bp.DynSysGroup):
  def __init__(self, num_in, num_rec, num_out, eprop=True, tau_a=2e3, tau_v=2e1):
    super(EligSNN, self).__init__()

    # parameters
    self.num_in = num_in
    self.num_rec = num_rec
    self.num_out = num_out
    self.eprop = eprop

    # neurons
    self.o = bp.dyn.Leaky(num_out, tau=20)

    n_regular = int(num_rec / 2)
    n_adaptive = num_rec - n_regular
    beta1 = bm.exp(- bm.get_dt() / tau_a)
    beta2 = 1.7 * (1 - beta1) / (1 - bm.exp(-1 / tau_v))
    beta = bm.concatenate([bm.ones(n_regular), bm.ones(n_adaptive) * beta2])
    self.r = bp.neurons.ALIFBellec2020(
      num_rec,
      V_rest=0.,
      tau_ref=5.,
      V_th=0.6,
      tau_a=tau_a,
      tau=tau_v,
      beta=beta,
      V_initializer=bp.init.ZeroInit(),
      a_initializer=bp.init.ZeroInit(),
      eprop=eprop,
      input_var=False,
    )

    # synapses
    self.i2r = bp.layers.Dense(num_in, num_rec,
                               W_initializer=bp.init.KaimingNormal(),
                               b_initializer=None)
    self.i2r.W *= tau_v
    self.r2r = bp.layers.Dense(num_rec, num_rec,
                               W_initializer=bp.init.KaimingNormal(),
                               b_initializer=None)
    self.r2r.W *= tau_v
    self.r2o = bp.layers.Dense(num_rec, num_out,
                               W_initializer=bp.init.KaimingNormal(),
                               b_initializer=None)

  def update(self, x):
    z = stop_gradient(self.r.spike.value) if self.eprop else self.r.spike.value
    return self.o(self.r2o(self.r(self.r2r(z) + self.i2r(x))))


@bp.tools.numba_jit
def generate_click_task_data(batch_size, seq_len, n_neuron, recall_duration, prob, f0=0.5,
                             n_cues=7, t_cue=100, t_interval=150, n_input_symbols=4):
  n_channel = n_neuron // n_input_symbols

  # assign input spike probabilities
  probs = np.where(np.random.random((batch_size, 1)) < 0.5, prob, 1 - prob)

  # for each example in batch, draw which cues are going to be active (left or right)
  cue_assignments = np.asarray(np.random.random(n_cues) > probs, dtype=np.int_)

  # generate input nums - 0: left, 1: right, 2:recall, 3:background noise
  input_nums = 3 * np.ones((batch_size, seq_len), dtype=np.int_)
  input_nums[:, :n_cues] = cue_assignments
  input_nums[:, -1] = 2

  # generate input spikes
  input_spike_prob = np.zeros((batch_size, seq_len, n_neuron))
  d_silence = t_interval - t_cue
  for b in range(batch_size):
    for k in range(n_cues):
      # input channels only fire when they are selected (left or right)
      c = cue_assignments[b, k]
      # reverse order of cues
      i_seq = d_silence + k * t_interval
      i_neu = c * n_channel
      input_spike_prob[b, i_seq:i_seq + t_cue, i_neu:i_neu + n_channel] = f0
  # recall cue
  input_spike_prob[:, -recall_duration:, 2 * n_channel:3 * n_channel] = f0
  # background noise
  input_spike_prob[:, :, 3 * n_channel:] = f0 / 4.
  input_spikes = input_spike_prob > np.random.rand(*input_spike_prob.shape)

  # generate targets
  target_mask = np.zeros((batch_size, seq_len), dtype=np.bool_)
  target_mask[:, -1] = True
  target_nums = (np.sum(cue_assignments, axis=1) > n_cues / 2).astype(np.int_)
  return input_spikes, input_nums, target_nums, target_mask


def get_data(batch_size, n_in, t_interval, f0, num_batches=4):
  # used for obtaining a new randomly generated batch of examples
  def generate_data():
    seq_len = int(t_interval * 7 + 12)
    for _ in range(num_batches):
      spk_data, _, target_data, _ = generate_click_task_data(
        batch_size=batch_size, seq_len=seq_len, n_neuron=n_in, recall_duration=6,
        prob=0.3, t_cue=4, n_cues=7, t_interval=t_interval, f0=f0, n_input_symbols=4
      )
      yield spk_data, target_data

  return generate_data


def eprop_loss(model):
  def loss_fun(predicts, targets):
    predicts, mon = predicts

    # we only use network output at the end for classification
    output_logits = predicts[:, -t_cue_spacing:]

    # Define the accuracy
    y_predict = bm.argmax(bm.mean(output_logits, axis=1), axis=1)
    accuracy = bm.equal(targets, y_predict).astype(bm.dftype()).mean()

    # loss function
    tiled_targets = bm.tile(bm.expand_dims(targets, 1), (1, t_cue_spacing))
    loss_cls = bm.mean(bp.losses.cross_entropy_loss(output_logits, tiled_targets))

    # Firing rate regularization:
    # For historical reason we often use this regularization,
    # but the other one is easier to implement in an "online" fashion by a single agent.
    av = bm.mean(mon['r.spike'], axis=(0, 1)) / bm.get_dt()
    loss_reg_f = bm.sum(bm.square(av - regularization_f0) * reg_f)

    # Aggregate the losses #
    loss = loss_reg_f + loss_cls
    loss_res = {'loss': loss, 'loss reg': loss_reg_f, 'accuracy': accuracy}
    return bm.as_jax(loss), loss_res

  return loss_fun


def eprop_loss_without_regulariser(model):
  """The same classification loss without the coupling regulariser: a plain mean over samples."""
  def loss_fun(predicts, targets):
    predicts, mon = predicts
    output_logits = predicts[:, -t_cue_spacing:]
    y_predict = bm.argmax(bm.mean(output_logits, axis=1), axis=1)
    accuracy = bm.equal(targets, y_predict).astype(bm.dftype()).mean()
    tiled_targets = bm.tile(bm.expand_dims(targets, 1), (1, t_cue_spacing))
    loss_cls = bm.mean(bp.losses.cross_entropy_loss(output_logits, tiled_targets))
    return bm.as_jax(loss_cls), {'accuracy': accuracy}

  return loss_fun


def eprop_epochs(num_epoch, seed):
  with numpy_global_seed(seed):  # generate_click_task_data draws from NumPy's global generator
    return [list(get_data(n_batch, n_in=8, t_interval=t_cue_spacing, f0=input_f0)()) for _ in range(num_epoch)]


EPROP = Example(
  name='eprop_evidence_accumulation',
  original='recurrent_networks/Bellec_2020_eprop_evidence_accumulation.ipynb',
  build=lambda: EligSNN(num_in=8, num_rec=10, num_out=2, eprop=False),
  loss=eprop_loss,
  optimizer=lambda: bp.optim.Adam(lr=0.01),
  train_data=lambda: EpochData(eprop_epochs(2, seed=0)),
  trainer_kwargs=lambda net: dict(loss_has_aux=True, monitors={'r.spike': net.r.spike}),
  fit_kwargs=dict(num_epoch=2, num_report=2),
  env={'mode': bm.training_mode, 'dt': 1.},
)


# =====================================================================================================
# 3. Surrogate-gradient LIF network with spike-count regularisers (SpyTorch tutorials 2 & 3).
#    Original: brain_inspired_computing/SurrogateGrad_lif_fashion_mnist.py
#    Its regularisers  1e-5 * sum(spikes)  (a sum over the batch) and
#    1e-5 * mean over neurons of (sum over batch and time of spikes)^2  couple the batch's samples.
#    Changed: Fashion-MNIST (60,000 downloaded images) -> 40 random 28 x 28 "images" (90% of the
#    pixels lit at 0.5-1, so that the untrained network spikes: with sparser images it hardly
#    spikes before training, and the regularisers would be 0), 10 random labels; batch_size
#    256 -> 8 (5 batches per epoch), nb_epochs 30 -> 2; network sizes (784 -> 100 -> 10) and
#    nb_steps=100 as written; the global ``net`` in the trainer's monitors becomes the trained
#    model; the shuffling of sparse_data_generator draws from a seeded np.random.
# =====================================================================================================

# Ported from brainpy/examples: brain_inspired_computing/SurrogateGrad_lif_fashion_mnist.py
class SNN(bp.DynamicalSystem):
  """
  This class implements a spiking neural network model with three layers:

     i >> r >> o

  Each two layers are connected through the exponential synapse model.
  """

  def __init__(self, num_in, num_rec, num_out):
    super(SNN, self).__init__()

    # parameters
    self.num_in = num_in
    self.num_rec = num_rec
    self.num_out = num_out

    # synapse: i->r
    self.i2r = bp.Sequential(
      bp.dnn.Linear(num_in, num_rec, W_initializer=bp.init.KaimingNormal(scale=2.)),
      bp.dyn.Expon(num_rec, tau=10.)
    )
    # recurrent: r
    self.r = bp.dyn.Lif(num_rec, tau=10, V_reset=0, V_rest=0, V_th=1.)
    # synapse: r->o
    self.r2o = bp.Sequential(
      bp.dnn.Linear(num_rec, num_out, W_initializer=bp.init.KaimingNormal(scale=2.)),
      bp.dyn.Expon(num_out, tau=10.)
    )
    # output: o
    self.o = bp.dyn.Leaky(num_out, tau=5)

  def update(self, spike):
    return spike >> self.i2r >> self.r >> self.r2o >> self.o


def current2firing_time(x, tau=20., thr=0.2, epsilon=1e-7):
  """Computes first firing time latency for a current input x
  assuming the charge time of a current based LIF neuron.
  """
  x = np.clip(x, thr + epsilon, 1e9)
  T = tau * np.log(x / (x - thr))
  return T


def sparse_data_generator(X, y, batch_size, nb_steps, nb_units, shuffle=True):
  """ This generator takes datasets in analog format and
  generates spiking network input as sparse tensors.

  Args:
  X: The data ( sample x event x 2 ) the last dim holds (time,neuron) tuples
  y: The labels
  """

  labels_ = np.array(y, dtype=bm.int_)
  sample_index = np.arange(len(X))

  # compute discrete firing times
  tau_eff = 2. / bm.get_dt()
  unit_numbers = np.arange(nb_units)
  firing_times = np.array(current2firing_time(X, tau=tau_eff), dtype=bm.int_)

  if shuffle:
    np.random.shuffle(sample_index)

  counter = 0
  number_of_batches = len(X) // batch_size
  while counter < number_of_batches:
    batch_index = sample_index[batch_size * counter:batch_size * (counter + 1)]
    all_batch, all_times, all_units = [], [], []
    for bc, idx in enumerate(batch_index):
      c = firing_times[idx] < nb_steps
      times, units = firing_times[idx][c], unit_numbers[c]
      batch = bc * np.ones(len(times), dtype=bm.int_)
      all_batch.append(batch)
      all_times.append(times)
      all_units.append(units)
    all_batch = np.concatenate(all_batch).flatten()
    all_times = np.concatenate(all_times).flatten()
    all_units = np.concatenate(all_units).flatten()
    x_batch = bm.zeros((batch_size, nb_steps, nb_units))
    x_batch[all_batch, all_times, all_units] = 1.
    y_batch = bm.asarray(labels_[batch_index])
    yield x_batch, y_batch
    counter += 1


def fashion_loss(model):
  # ``loss_fun`` of ``train(...)`` in the original, verbatim
  def loss_fun(predicts, targets):
    predicts, mon = predicts
    # Here we set up our regularizer loss
    # The strength paramters here are merely a guess and
    # there should be ample room for improvement by
    # tuning these paramters.
    l1_loss = 1e-5 * bm.sum(mon['r.spike'])  # L1 loss on total number of spikes
    l2_loss = 1e-5 * bm.mean(bm.sum(bm.sum(mon['r.spike'], axis=0), axis=0) ** 2)  # L2 loss on spikes per neuron
    # predictions
    predicts = bm.max(predicts, axis=1)
    loss = bp.losses.cross_entropy_loss(predicts, targets)
    return loss + l2_loss + l1_loss

  return loss_fun


FASHION_NUM_IN, FASHION_STEPS, FASHION_BATCH = 28 * 28, 100, 8
FASHION_ENV = {'mode': bm.training_mode, 'dt': 0.1}  # bm.set_environment(bm.training_mode): BrainPy's default dt


def fashion_epochs(num_epoch, seed):
  rng = np.random.RandomState(seed)
  # stands for the standardised pixels (x / 255) of 40 images
  x_train = np.where(rng.rand(40, FASHION_NUM_IN) < 0.9, rng.uniform(0.5, 1., size=(40, FASHION_NUM_IN)), 0.)
  y_train = rng.randint(0, 10, size=40)
  # sparse_data_generator shuffles with NumPy's global generator and reads dt
  with numpy_global_seed(seed), bm.environment(**FASHION_ENV):
    return [list(sparse_data_generator(x_train, y_train, FASHION_BATCH, FASHION_STEPS, FASHION_NUM_IN))
            for _ in range(num_epoch)]


FASHION = Example(
  name='surrogate_grad_lif_fashion_mnist',
  original='brain_inspired_computing/SurrogateGrad_lif_fashion_mnist.py',
  build=lambda: SNN(num_in=FASHION_NUM_IN, num_rec=100, num_out=10),
  loss=fashion_loss,
  optimizer=lambda: bp.optim.Adam(lr=1e-3),
  train_data=lambda: EpochData(fashion_epochs(2, seed=0)),
  trainer_kwargs=lambda net: dict(monitors={'r.spike': net.r.spike}),
  fit_kwargs=dict(num_epoch=2),
  env=FASHION_ENV,
)


# =====================================================================================================
# 4. Short-term-plasticity RNN on delayed match-to-sample.  Original:
#    recurrent_networks/Masse_2019_STP_RNN.ipynb (the task: recurrent_networks/Masse_2019_STP_RNN_tasks.py)
#    Its states are plain ``bm.Variable(bm.ones((batch_size, n)))`` without ``batch_axis``.
#    Changed: batch_size 1024 -> 8, num_hidden 100 -> 20; the noise (noise_rnn) is set to 0 after
#    construction: bm.random draws of a micro-batch differ from the whole batch's, so noise could
#    only match in distribution; the hand-written loop (``trial``) becomes bp.BPTT with the same
#    Adam(2e-2): ``predict`` is replaced by bp.BPTT's time loop with monitors on ``y`` and ``h``
#    (its ``out_vars``), ``loss_func`` by ``masse_loss`` (same terms, returned as auxiliary
#    metrics instead of written into Variables); ``predict``'s ``self.h[:] = self.init_h`` moves
#    into ``reset_state`` (bp.BPTT resets outside the gradient, so init_h gets no gradient under
#    either trainer); the per-gradient clip_by_norm(0.1) and gradient masks of ``train_op`` are
#    dropped (bp.BPTT has no hook for them); 2000 iterations -> 2 epochs of 3 batches;
#    ``u = bm.ones(...) * 0.3`` is wrapped in bm.asarray (a bm.Array times a float is a plain, immutable
#    JAX array in current BrainPy, and ``u[:, 0] = 0.15`` follows); ``initialize`` draws its gamma
#    weights from a seeded NumPy generator instead of bm.random (JAX's gamma sampler compiles for
#    about 3.5 s per weight shape on this CPU, five shapes: most of a test's budget).
# =====================================================================================================

# Time parameters
dt = 100  # ms
dt_sec = dt / 1000
time_constant = 100  # ms
alpha = dt / time_constant

# Loss parameters
spike_regularization = 'L2'  # 'L1' or 'L2'
spike_cost = 2e-2
weight_cost = 0.
clip_max_grad_val = 0.1  # not applied (see above)

# Training specs
batch_size = 8
learning_rate = 2e-2


# Ported from brainpy/examples: recurrent_networks/Masse_2019_STP_RNN_tasks.py
class Task(object):
  """The DMS path of ``Task`` in Masse_2019_STP_RNN_tasks.py (other trial types and plotting left out)."""

  def __init__(self, trial_type='DMS', dt=100, tau=100, batch_size=1024):
    assert trial_type == 'DMS'
    self.dt = dt
    self.dt_sec = dt / 1000
    self.tau = tau
    self.alpha = dt / tau
    self.trial_type = trial_type
    self.batch_size = batch_size

    # input noise
    self.input_mean = 0.0
    self.noise_in = np.sqrt(2 * self.alpha) * 0.1

    # times
    self.dead_time = 0
    self.fix_time = 500
    self.sample_time = 500
    self.delay_time = 1000
    self.test_time = 500
    self.variable_delay_max = 300
    self.mask_duration = 50  # duration of training mask after test onset
    self.rule_onset_time = [self.delay_time]
    self.rule_offset_time = [self.delay_time]

    # rules
    self.catch_trial_pct = 0.0
    self.num_rules = 1
    self.test_cost_multiplier = 1.
    self.rule_cue_multiplier = 1.
    self.num_receptive_fields = 1

    # input shape
    self.num_motion_tuned = 24
    self.num_fix_tuned = 0
    self.num_rule_tuned = 0
    self.num_input = self.num_motion_tuned + self.num_fix_tuned + self.num_rule_tuned

    # output shape
    self.num_output = 3
    self.rotation_match = [0]

    self.trial_length = self.dead_time + self.fix_time + self.sample_time + self.delay_time + self.test_time
    self.num_steps = self.trial_length // dt
    self.sample_time_rng = range((self.dead_time + self.fix_time) // dt,
                                 (self.dead_time + self.fix_time + self.sample_time) // dt)

    # Tuning function data
    self.num_motion_dirs = 8
    self.tuning_height = 4  # magnitude scaling factor for von Mises
    self.kappa = 2  # concentration scaling factor for von Mises
    self.motion_tuning = self._create_motion_tuning()

  def generate_trial(self):
    trial_info = self._generate_basic_trial()
    # input activity needs to be non-negative
    trial_info['neural_input'] = np.maximum(0., trial_info['neural_input'])
    return trial_info

  def _generate_basic_trial(self):
    mask_duration = self.mask_duration // self.dt
    data = {
      'desired_output': np.zeros((self.num_steps, self.batch_size, self.num_output), dtype=np.float32),
      'train_mask': np.ones((self.num_steps, self.batch_size), dtype=np.float32),
      'neural_input': np.random.normal(self.input_mean, self.noise_in,
                                       size=(self.num_steps, self.batch_size, self.num_input))
    }
    data['train_mask'][:int(self.dead_time // self.dt), :] = 0.
    for batch_i in range(self.batch_size):
      sample_dir = np.random.randint(self.num_motion_dirs)
      rule = np.random.randint(self.num_rules)
      match = np.random.randint(2)
      match_rotation = int(self.num_motion_dirs * self.rotation_match[rule] / 360)
      test_onset = (self.dead_time + self.fix_time + self.sample_time + self.delay_time) // self.dt
      test_time_rng = range(test_onset, self.num_steps)
      fix_time_rng = range(test_onset)
      data['train_mask'][test_onset:test_onset + mask_duration, batch_i] = 0.
      matching_dir = (sample_dir + match_rotation) % self.num_motion_dirs
      if match == 1:  # match trial
        test_dir = matching_dir
      else:
        possible_dirs = np.setdiff1d(list(range(self.num_motion_dirs)), matching_dir)
        test_dir = possible_dirs[np.random.randint(len(possible_dirs))]
      data['neural_input'][self.sample_time_rng, batch_i, :] += np.reshape(self.motion_tuning[:, 0, sample_dir], (1, -1))
      data['neural_input'][test_time_rng, batch_i, :] += np.reshape(self.motion_tuning[:, 0, test_dir], (1, -1))
      data['desired_output'][fix_time_rng, batch_i, 0] = 1.
      data['train_mask'][test_time_rng, batch_i] *= self.test_cost_multiplier
      if match == 0:
        data['desired_output'][test_time_rng, batch_i, 1] = 1.
      else:
        data['desired_output'][test_time_rng, batch_i, 2] = 1.
    return data

  def _create_motion_tuning(self):
    motion_tuning = np.zeros((self.num_input, self.num_receptive_fields, self.num_motion_dirs))
    num_per_field = self.num_motion_tuned // self.num_receptive_fields
    pref_dirs = np.arange(0, 360, 360 / num_per_field)
    stim_dirs = np.arange(0, 360, 360 / self.num_motion_dirs)
    for n in range(num_per_field):
      for i in range(self.num_motion_dirs):
        d = np.cos((stim_dirs[i] - pref_dirs[n]) / 180 * np.pi)
        d = self.tuning_height * np.exp(self.kappa * d) / np.exp(self.kappa)
        for r in range(self.num_receptive_fields):
          motion_tuning[n + r * num_per_field, r, i] = d
    return motion_tuning


masse_init_rng = np.random.RandomState(0)  # reseeded by build_masse_model


def initialize(shape, prob, size):
  w = masse_init_rng.gamma(shape, size=size)  # port: bm.random.gamma / bm.random.random -> NumPy (see above)
  w *= (masse_init_rng.random_sample(size) < prob)
  return bm.asarray(w, dtype=bm.float32)


# Ported from brainpy/examples: recurrent_networks/Masse_2019_STP_RNN.ipynb
class Model(bp.DynamicalSystem):
  def __init__(self, task, num_hidden=100, name=None):
    super(Model, self).__init__(name=name)

    assert isinstance(task, Task)
    self.task = task

    # Network configuration
    self.exc_inh_prop = 0.8  # excitatory/inhibitory ratio
    self.conn_prob = 0.2

    # Network shape
    self.num_output = task.num_output
    self.num_hidden = num_hidden
    self.num_input = task.num_input

    # EI
    self.num_exc = int(self.num_hidden * self.exc_inh_prop)
    self.num_inh = self.num_hidden - self.num_exc
    self.EI_list = bm.ones(self.num_hidden)
    self.EI_list[self.num_exc:] = -1.
    self.EI_matrix = bm.diag(self.EI_list)
    self.inh_index = bm.arange(self.num_exc, self.num_hidden)

    # Input and noise
    self.noise_rnn = math.sqrt(2 * alpha) * 0.5

    # Synaptic plasticity specs
    self.tau_fast = 200  # ms
    self.tau_slow = 1500  # ms
    self.U_stf = 0.15
    self.U_std = 0.45

    # Initial hidden values
    self.init_h = bm.TrainVar(bm.ones((batch_size, self.num_hidden)) * 0.1)
    self.h = bm.Variable(bm.ones((batch_size, self.num_hidden)) * 0.1)

    # Input/recurrent/output weights
    #   1. w_ir (input => recurrent)
    prob = self.conn_prob * task.num_receptive_fields
    self.w_ir = bm.TrainVar(initialize(0.2, prob, (self.num_input, self.num_hidden)))
    self.w_ir_mask = bm.ones((self.num_input, self.num_hidden))
    if task.trial_type == 'location_DMS':
      self.w_ir_mask *= 0.
      target_ind = [range(0, self.num_hidden, 3), range(1, self.num_hidden, 3), range(2, self.num_hidden, 3)]
      for n in range(self.num_input):
        u = int(n // (self.num_input / 3))
        self.w_ir_mask[n, target_ind[u]] = 1.
      self.w_ir *= self.w_ir_mask  # only preserve
    #   2. w_rr (recurrent => recurrent)
    self.w_rr = bm.TrainVar(initialize(0.1, self.conn_prob, (self.num_hidden, self.num_hidden)))
    self.w_rr[:, self.num_exc:] = initialize(0.2, self.conn_prob, (self.num_hidden, self.num_inh))
    self.w_rr[self.num_exc:, :] = initialize(0.2, self.conn_prob, (self.num_inh, self.num_hidden))
    self.w_rr_mask = bm.ones((self.num_hidden, self.num_hidden)) - bm.eye(self.num_hidden)
    self.w_rr *= self.w_rr_mask  # remove self-connections
    self.b_rr = bm.TrainVar(bm.zeros((1, self.num_hidden)))
    #   3. w_ro (input => recurrent)
    self.w_ro = bm.TrainVar(initialize(0.1, self.conn_prob, (self.num_hidden, self.num_output)))
    self.w_ro_mask = bm.ones((self.num_hidden, self.num_output))
    self.w_ro_mask[self.num_exc:, :] = 0.
    self.w_ro *= self.w_ro_mask  # remove inhibitory-to-output connections
    #   4. b_ro (bias)
    self.b_ro = bm.TrainVar(bm.zeros((1, self.num_output)))

    # Synaptic variables
    #   - The first row (first half neurons) are facilitating synapses
    #   - The second row (last half neurons) are depressing synapses
    alpha_stf = bm.ones((2, int(self.num_hidden / 2)))
    alpha_stf[0] = dt / self.tau_slow
    alpha_stf[1] = dt / self.tau_fast
    alpha_std = bm.ones((2, int(self.num_hidden / 2)))
    alpha_std[0] = dt / self.tau_fast
    alpha_std[1] = dt / self.tau_slow
    U = bm.ones((2, int(self.num_hidden / 2)))
    U[0] = 0.15
    U[1] = 0.45
    u = bm.asarray(bm.ones((batch_size, 2, int(self.num_hidden / 2))) * 0.3)  # port: see above
    u[:, 0] = 0.15
    u[:, 1] = 0.45
    #   - final
    self.alpha_stf = alpha_stf.reshape((1, -1))
    self.alpha_std = alpha_std.reshape((1, -1))
    self.U = U.reshape((1, -1))
    self.u = bm.Variable(u.reshape((batch_size, -1)))
    self.x = bm.Variable(bm.ones((batch_size, self.num_hidden)))
    self.y = bm.Variable(bm.ones((batch_size, self.num_output)))
    self.y_hist = bm.Variable(bm.zeros((task.num_steps, batch_size, task.num_output)))

    # Loss
    self.loss = bm.Variable(bm.zeros(1))
    self.perf_loss = bm.Variable(bm.zeros(1))
    self.spike_loss = bm.Variable(bm.zeros(1))
    self.weight_loss = bm.Variable(bm.zeros(1))

  def reset_state(self, batch_size):
    u = bm.asarray(bm.ones((batch_size, 2, int(self.num_hidden / 2))) * 0.3)  # port: see above
    u[:, 0] = 0.15
    u[:, 1] = 0.45
    self.u.value = u.reshape((batch_size, -1))
    self.x.value = bm.ones((batch_size, self.num_hidden))
    self.loss[:] = 0.
    self.perf_loss[:] = 0.
    self.spike_loss[:] = 0.
    self.weight_loss[:] = 0.
    self.h.value = self.init_h.value  # port: from ``predict`` (self.h[:] = self.init_h)

  def update(self, input):
    # update STP variables
    self.x += (self.alpha_std * (1 - self.x) - dt_sec * self.u * self.x * self.h)
    self.u += (self.alpha_stf * (self.U - self.u) + dt_sec * self.U * (1 - self.u) * self.h)
    self.x.value = bm.minimum(1., bm.relu(self.x))
    self.u.value = bm.minimum(1., bm.relu(self.u))
    h_post = self.u * self.x * self.h

    # Update the hidden state. Only use excitatory projections from input layer to RNN
    # All input and RNN activity will be non-negative
    state = alpha * (input @ bm.relu(self.w_ir) + h_post @ self.w_rr + self.b_rr)
    state += bm.random.normal(0, self.noise_rnn, self.h.shape)
    self.h.value = bm.relu(state) + self.h * (1 - alpha)
    self.y.value = self.h @ bm.relu(self.w_ro) + self.b_ro


def build_masse_model(seed=0):
  masse_init_rng.seed(seed)
  model = Model(Task('DMS', dt=dt, tau=time_constant, batch_size=batch_size), num_hidden=20)
  model.noise_rnn = 0.  # no recurrent noise (see above)
  return model


def masse_loss(model):
  # ``Model.loss_func`` on bp.BPTT's outputs: ``predict`` returned (y, h) over time, here the monitors
  def loss_func(predicts, targets):
    _, mon = predicts
    logits, hist_h = mon['y'], mon['h']
    targets, mask = targets

    # Calculate the performance loss
    perf_loss = bp.losses.cross_entropy_loss(logits, targets, reduction='none') * mask
    perf_loss = bm.mean(perf_loss)

    # L1/L2 penalty term on hidden state activity to encourage low spike rate solutions
    n = 2 if spike_regularization == 'L2' else 1
    spike_loss = bm.mean(hist_h ** n)
    weight_loss = bm.mean(bm.relu(model.w_rr) ** n)

    # final loss
    loss = perf_loss + spike_cost * spike_loss + weight_cost * weight_loss
    return loss, {'perf_loss': perf_loss, 'spike_loss': spike_loss, 'weight_loss': weight_loss}

  return loss_func


def masse_epochs(num_epoch, num_batches, seed):
  task = Task('DMS', dt=dt, tau=time_constant, batch_size=batch_size)
  epochs = []
  with numpy_global_seed(seed):  # the task draws from NumPy's global generator
    for _ in range(num_epoch):
      batches = []
      for _ in range(num_batches):
        trial_info = task.generate_trial()
        inputs = np.asarray(trial_info['neural_input'], dtype=np.float32)
        targets = np.asarray(trial_info['desired_output'], dtype=np.float32)
        mask = np.asarray(trial_info['train_mask'], dtype=np.float32)
        batches.append((inputs, (targets, mask)))  # time-first: (num_steps, batch, ...)
      epochs.append(batches)
  return epochs


MASSE = Example(
  name='masse_stp_rnn',
  original='recurrent_networks/Masse_2019_STP_RNN.ipynb',
  build=build_masse_model,
  loss=masse_loss,
  optimizer=lambda: bp.optim.Adam(learning_rate),
  train_data=lambda: EpochData(masse_epochs(2, 3, seed=0)),
  test_data=lambda: EpochData(masse_epochs(1, 1, seed=1)),
  trainer_kwargs=lambda model: dict(loss_has_aux=True, data_first_axis='T',
                                    monitors={'y': model.y, 'h': model.h}),
  fit_kwargs=dict(num_epoch=2),
)


# =====================================================================================================
# 5. Liquid time-constant network (LTC cell) on the occupancy task.
#    Original: brain_inspired_computing/liquid_time_constant_network.py (``LTC``, ``OccupancyTask``,
#    ``_AccBasedTask.f_loss``, ``_BaseTask.fit``)
#    Run as ``--model ltc_ex`` (explicit ODE solver, one of the script's choices), not the default
#    semi-implicit ``ltc``: there the state settles at its fixed point within the 6 unfolds of a
#    step, where it no longer depends on cm_t, so cm_t's gradient is ~1e-8, at the float32
#    round-off of the loss; Adam divides a gradient by its own size, so any two summation orders
#    (bp.BPTT's and the micro-batches') move cm_t differently (by ~1e-5 relative after 6 steps).
#    Changed: model_size 32 -> 6, seq_len 16 -> 8, batch_size 16 -> 7 (3 batches per epoch; a test
#    batch of 10), epochs 200 -> 2, the UCI
#    occupancy files (downloaded) -> random standardised sequences whose label follows the "light"
#    feature; the hand-written loop becomes bp.BPTT(data_first_axis='T') with the same
#    Adam(ltc_lr=0.005); ``param_constrain()`` after every train step becomes a
#    ``fun_after_report`` with num_report=1 (called after every batch); the readout is
#    bp.layers.Dense as there.
# =====================================================================================================

class MappingType(Enum):
  Identity = 0
  Linear = 1
  Affine = 2


class ODESolver(Enum):
  SemiImplicit = 0
  Explicit = 1
  RungeKutta = 2


# Ported from brainpy/examples: brain_inspired_computing/liquid_time_constant_network.py
class LTC(bp.DynamicalSystem):
  def __init__(self, features_in, features_out,
               input_mapping=MappingType.Affine,
               solver_type=ODESolver.SemiImplicit):
    super().__init__()

    self.features_in = features_in
    self.features_out = features_out

    # Number of ODE solver steps in one RNN step
    self._ode_solver_unfolds = 6
    self._solver_type = solver_type

    self.dt = 0.1

    self._erev_init_factor = 1.
    self._w_init_max = 1.0
    self._w_init_min = 0.01
    self._cm_init_min = 0.5
    self._cm_init_max = 0.5
    self._gleak_init_min = 1
    self._gleak_init_max = 1

    self._w_min_value = 0.00001
    self._w_max_value = 1000
    self._gleak_min_value = 0.00001
    self._gleak_max_value = 1000
    self._cm_t_min_value = 0.000001
    self._cm_t_max_value = 1000

    self._fix_cm = None
    self._fix_gleak = None
    self._fix_vleak = None

    # input mapping
    if input_mapping == MappingType.Affine:
      self.w_in = bm.TrainVar(bm.ones((features_in,)))
      self.b_in = bm.TrainVar(bm.zeros((features_in,)))
      self._map_input = lambda x: self.w_in * x + self.b_in
    elif input_mapping == MappingType.Linear:
      self.w_in = bm.TrainVar(bm.ones((features_in,)))
      self._map_input = lambda x: self.w_in * x
    elif input_mapping == MappingType.Identity:
      self._map_input = lambda x: x
    else:
      raise ValueError

    # training variables
    self.sensory_mu = bm.TrainVar(bm.random.uniform(0.3, 0.8, size=[self.features_in, self.features_out]))
    self.sensory_sigma = bm.TrainVar(bm.random.uniform(0.3, 0.8, size=[self.features_in, self.features_out]))
    self.sensory_W = bm.TrainVar(bm.random.uniform(low=self._w_init_min, high=self._w_init_max,
                                                   size=[self.features_in, self.features_out]))
    self.sensory_erev = bm.TrainVar(
      (2 * bm.random.randint(low=0, high=2, size=[self.features_in, self.features_out]) - 1) *
      self._erev_init_factor
    )

    self.mu = bm.TrainVar(bm.random.uniform(0.3, 0.8, size=[self.features_out, self.features_out]))
    self.sigma = bm.TrainVar(bm.random.uniform(0.3, 0.8, size=[self.features_out, self.features_out]))
    self.W = bm.TrainVar(bm.random.uniform(low=self._w_init_min, high=self._w_init_max,
                                           size=[self.features_out, self.features_out]))
    self.erev = bm.TrainVar(
      (2 * bm.random.randint(low=0, high=2, size=[self.features_out, self.features_out]) - 1) *
      self._erev_init_factor
    )

    if self._fix_vleak is None:
      self.vleak = bm.TrainVar(bm.random.uniform(-0.2, 0.2, size=[self.features_out, ]))
    else:
      self.vleak = bm.ones([self.features_out, ]) * self._fix_vleak

    if self._fix_gleak is None:
      if self._gleak_init_max > self._gleak_init_min:
        initializer = bm.random.uniform(self._gleak_init_min, self._gleak_init_max, self.features_out)
      else:
        initializer = bm.ones(self.features_out) * self._gleak_init_min
      self.gleak = bm.TrainVar(initializer)
    else:
      self.gleak = bm.ones(self.features_out) * self._fix_gleak

    if self._fix_cm is None:
      if self._cm_init_max > self._cm_init_min:
        initializer = bm.random.uniform(self._cm_init_min, self._cm_init_max, self.features_out)
      else:
        initializer = bm.ones(self.features_out) * self._cm_init_min
      self.cm_t = bm.TrainVar(initializer)
    else:
      self.cm_t = bm.ones(self.features_out) * self._fix_cm

    # state
    self.reset_state(1)

  def reset_state(self, batch_size=1):
    self.state = bm.Variable([batch_size, self.features_out], batch_axis=0)

  def update(self, *args):
    inputs = self._map_input(args[0] if len(args) == 1 else args[1])
    if self._solver_type == ODESolver.Explicit:
      next_state = self._ode_step_explicit(inputs, self.state.value)
    elif self._solver_type == ODESolver.SemiImplicit:
      next_state = self._ode_step(inputs, self.state.value)
    elif self._solver_type == ODESolver.RungeKutta:
      next_state = self._ode_step_runge_kutta(inputs, self.state.value)
    else:
      raise ValueError("Unknown ODE solver '{}'".format(str(self._solver_type)))
    self.state.value = next_state
    return next_state

  def _ode_step(self, inputs, state):
    # Hybrid euler method
    sensory_w_activation = self.sensory_W * self._sigmoid(inputs, self.sensory_mu, self.sensory_sigma)
    sensory_rev_activation = sensory_w_activation * self.sensory_erev
    w_numerator_sensory = bm.reduce_sum(sensory_rev_activation, axis=1)
    w_denominator_sensory = bm.reduce_sum(sensory_w_activation, axis=1)
    v_pre = state
    for t in range(self._ode_solver_unfolds):
      w_activation = self.W * self._sigmoid(v_pre, self.mu, self.sigma)
      rev_activation = w_activation * self.erev
      w_numerator = bm.reduce_sum(rev_activation, axis=1) + w_numerator_sensory
      w_denominator = bm.reduce_sum(w_activation, axis=1) + w_denominator_sensory
      numerator = self.cm_t * v_pre + self.gleak * self.vleak + w_numerator
      denominator = self.cm_t + self.gleak + w_denominator
      v_pre = numerator / denominator
    return v_pre

  def _ode_step_runge_kutta(self, inputs, state):
    for i in range(self._ode_solver_unfolds):
      k1 = self.dt * self._f_prime(inputs, state)
      k2 = self.dt * self._f_prime(inputs, state + k1 * 0.5)
      k3 = self.dt * self._f_prime(inputs, state + k2 * 0.5)
      k4 = self.dt * self._f_prime(inputs, state + k3)
      state = state + 1.0 / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return state

  def _ode_step_explicit(self, inputs, state):
    # We can pre-compute the effects of the sensory neurons here
    sensory_w_activation = self.sensory_W * self._sigmoid(inputs, self.sensory_mu, self.sensory_sigma)
    w_reduced_sensory = bm.reduce_sum(sensory_w_activation, axis=1)
    # Unfold the ODE multiple times into one RNN step
    v_pre = state
    for t in range(self._ode_solver_unfolds):
      w_activation = self.W * self._sigmoid(v_pre, self.mu, self.sigma)
      w_reduced_synapse = bm.reduce_sum(w_activation, axis=1)
      sensory_in = self.sensory_erev * sensory_w_activation
      synapse_in = self.erev * w_activation
      sum_in = (bm.reduce_sum(synapse_in, axis=1) - v_pre * w_reduced_synapse +
                bm.reduce_sum(sensory_in, axis=1) - v_pre * w_reduced_sensory)
      f_prime = (self.gleak * (self.vleak - v_pre) + sum_in) / self.cm_t
      v_pre = v_pre + self.dt * f_prime
    return v_pre

  def _sigmoid(self, v_pre, mu, sigma):
    v_pre = bm.reshape(v_pre, [-1, v_pre.shape[-1], 1])
    return bm.sigmoid(sigma * (v_pre - mu))

  def _f_prime(self, inputs, state):
    # We can pre-compute the effects of the sensory neurons here
    sensory_w_activation = self.sensory_W * self._sigmoid(inputs, self.sensory_mu, self.sensory_sigma)
    w_reduced_sensory = bm.reduce_sum(sensory_w_activation, axis=1)
    # Unfold the ODE multiple times into one RNN step
    w_activation = self.W * self._sigmoid(state, self.mu, self.sigma)
    w_reduced_synapse = bm.reduce_sum(w_activation, axis=1)
    sensory_in = self.sensory_erev * sensory_w_activation
    synapse_in = self.erev * w_activation
    sum_in = (bm.reduce_sum(sensory_in, axis=1) - state * w_reduced_synapse +
              bm.reduce_sum(synapse_in, axis=1) - state * w_reduced_sensory)
    f_prime = (self.gleak * (self.vleak - state) + sum_in) / self.cm_t
    return f_prime

  def param_constrain(self):
    if self._fix_cm is None:
      self.cm_t.value = bm.clip_by_value(self.cm_t, self._cm_t_min_value, self._cm_t_max_value)
    if self._fix_gleak is None:
      self.gleak.value = bm.clip_by_value(self.gleak, self._gleak_min_value, self._gleak_max_value)
    self.W.value = bm.clip_by_value(self.W, self._w_min_value, self._w_max_value)
    self.sensory_W.value = bm.clip_by_value(self.sensory_W, self._w_min_value, self._w_max_value)


LTC_FEATURES_IN, LTC_FEATURES_OUT, LTC_SIZE, LTC_SEQ_LEN = 5, 2, 6, 8
LTC_SOLVER = ODESolver.Explicit  # model_type 'ltc_ex' (see above)


def build_ltc_model():
  # as in _BaseTask.__init__ for model_type 'ltc'
  rnn = LTC(LTC_FEATURES_IN, LTC_SIZE, solver_type=LTC_SOLVER)
  readout = bp.layers.Dense(LTC_SIZE, LTC_FEATURES_OUT)
  return bp.Sequential(rnn, readout)


def ltc_loss(model):
  # _AccBasedTask.f_loss: ``readout = bm.for_loop(self.model, x)`` is bp.BPTT's time loop here
  def f_loss(readout, y):
    l = bp.losses.cross_entropy_loss(readout, y)
    predicts = bm.argmax(readout, axis=2)
    acc = bm.reduce_mean(bm.cast(bm.equal(predicts, y), bm.float32))
    return l, {'acc': acc}  # bp.BPTT wants the auxiliary data as a dict

  return f_loss


def ltc_after_report(model):
  def constrain(idx, metrics, phase):
    if phase == 'fit':  # _BaseTask.fit: after every train step of an 'ltc' model
      model[0].param_constrain()

  return constrain


def ltc_batches(rng, num_batches, size):
  batches = []
  for _ in range(num_batches):
    x = rng.randn(LTC_SEQ_LEN, size, LTC_FEATURES_IN).astype(np.float32)  # standardised, time-first
    y = (x[..., 2] + 0.3 * rng.randn(LTC_SEQ_LEN, size) > 0).astype(np.int32)  # "light" -> occupied
    batches.append((x, y))
  return batches


def ltc_epochs(num_epoch, seed):
  rng = np.random.RandomState(seed)
  return [ltc_batches(rng, 3, 7) for _ in range(num_epoch)]


LIQUID = Example(
  name='liquid_time_constant',
  original='brain_inspired_computing/liquid_time_constant_network.py',
  build=build_ltc_model,
  loss=ltc_loss,
  optimizer=lambda: bp.optim.Adam(0.005),
  train_data=lambda: EpochData(ltc_epochs(2, seed=0)),
  test_data=lambda: ltc_batches(np.random.RandomState(1), 1, 10),
  trainer_kwargs=lambda model: dict(loss_has_aux=True, data_first_axis='T'),
  fit_kwargs=dict(num_epoch=2, num_report=1),
  after_report=ltc_after_report,
)


# =====================================================================================================
# 6. E/I rate RNN (Dale's law) on perceptual decision making.  Original:
#    recurrent_networks/Song_2016_EI_RNN.ipynb
#    Changed: sigma_rec 0.15 -> 0 (the recurrent noise: bm.random draws of a micro-batch differ
#    from the whole batch's, so noise could only match in distribution); hidden_size 50 -> 10,
#    batch_size 16 -> 8, 20 epochs -> 2 of 3 batches; brainpy_datasets' RatePerceptualDecisionMaking
#    (not installed, no downloads) -> ``perceptual_decision_batch`` below, its trial structure
#    (fixation, noisy stimulus, decision; labels 0 = fixate, 1/2 = choice) at dt=20 with shorter
#    periods; the hand-written loop becomes bp.BPTT(data_first_axis='T') with the same
#    Adam(lr=0.001), the ``predict`` and ``loss`` methods give way to bp.BPTT's time loop and
#    ``ei_rnn_loss`` (``loss``'s body on bp.BPTT's outputs) (``predict``'s ``self.h[:] = 0``
#    is what reset_state does before each batch); ``seed=0`` is passed (with the default None the
#    biases b_rr, b_ro would come from an unseeded generator) and given positionally to
#    bm.random.RandomState, whose keyword is now ``seed_or_key``.
# =====================================================================================================

# Ported from brainpy/examples: recurrent_networks/Song_2016_EI_RNN.ipynb
class EIRNN(bp.DynamicalSystem):  # ``RNN`` in the original
  def __init__(self, num_input, num_hidden, num_output, num_batch,
               dt=None, e_ratio=0.8, sigma_rec=0., seed=None,
               w_ir=bp.init.KaimingUniform(scale=1.),
               w_rr=bp.init.KaimingUniform(scale=1.),
               w_ro=bp.init.KaimingUniform(scale=1.)):
    super().__init__()

    # parameters
    self.tau = 100
    self.num_batch = num_batch
    self.num_input = num_input
    self.num_hidden = num_hidden
    self.num_output = num_output
    self.e_size = int(num_hidden * e_ratio)
    self.i_size = num_hidden - self.e_size
    if dt is None:
      self.alpha = 1
    else:
      self.alpha = dt / self.tau
    self.sigma_rec = (2 * self.alpha) ** 0.5 * sigma_rec  # Recurrent noise
    self.rng = bm.random.RandomState(seed)  # port: the keyword is ``seed_or_key`` in current BrainPy

    # hidden mask
    mask = np.tile([1] * self.e_size + [-1] * self.i_size, (num_hidden, 1))
    np.fill_diagonal(mask, 0)
    self.mask = bm.asarray(mask, dtype=bm.float_)

    # input weight
    self.w_ir = bm.TrainVar(bp.init.parameter(w_ir, (num_input, num_hidden)))

    # recurrent weight
    bound = 1 / num_hidden ** 0.5
    self.w_rr = bm.TrainVar(bp.init.parameter(w_rr, (num_hidden, num_hidden)))
    self.w_rr[:, :self.e_size] /= (self.e_size / self.i_size)
    self.b_rr = bm.TrainVar(self.rng.uniform(-bound, bound, num_hidden))

    # readout weight
    bound = 1 / self.e_size ** 0.5
    self.w_ro = bm.TrainVar(bp.init.parameter(w_ro, (self.e_size, num_output)))
    self.b_ro = bm.TrainVar(self.rng.uniform(-bound, bound, num_output))

    self.reset_state(self.mode)

  def reset_state(self, batch_size):
    # variables
    self.h = bp.init.variable_(bm.zeros, self.num_hidden, batch_size)
    self.o = bp.init.variable_(bm.zeros, self.num_output, batch_size)

  def cell(self, x, h):
    ins = x @ self.w_ir + h @ (bm.abs(self.w_rr) * self.mask) + self.b_rr
    state = h * (1 - self.alpha) + ins * self.alpha
    state += self.sigma_rec * self.rng.randn(self.num_hidden)
    return bm.relu(state)

  def readout(self, h):
    return h @ self.w_ro + self.b_ro

  def update(self, x):
    self.h.value = self.cell(x, self.h)
    self.o.value = self.readout(self.h[:, :self.e_size])
    return self.h.value, self.o.value


def ei_rnn_loss(model):
  # ``RNN.loss`` on bp.BPTT's outputs (``hs, os = self.predict(xs)``)
  def loss(predicts, ys):
    hs, os = predicts
    os = os.reshape((-1, os.shape[-1]))
    return bp.losses.cross_entropy_loss(os, ys.flatten())

  return loss


PDM_DT = 20.


def perceptual_decision_batch(rng, batch_size, fixation=100., stimulus=300., decision=100., sigma=1.):
  """Time-first ``(inputs, labels)``: inputs [fixation, evidence 1, evidence 2], labels 0 / 1 / 2."""
  n_fix, n_stim, n_dec = int(fixation / PDM_DT), int(stimulus / PDM_DT), int(decision / PDM_DT)
  num_step = n_fix + n_stim + n_dec
  inputs = np.zeros((num_step, batch_size, 3), np.float32)
  labels = np.zeros((num_step, batch_size), np.int32)
  ground_truth = rng.randint(2, size=batch_size)
  coherence = rng.choice([0., 6.4, 12.8, 25.6, 51.2], size=batch_size)
  inputs[:n_fix + n_stim, :, 0] = 1.
  for b in range(batch_size):
    direction = 1. if ground_truth[b] == 0 else -1.
    stim = np.array([1 + direction * coherence[b] / 100, 1 - direction * coherence[b] / 100]) / 2
    noise = rng.randn(n_stim, 2) * sigma / np.sqrt(PDM_DT)
    inputs[n_fix:n_fix + n_stim, b, 1:] = stim + noise
    labels[n_fix + n_stim:, b] = ground_truth[b] + 1
  return inputs, labels


def ei_rnn_epochs(num_epoch, num_batches, size, seed):
  rng = np.random.RandomState(seed)
  return [[perceptual_decision_batch(rng, size) for _ in range(num_batches)] for _ in range(num_epoch)]


EI_RNN = Example(
  name='song_2016_ei_rnn',
  original='recurrent_networks/Song_2016_EI_RNN.ipynb',
  build=lambda: EIRNN(num_input=3, num_hidden=10, num_output=3, num_batch=8, dt=PDM_DT, sigma_rec=0., seed=0),
  loss=ei_rnn_loss,
  optimizer=lambda: bp.optim.Adam(lr=0.001),
  train_data=lambda: EpochData(ei_rnn_epochs(2, 3, 8, seed=0)),
  test_data=lambda: EpochData(ei_rnn_epochs(1, 1, 5, seed=1)),
  trainer_kwargs=lambda model: dict(data_first_axis='T'),
  fit_kwargs=dict(num_epoch=2),
  env={'mode': bm.TrainingMode(batch_size=8)},
)


EXAMPLES = {e.name: e for e in (INTEGRATOR, EPROP, FASHION, MASSE, LIQUID, EI_RNN)}
