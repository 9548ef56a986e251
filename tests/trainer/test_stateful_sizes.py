"""``fit(reset_state=False)`` with batches of another size than the model state: refused before they change anything.

Each batch continues, sample by sample, the model state it finds, so it must hold as many samples. ``bp.BPTT``
fails there inside JAX, after the batches before have updated the parameters. ``AccumBPTT`` checks a list's
sizes before the first update (nothing is half-trained) and a generator's or a dataset object's before each
batch (they are not read ahead), with a
``ValueError`` naming ``reset_state`` and the sizes. A model without batched state takes any size. The search
over options, sizes and layouts runs a few examples here and more in ``test_hostile_input.py`` (long).
"""

import contextlib
import warnings

import brainpy as bp
import brainpy.math as bm
import hypothesis
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, optimizer_state, params_of


def _trainer(cls, model, **options):
  return cls(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False, **options)


def _everything(trainer):
  """Parameters, optimizer state and model state, as NumPy arrays."""
  return params_of(trainer.target) + optimizer_state(trainer) + [np.asarray(v) for v in
                                                                 trainer.target.vars().unique().values()]


@pytest.mark.parametrize('sizes', [(2, 4, 3), (1, 2, 4)])
def test_a_list_of_other_sizes_is_refused_before_the_first_update(sizes):
  batches = make_batches(sizes)
  reference = _trainer(bp.BPTT, make_model('rnn'))
  reference.target.reset(sizes[0])
  initial = params_of(reference.target)
  with pytest.raises(TypeError):  # bp.BPTT: inside JAX, after the first batch's update
    reference.fit(batches, num_epoch=1, reset_state=False)
  assert any(not np.array_equal(a, b) for a, b in zip(params_of(reference.target), initial))

  trainer = _trainer(AccumBPTT, make_model('rnn'), num_micro_batch=2)
  trainer.target.reset(sizes[0])
  before = _everything(trainer)
  shown = f'{sizes[0]}, {sizes[1]} and {sizes[2]}'
  with pytest.raises(ValueError, match=rf'train_data has batches of {shown} samples, but with reset_state=False'
                                       rf'.* holds {sizes[0]} samples? along its batch axis 0.*: batches 1 \({sizes[1]} '
                                       rf'samples\), 2 \({sizes[2]} samples\) do not fit it\. Checked before training'):
    trainer.fit(batches, num_epoch=1, reset_state=False)
  assert_trees_close(_everything(trainer), before, rtol=0, atol=0)


def test_a_list_refused_after_a_checkpoint_was_loaded_says_so(tmp_path):
  """The sizes are those of the model state the batches continue, which a checkpoint loaded at the start of fit
  sets: the check comes after loading, and its error says the checkpoint's state is the trainer's now."""
  path = str(tmp_path / 'run.ckpt')
  first = _trainer(AccumBPTT, make_model('rnn'), num_micro_batch=2)
  first.target.reset(4)
  first.fit(make_batches((4, 4)), num_epoch=1, reset_state=False, checkpoint=path)
  trainer = _trainer(AccumBPTT, make_model('rnn'), num_micro_batch=2)
  trainer.target.reset(4)
  with pytest.raises(ValueError, match=r'Checked before training: nothing has trained \(the checkpoint was loaded'):
    trainer.fit(make_batches((2, 2)), num_epoch=2, reset_state=False, checkpoint=path)
  assert_trees_close(params_of(trainer.target), params_of(first.target), rtol=0, atol=0)


def test_a_generator_is_checked_before_each_batch():
  """The batches before the one of another size train as bp.BPTT trains them; that one changes nothing."""
  batches = make_batches((2, 2, 4))
  reference = _trainer(bp.BPTT, make_model('snn'))
  reference.target.reset(2)
  reference.fit(batches[:2], num_epoch=1, reset_state=False)
  trainer = _trainer(AccumBPTT, make_model('snn'), num_micro_batch=2)
  trainer.target.reset(2)
  with pytest.raises(ValueError, match=r'Batch 2 of train_data has 4 samples, but with reset_state=False .* '
                                       r'holds 2 samples along its batch axis 0\. Reset the model at the batch size '
                                       r'first \(model\.reset\(4\)\)'):
    trainer.fit((batch for batch in batches), num_epoch=1, reset_state=False)
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  assert_trees_close(np.asarray(trainer.target.lif.V), np.asarray(reference.target.lif.V))


class DrawnBatches:
  """A dataset object that draws each batch as it is read (noise from NumPy's global generator, as an augmenting
  loader would): reading it ahead would draw other batches for training than bp.BPTT's."""

  def __init__(self, batches):
    self.batches, self.reads = batches, 0

  def __len__(self):
    return len(self.batches)

  def __getitem__(self, i):
    if i >= len(self.batches):
      raise IndexError(i)
    self.reads += 1
    x, y = self.batches[i]
    return x + np.float32(0.1) * np.random.standard_normal(x.shape).astype(np.float32), y


