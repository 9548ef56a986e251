"""Training-loop options against references computed another way (mostly bp.BPTT on concatenated data)."""

import os
import subprocess
import sys
import textwrap
import uuid
import warnings

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import background
from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, optimizer_state, params_of

UNEVEN = (6, 4, 6, 5, 3)


def concat(batches):
  """One batch holding all of ``batches`` (inputs, targets), batch-first."""
  return tuple(jax.tree_util.tree_map(lambda *a: np.concatenate(a), *parts) for parts in zip(*batches))


def windows(batches, k):
  """The batches an update of ``accumulate_steps=k`` sees, each concatenated; the last window may be short."""
  return [concat(batches[i:i + k]) for i in range(0, len(batches), k)]


def train(cls, data, num_epoch=2, optimizer=None, loss=bp.losses.mean_squared_error, **kwargs):
  model = make_model('rnn')
  optimizer = optimizer or bp.optim.Adam(lr=0.05)
  trainer = cls(model, loss, optimizer=optimizer, progress_bar=False, **kwargs)
  trainer.fit(data, num_epoch=num_epoch)
  return params_of(model), trainer


# ---------------------------------------------------------------- 1. accumulation across batches

@pytest.mark.parametrize('num_micro_batch', [1, 2])
def test_accumulate_steps_equals_bptt_on_concatenated_batches(num_micro_batch):
  batches = make_batches(UNEVEN)  # windows of 2: 6+4, 6+5, and the short last window 3
  params, _ = train(AccumBPTT, batches, num_micro_batch=num_micro_batch, accumulate_steps=2)
  ref_params, _ = train(bp.BPTT, windows(batches, 2))
  assert_trees_close(params, ref_params)


def test_accumulate_steps_compiles_one_step_for_collecting_and_updating():
  """Batches of one size: the steps that only collect and those that update the window are one compiled program
  (the window's flag, an argument, says which), and training is bp.BPTT's on the windows."""
  batches = make_batches((6,) * 5)  # windows of 2, 2 and the short last window 1
  params, trainer = train(AccumBPTT, batches, num_micro_batch=2, accumulate_steps=2)
  assert trainer.compilations['fit'] == 1
  ref_params, _ = train(bp.BPTT, windows(batches, 2))
  assert_trees_close(params, ref_params)


def test_accumulate_steps_alone_needs_no_micro_batch_option():
  batches = make_batches(UNEVEN)
  params, _ = train(AccumBPTT, batches, accumulate_steps=2)
  ref_params, _ = train(bp.BPTT, windows(batches, 2))
  assert_trees_close(params, ref_params)


@pytest.mark.long  # the long suite (--long): README suite time
def test_accumulate_steps_schedule_by_epoch():
  batches = make_batches(UNEVEN)
  params, _ = train(AccumBPTT, batches, num_epoch=3, num_micro_batch=2, accumulate_steps={0: 1, 1: 3})
  epochs = iter([batches, windows(batches, 3), windows(batches, 3)])
  ref_params, _ = train(bp.BPTT, lambda: next(epochs), num_epoch=3)
  assert_trees_close(params, ref_params)


def test_last_window_is_weighted_by_what_it_holds():
  """Guards the test above: an equal-weight combination of the short window would differ."""
  batches = make_batches((6, 1))
  params, _ = train(AccumBPTT, batches, num_epoch=1, num_micro_batch=1, accumulate_steps=2)
  unweighted, _ = train(bp.BPTT, [concat([batches[0]] + [batches[1]] * 6)], num_epoch=1)
  ref_params, _ = train(bp.BPTT, [concat(batches)], num_epoch=1)
  assert_trees_close(params, ref_params)
  assert not all(np.allclose(p, u, rtol=1e-4) for p, u in zip(params, unweighted))


# ---------------------------------------------------------------- 2. learning-rate schedules

def test_learning_rate_schedule_steps_once_per_update():
  batches = make_batches(UNEVEN)
  schedule = lambda: bp.optim.ExponentialDecayLR(lr=0.05, decay_steps=1, decay_rate=0.5)
  params, trainer = train(AccumBPTT, batches, optimizer=bp.optim.Adam(lr=schedule()), num_micro_batch=3,
                          accumulate_steps=2)
  ref_params, ref = train(bp.BPTT, windows(batches, 2), optimizer=bp.optim.Adam(lr=schedule()))
  assert_trees_close(params, ref_params)
  assert int(trainer.optimizer.lr.last_call.value) == int(ref.optimizer.lr.last_call.value) == 5


# ---------------------------------------------------------------- 3. clipping

class ClippedBPTT(bp.BPTT):
  """Reference: whole-batch gradients clipped to a global norm before the update."""

  max_norm = 0.05

  def _step_func_fit(self, shared_args, inputs, targets):
    grads, loss = self.f_grad(shared_args, inputs, targets)
    norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in grads.values()))
    factor = jnp.minimum(1., self.max_norm / norm)
    self.optimizer.update({k: g * factor for k, g in grads.items()})
    return (loss,)


@pytest.mark.parametrize('num_micro_batch', [pytest.param(1, marks=pytest.mark.long), 4])  # README suite time
def test_clipping_acts_once_on_the_combined_gradient(num_micro_batch):
  batches = make_batches((10, 7))
  params, _ = train(AccumBPTT, batches, num_micro_batch=num_micro_batch, clip_grad_norm=ClippedBPTT.max_norm)
  ref_params, _ = train(ClippedBPTT, batches)
  unclipped, _ = train(bp.BPTT, batches)
  assert_trees_close(params, ref_params)
  assert not all(np.allclose(p, u, rtol=1e-3) for p, u in zip(params, unclipped))


# ---------------------------------------------------------------- 4. non-finite guard

def _with_nan(batch):
  x, y = batch
  x = x.copy()
  x[1, 2, 0] = np.nan
  return x, y


def test_nonfinite_update_is_skipped_and_training_continues(capsys):
  good = make_batches((6, 6, 5))
  data = [good[0], _with_nan(good[1]), good[2]]
  params, trainer = train(AccumBPTT, data, num_micro_batch=2, skip_nonfinite=True)
  ref_params, ref = train(bp.BPTT, [good[0], good[2]])
  assert_trees_close(params, ref_params)
  assert_trees_close(optimizer_state(trainer), optimizer_state(ref))  # moments and learning-rate step too
  assert int(trainer.skipped_steps.value) == 2
  assert 'skipped 2 non-finite' in capsys.readouterr().out


def test_nonfinite_batch_is_left_out_of_its_window():
  good = make_batches((6, 6, 5, 4))
  data = [good[0], _with_nan(good[1]), good[2], good[3]]
  params, trainer = train(AccumBPTT, data, num_micro_batch=2, accumulate_steps=2, skip_nonfinite=True)
  ref_params, _ = train(bp.BPTT, [good[0], concat(good[2:])])
  assert_trees_close(params, ref_params)
  assert int(trainer.skipped_steps.value) == 2


# ---------------------------------------------------------------- 5. masked, variable-length losses

def masked_mse(predicts, targets):
  """Mean squared error over the valid time steps of the (micro-)batch."""
  mask = targets['mask'][..., None]
  return bm.sum(mask * (predicts - targets['y']) ** 2) / (bm.sum(mask) * predicts.shape[-1])


def _variable_length_batches():
  rng = np.random.RandomState(4)
  batches = []
  for x, y in make_batches((8, 8)):
    lengths = rng.randint(1, x.shape[1] + 1, size=len(x))
    lengths[:4] = 1  # the first micro-batch holds short sequences, the second long ones
    mask = (np.arange(x.shape[1])[None] < lengths[:, None]).astype('float32')
    batches.append((x, {'y': y, 'mask': mask}))
  return batches


def test_masked_loss_weighted_by_valid_steps_matches_whole_batch():
  batches = _variable_length_batches()
  valid_steps = lambda inputs, targets: targets['mask'].sum()
  params, _ = train(AccumBPTT, batches, loss=masked_mse, num_micro_batch=2, loss_weight_fn=valid_steps)
  ref_params, _ = train(bp.BPTT, batches, loss=masked_mse)
  assert_trees_close(params, ref_params)
  # Without the weight, short sequences are over-weighted (the 2024 Hugging Face bug).
  naive, _ = train(AccumBPTT, batches, loss=masked_mse, num_micro_batch=2)
  assert not all(np.allclose(p, r, rtol=1e-3) for p, r in zip(naive, ref_params))


def _padded_batches(sizes, padding):
  """Batches whose last ``padding[i]`` samples are padding: every step of theirs masked out."""
  batches = []
  for (x, y), pad in zip(make_batches(sizes), padding):
    mask = np.ones(y.shape[:2], np.float32)
    mask[len(x) - pad:] = 0.
    batches.append((x, {'y': y, 'mask': mask}))
  return batches