def test_a_dataset_object_is_read_once_and_checked_before_each_batch():
  """A dataset object with ``__len__`` and ``__getitem__`` is not read ahead (it was: every batch drawn once more
  before training, so that a loader drawing noise trained on other batches than bp.BPTT's, and a loading one
  loaded twice): trained on the same draws as bp.BPTT, and a batch of another size is refused before it changes
  anything, as a generator's."""
  batches = make_batches((2, 2, 4))
  trained = []
  for cls, data, options in ((bp.BPTT, batches[:2], {}), (AccumBPTT, batches[:2], dict(num_micro_batch=2)),
                             (AccumBPTT, batches, dict(num_micro_batch=2))):
    np.random.seed(0)
    data = DrawnBatches(data)
    trainer = _trainer(cls, make_model('rnn'), **options)
    trainer.target.reset(2)
    with pytest.raises(ValueError, match=r'Batch 2 of train_data has 4 samples, but with reset_state=False') \
        if len(data) == 3 else contextlib.nullcontext():
      trainer.fit(data, num_epoch=1, reset_state=False)
    assert data.reads == len(data), data.reads
    trained.append(params_of(trainer.target))
  assert_trees_close(trained[1], trained[0])
  assert_trees_close(trained[2], trained[0])


def test_a_model_never_reset_holds_one_sample():
  """BrainPy builds states of one sample: a stateful first batch of 4 fails in bp.BPTT (its time loop cannot
  carry a state that grows), and is refused by AccumBPTT with the fix."""
  batches = make_batches((4,))
  with pytest.raises(TypeError, match='carry'):
    _trainer(bp.BPTT, make_model('rnn')).fit(batches, num_epoch=1, reset_state=False)
  trainer = _trainer(AccumBPTT, make_model('rnn'), num_micro_batch=2)
  before = _everything(trainer)
  with pytest.raises(ValueError, match=r'holds 1 sample along its batch axis 0 \(a model is built with states of '
                                       r'one sample: one never reset at the batch size holds 1\)'):
    trainer.fit(batches, num_epoch=1, reset_state=False)
  assert_trees_close(_everything(trainer), before, rtol=0, atol=0)


def test_evaluation_batches_of_another_size_are_refused_before_training():
  trainer = _trainer(AccumBPTT, make_model('rnn'), num_micro_batch=2)
  trainer.target.reset(3)
  before = _everything(trainer)
  with pytest.raises(ValueError, match=r'test_data has batches of 5 samples, but with reset_state=False'):
    trainer.fit(make_batches((3, 3)), test_data=make_batches((5,)), num_epoch=1, reset_state=False)
  assert_trees_close(_everything(trainer), before, rtol=0, atol=0)


def test_a_model_without_batched_state_takes_any_size():
  """A feed-forward model over time keeps no state between batches: every size trains, as in bp.BPTT."""
  results = []
  for cls, options in ((bp.BPTT, {}), (AccumBPTT, {'num_micro_batch': 2})):
    bm.random.seed(0)
    with bm.training_environment():
      model = bp.Sequential(bp.dnn.Dense(3, 8), bp.dnn.Dense(8, 2))
    trainer = _trainer(cls, model, **options)
    trainer.fit(make_batches((2, 3)), num_epoch=1, reset_state=False)
    results.append(params_of(model))
  assert_trees_close(results[1], results[0])


@st.composite
def stateful_runs(draw):
  """A run with changing batch sizes: the model, its reset before fit (``None``: never), the batches' sizes (half
  of them all of the model state's size) and layout (time first or not; a list, a tuple, a generator or a
  callable), test batches, and the options."""
  reset_at = draw(st.sampled_from([None, 1, 2, 3]))
  state_size = reset_at or 1  # BrainPy builds a model's states with one sample
  sizes = st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=4)
  return dict(
    model=draw(st.sampled_from(['rnn', 'snn'])),
    reset_at=reset_at,
    sizes=draw(st.one_of(sizes, st.integers(1, 3).map(lambda n: [state_size] * n))),
    test_sizes=draw(st.sampled_from([(), (state_size,), (2,), (3, 3)])),
    layout=draw(st.sampled_from(['list', 'tuple', 'generator', 'callable'])),
    time_first=draw(st.booleans()),
    reset_state=draw(st.sampled_from([False, False, True])),
    options=draw(st.sampled_from([dict(num_micro_batch=1), dict(num_micro_batch=2), dict(num_micro_batch=3),
                                  dict(num_micro_batch=2, accumulate_steps=2), dict(micro_batch_size=1),
                                  dict(num_micro_batch='auto', memory_budget='1GiB')])),
  )