@pytest.mark.parametrize('accumulate_steps', [1, 2])
def test_a_micro_batch_of_padding_alone_adds_nothing(accumulate_steps):
  """Batches of 8 padded with 3 samples that loss_weight_fn weighs 0, cut 3 + 3 + 2: the last micro-batch holds
  padding alone, whose masked mean is 0 / 0. bp.BPTT's loss of the whole batch has no such term; AccumBPTT's
  combination must not take 0 * nan either (it made every parameter nan). With accumulate_steps=2 the window's
  second batch is all padding: its update is the first batch's."""
  padding = (3, 3) if accumulate_steps == 1 else (3, 8)
  batches = _padded_batches((8, 8), padding)
  valid_steps = lambda inputs, targets: targets['mask'].sum()  # noqa: E731
  params, trainer = train(AccumBPTT, batches, loss=masked_mse, num_micro_batch=3, loss_weight_fn=valid_steps,
                          accumulate_steps=accumulate_steps)
  assert all(np.isfinite(p).all() for p in params)
  reference = batches if accumulate_steps == 1 else windows(batches, 2)
  ref_params, ref_trainer = train(bp.BPTT, reference, loss=masked_mse)
  assert_trees_close(params, ref_params)
  if accumulate_steps == 1:
    np.testing.assert_allclose(trainer.train_losses, ref_trainer.train_losses, rtol=1e-5)


# ---------------------------------------------------------------- 6. stateful training: see test_equivalence.py

# ---------------------------------------------------------------- 7. checkpoints

RESUME = textwrap.dedent('''
  import sys, numpy as np, brainpy as bp
  sys.path.insert(0, {tests!r})
  from brainpy_accum import AccumBPTT
  from helpers import make_batches, make_model, params_of
  model = make_model('snn')
  trainer = AccumBPTT(model, bp.losses.mean_squared_error, num_micro_batch=2, accumulate_steps=2,
                      optimizer=bp.optim.Adam(lr=bp.optim.ExponentialDecayLR(0.05, 1, 0.9)), progress_bar=False)
  trainer.load_checkpoint({path!r})
  trainer.fit(make_batches({sizes!r}), num_epoch=1)
  np.savez({out!r}, *params_of(model))
''')


def _checkpoint_trainer():
  model = make_model('snn')
  return AccumBPTT(model, bp.losses.mean_squared_error, num_micro_batch=2, accumulate_steps=2,
                   optimizer=bp.optim.Adam(lr=bp.optim.ExponentialDecayLR(0.05, 1, 0.9)), progress_bar=False)


@pytest.mark.parametrize('fresh_process', [False, pytest.param(True, marks=pytest.mark.long)])
def test_resume_equals_training_straight_through(fresh_process, tmp_path):
  """A checkpoint loaded into a new trainer (in this process, or in a fresh one: the long suite) finishes the run
  as training straight through does."""
  sizes = (6, 5, 4)
  straight = _checkpoint_trainer()
  straight.fit(make_batches(sizes), num_epoch=2)

  first = _checkpoint_trainer()
  first.fit(make_batches(sizes), num_epoch=1)
  path = first.save_checkpoint(str(tmp_path / 'epoch1.ckpt'))
  assert os.listdir(tmp_path) == ['epoch1.ckpt']  # no temporary file left behind
  if fresh_process:
    out = str(tmp_path / 'resumed.npz')
    script = RESUME.format(tests=os.path.join(os.path.dirname(__file__), os.pardir, 'support'), path=path, sizes=sizes,
                           out=out)
    subprocess.run([sys.executable, '-c', script], check=True, capture_output=True, env=background.env())
    resumed = np.load(out)
    resumed = [resumed[f'arr_{i}'] for i in range(len(resumed.files))]
  else:
    second = _checkpoint_trainer()
    second.load_checkpoint(path)
    second.fit(make_batches(sizes), num_epoch=1)
    resumed = params_of(second.target)
  assert_trees_close(resumed, params_of(straight.target), rtol=0, atol=1e-6)


def _named_trainer(first: str, second: str):
  """A rate RNN whose two layers have the given names (so its parameters' names sort as chosen)."""
  with bm.training_environment():
    model = bp.Sequential(bp.dyn.RNNCell(3, 8, name=first), bp.dnn.Dense(8, 2, name=second))
  return AccumBPTT(model, bp.losses.mean_squared_error, num_micro_batch=2, accumulate_steps=3, progress_bar=False)


def test_window_sums_load_onto_their_parameters_whatever_the_names(tmp_path):
  """Auto-generated names differ between processes (``Dense9`` here, ``Dense12`` there), and the window's sums
  are kept in the sorted order of their names, where ``x10`` comes before ``x9``: a checkpoint taken mid-window
  under such names loads each sum onto its own parameter in a trainer whose names sort the other way."""
  tag = f'ckpt{uuid.uuid4().hex[:8]}_'  # BrainPy's names are unique in a process
  saved = _named_trainer(f'{tag}9', f'{tag}10')  # names that sort against the layers' order
  for i, var in enumerate(saved._window.grads.values()):  # sums in the middle of a window: a value for each
    var.value = jnp.full_like(var.value, i + 1.)
  path = saved.save_checkpoint(str(tmp_path / 'mid.ckpt'))
  loaded = _named_trainer(f'{tag}a', f'{tag}b')
  loaded.load_checkpoint(path)
  for old_name, new_name in zip(saved.target.train_vars().unique(), loaded.target.train_vars().unique()):
    np.testing.assert_array_equal(loaded._window.grads[new_name].value, saved._window.grads[old_name].value)


def test_corrupt_or_mismatched_checkpoint_leaves_the_trainer_untouched(tmp_path):
  trainer = _checkpoint_trainer()
  trainer.fit(make_batches((6,)), num_epoch=1)
  before = (params_of(trainer.target), optimizer_state(trainer))
  corrupt = tmp_path / 'corrupt.ckpt'
  corrupt.write_bytes(b'not a checkpoint')
  with pytest.raises(ValueError, match='is not a readable checkpoint.*Nothing was loaded'):
    trainer.load_checkpoint(str(corrupt))
  other = AccumBPTT(make_model('rnn', n_hidden=5), bp.losses.mean_squared_error, num_micro_batch=2,
                    accumulate_steps=2, progress_bar=False)
  mismatched = other.save_checkpoint(str(tmp_path / 'other.ckpt'))
  with pytest.raises(ValueError, match='does not fit|holds .* variables'):
    trainer.load_checkpoint(mismatched)
  with pytest.raises(FileNotFoundError, match='No checkpoint at path'):
    trainer.load_checkpoint(str(tmp_path / 'missing.ckpt'))
  assert_trees_close((params_of(trainer.target), optimizer_state(trainer)), before, rtol=0, atol=0)


def test_brainpy_state_methods_keep_their_meaning(tmp_path):
  for name in ('save_state', 'load_state', 'state_dict', 'load_state_dict'):
    assert getattr(AccumBPTT, name) is getattr(bp.BPTT, name), name
  trainer = _checkpoint_trainer()
  state = trainer.target.state_dict()
  trainer.save_checkpoint(str(tmp_path / 'c.ckpt'))
  trainer.load_checkpoint(str(tmp_path / 'c.ckpt'))
  assert_trees_close(jax.tree_util.tree_map(np.asarray, trainer.target.state_dict()),
                     jax.tree_util.tree_map(np.asarray, state), rtol=0, atol=0)


# ---------------------------------------------------------------- 9. batch statistics

class NormedRNN(bp.DynamicalSystem):
  def __init__(self):
    super().__init__()
    self.inp = bp.dnn.Dense(3, 8)
    self.norm = bp.dnn.BatchNorm1d(8)
    self.out = bp.dnn.Dense(8, 2)

  def update(self, x):
    return self.out(self.norm(self.inp(x)[:, None, :])[:, 0])  # BatchNorm1d wants (batch, length, channels)


def test_batch_statistics_layers_warn_once_at_construction():
  bm.random.seed(0)
  with bm.training_environment():
    model = NormedRNN()
  with pytest.warns(UserWarning, match='batch-statistics layers \\(BatchNorm1d\\).*not equivalent'):
    AccumBPTT(model, bp.losses.mean_squared_error, num_micro_batch=2, progress_bar=False)


def test_batch_norm_trains_no_worse_than_bptt_on_this_brainpy():
  """brainpy 2.8.2's BatchNorm reads the traced ``fit`` flag and fails under bp.BPTT itself; AccumBPTT fails alike."""
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, {'num_micro_batch': 2})):
    with bm.training_environment():
      model = NormedRNN()
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UserWarning)
      trainer = cls(model, bp.losses.mean_squared_error, progress_bar=False, **kwargs)
    with pytest.raises(jax.errors.TracerBoolConversionError):
      trainer.fit(make_batches((8,)), num_epoch=1)


def test_models_without_batch_statistics_do_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter('error', UserWarning)
    AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, num_micro_batch=2, optimizer=bp.optim.Adam(lr=0.1))


# ---------------------------------------------------------------- 10. the recorded history