def _trained_state(trainer) -> list:
  """What a batch changes, as NumPy arrays: every Variable of the model (parameters, state) and of the optimizer
  but the learning rate's epoch counter, which fit steps at the end of each training pass (before the test pass)."""
  epochs = getattr(trainer.optimizer.lr, 'last_epoch', None)
  return ([np.asarray(v) for v in trainer.optimizer.vars().unique().values() if v is not epochs]
          + [np.asarray(v) for v in trainer.target.vars().unique().values()])


def _laid_out(batches, layout):
  if layout == 'tuple':
    return tuple(batches)
  if layout == 'generator':
    return (batch for batch in batches)
  if layout == 'callable':
    return lambda: iter(batches)
  return batches


def check_stateful_run(run: dict) -> None:
  """With ``reset_state=False`` every batch (train and test) must have the size of the model state: a run
  trains if and only if they all do. A refusal is AccumBPTT's ``ValueError`` naming ``reset_state``, never an
  error from inside JAX, and it leaves the parameters, the optimizer and the model state as the last batch
  that ran left them (a list or a tuple: as before fit, since it is checked before the first update)."""
  model = make_model(run['model'])
  if run['reset_at'] is not None:
    model.reset(run['reset_at'])
  state_size = run['reset_at'] or 1
  trainer = AccumBPTT(model, 'mean_squared_error', optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False,
                      data_first_axis='T' if run['time_first'] else 'B', cache=False, **run['options'])
  snapshots = [_trained_state(trainer)]  # before fit, then after each batch's report
  record = lambda *_: snapshots.append(_trained_state(trainer))  # noqa: E731
  # 5 time steps: never a batch's size, so that no target's axes are ambiguous with data_first_axis='T'
  train = make_batches(run['sizes'], num_time=5, time_first=run['time_first'])
  test = make_batches(run['test_sizes'], num_time=5, time_first=run['time_first'], seed=1) or None
  expected_to_fit = run['reset_state'] or all(size == state_size for size in run['sizes'] + list(run['test_sizes']))
  hypothesis.event('trains' if expected_to_fit else f'refused, {run["layout"]}')
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      trainer.fit(_laid_out(train, run['layout']), test_data=test and _laid_out(test, run['layout']), num_epoch=1,
                  num_report=1, reset_state=run['reset_state'], fun_after_report=record)
  except Exception as error:  # noqa: BLE001 -- the test classifies every outcome
    assert isinstance(error, ValueError) and 'reset_state=False' in str(error), f'{type(error).__name__}: {error}'
    assert not expected_to_fit, f'refused a run whose batches all have the state\'s size: {error}'
    if run['layout'] in ('list', 'tuple'):
      assert len(snapshots) == 1, 'a list or tuple must be refused before its first batch'
    for a, b in zip(_trained_state(trainer), snapshots[-1]):
      np.testing.assert_array_equal(a, b)
    return
  assert expected_to_fit, f'trained batches of {run["sizes"]} on a model state of {state_size} samples'


@settings(max_examples=6, deadline=None, derandomize=True, print_blob=True, suppress_health_check=list(HealthCheck))
@given(run=stateful_runs())
def test_stateful_runs_of_changing_sizes_train_or_are_refused_before_the_batch_changes_anything(run):
  """A few examples of the search (``test_hostile_input.py`` runs more in the long suite)."""
  check_stateful_run(run)


@pytest.mark.long  # the long suite (--long): the memory planner and streamed chunks
def test_a_streamed_batch_of_another_size_is_refused_before_its_first_chunk():
  """A batch streamed from the host in chunks continues the model state too: the one of another size is refused
  before its first chunk runs; the one before it trained as bp.BPTT trains it."""
  from test_stream import _batches, _budget, _model
  first, other = _batches((48,), seed=3)[0], _batches((22,), seed=4)[0]
  reference = bp.BPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False)
  reference.fit([first], num_epoch=1)
  reference.fit([first], num_epoch=1, reset_state=False)
  trainer = AccumBPTT(_model(), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.01), progress_bar=False,
                      num_micro_batch='auto', memory_budget=_budget([first]))
  trainer.fit([first], num_epoch=1)
  with pytest.raises(ValueError, match=r'Batch 1 of train_data has 22 samples, but with reset_state=False'):
    trainer.fit((batch for batch in (first, other)), num_epoch=1, reset_state=False)
  assert 48 in trainer.stream_chunks
  assert_trees_close(params_of(trainer.target), params_of(reference.target))
  assert_trees_close(np.asarray(trainer.target.lif.V), np.asarray(reference.target.lif.V))