def _history(cls, num_report, **kwargs):
  """Everything fit records and reports, for 5 batches per epoch, 3 test batches and 2 epochs."""
  calls = []
  model = make_model('rnn')
  trainer = cls(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, **kwargs)
  trainer.fit(make_batches((6, 5, 6, 4, 6)), test_data=make_batches((5, 4, 5), seed=2), num_epoch=2,
              num_report=num_report, fun_after_report=lambda idx, metrics, phase: calls.append((idx, phase, metrics)))
  recorded = {(phase, which): trainer.get_hist_metric(phase, 'loss', which)
              for phase in ('fit', 'test') for which in ('report', 'detailed')}
  return recorded, calls


@pytest.mark.parametrize('num_report', [-1, 1, 2, *[pytest.param(n, marks=pytest.mark.long) for n in (3, 7)]])
def test_history_and_reports_equal_bptts_for_every_num_report(num_report):
  """Report windows that straddle an epoch's end are dropped there, as bp.BPTT drops them."""
  expected, expected_calls = _history(bp.BPTT, num_report)
  recorded, calls = _history(AccumBPTT, num_report, num_micro_batch=2)
  assert {k: None if v is None else len(v) for k, v in recorded.items()} == \
         {k: None if v is None else len(v) for k, v in expected.items()}
  assert_trees_close({k: v for k, v in recorded.items() if v is not None},
                     {k: v for k, v in expected.items() if v is not None})
  assert [(idx, phase, sorted(m)) for idx, phase, m in calls] == \
         [(idx, phase, sorted(m)) for idx, phase, m in expected_calls]
  assert_trees_close([m for _, _, m in calls], [m for _, _, m in expected_calls])


def test_a_stacked_array_of_batches_trains_as_bptt_and_a_list_of_labels_is_named():
  """``bp.BPTT``'s ``for x, y in train_data`` unpacks an array of stacked batches, ``(n, 2, batch, time, ...)``:
  it was refused as 'not a pair'. Targets as a Python list of numbers, which micro-batches cannot cut, are refused
  naming np.asarray (the message said they held no samples)."""
  stacked = np.stack([np.stack([x, np.tile(y, (1, 1, 2))[..., :3]]) for x, y in make_batches((6, 6, 6), seed=8)])
  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, dict(num_micro_batch=4))):
    model = make_model('rnn', n_out=3)
    trainer = cls(model, 'mean_squared_error', optimizer=bp.optim.Adam(lr=0.05), progress_bar=False, **kwargs)
    trainer.fit(stacked, num_epoch=1)
    results.append((params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert_trees_close(results[1], results[0])
  x = make_batches((6,), seed=9)[0][0]
  trainer = AccumBPTT(make_model('rnn'), 'cross_entropy_loss', num_micro_batch=2, progress_bar=False)
  with pytest.raises(ValueError, match=r'targets as a Python list of 6 numbers in batch 0.*np.asarray\(targets\)'):
    trainer.fit([(x, [0, 1, 0, 1, 1, 0])], num_epoch=1)


def test_a_monitor_that_picks_samples_warns_and_the_named_fix_is_exact():
  """``monitors={'h': (state, [0, 1])}`` takes samples 0 and 1 of the batch (BrainPy indexes the Variable's axis 0,
  its batch axis): a loss reading it read each micro-batch's own samples, silently. The trainer warns, and its
  fix (the whole Variable monitored, the samples taken in loss_fun, whole_batch_loss=True) trains as bp.BPTT."""
  def loss(predicts, targets):
    out, monitored = predicts
    return bp.losses.mean_squared_error(out, targets) + 0.1 * jnp.mean(bm.as_jax(monitored['h'])[:2] ** 2)

  model = make_model('rnn')
  with pytest.warns(UserWarning, match=r"Monitor 'h' takes entries \[0, 1\] along axis 0 .* whole_batch_loss=True"):
    AccumBPTT(model, loss, num_micro_batch=3, monitors={'h': (model.rnn.state, [0, 1])})
  results = []
  for cls, kwargs in ((bp.BPTT, {}), (AccumBPTT, dict(num_micro_batch=3, whole_batch_loss=True))):
    model = make_model('rnn')
    trainer = cls(model, loss, optimizer=bp.optim.Adam(lr=0.05), progress_bar=False,
                  monitors={'h': model.rnn.state}, **kwargs)
    trainer.fit(make_batches((12, 10), seed=5), num_epoch=1)
    results.append((params_of(model), trainer.get_hist_metric('fit', 'loss', 'detailed')))
  assert_trees_close(results[1], results[0])
