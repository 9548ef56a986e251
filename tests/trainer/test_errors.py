"""Bad input is rejected with a clear message, before parameters or optimizer state change."""

import brainpy as bp
import numpy as np
import pytest
from brainpy._errors import NoLongerSupportError, UnsupportedError

from brainpy_accum import AccumBPTT
from helpers import assert_trees_close, make_batches, make_model, optimizer_state, params_of


def make_trainer(**kwargs):
  kwargs.setdefault('num_micro_batch', 2)
  return AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                   progress_bar=False, **kwargs)


@pytest.mark.parametrize('kwargs, error, message', [
  ({'num_micro_batch': 0}, ValueError, 'num_micro_batch=0 must be a positive int'),
  ({'num_micro_batch': -3}, ValueError, 'num_micro_batch=-3'),
  ({'num_micro_batch': 2.5}, TypeError, r'num_micro_batch=2.5 must be a positive int \(float given\)'),
  ({'num_micro_batch': True}, TypeError, 'num_micro_batch=True'),
  ({'num_micro_batch': None, 'micro_batch_size': 0}, ValueError, 'micro_batch_size=0'),
  ({'num_micro_batch': 2, 'micro_batch_size': 4}, ValueError, 'exactly one of num_micro_batch and micro_batch_size'),
  ({'grad_reduction': 'max'}, ValueError, "grad_reduction='max' is unknown: use 'mean'"),
  ({'grad_reduction': None}, TypeError, 'grad_reduction=None'),
  ({'target_batch_axis': -1}, ValueError, 'target_batch_axis=-1'),
  ({'data_first_axis': 'X'}, ValueError, "data_first_axis='X' must be 'B'"),
  ({'data_first_axis': 'X'}, AssertionError, "data_first_axis='X'"),  # (BrainPy's own error is an AssertionError)
])
def test_bad_constructor_arguments_are_named(kwargs, error, message):
  with pytest.raises(error, match=message):
    make_trainer(**kwargs)


@pytest.mark.parametrize('fit_kwargs, error, message', [
  ({'num_epoch': -1}, ValueError, 'num_epoch=-1'),
  ({'num_report': 1.5}, TypeError, 'num_report=1.5'),
  ({'reset_state': 'yes'}, TypeError, "reset_state='yes' must be True or False"),
  ({'fun_after_report': 3}, TypeError, 'fun_after_report=3 must be callable'),
])
def test_bad_fit_arguments_are_named(fit_kwargs, error, message):
  with pytest.raises(error, match=message):
    make_trainer().fit(make_batches((4,)), **fit_kwargs)


def test_a_weight_that_is_not_one_number_is_named_before_any_change():
  """loss_weight_fn giving per-sample weights (shape (B,)) is refused by name as the first step is traced, not
  by a broadcasting error deep in the sums; nothing has changed."""
  trainer = make_trainer(loss_weight_fn=lambda inputs, targets: np.ones(len(inputs), np.float32))
  before = params_of(trainer.target), optimizer_state(trainer)
  with pytest.raises(ValueError, match=r'loss_weight_fn must return one number per \(micro-\)batch.*shape \(2,\)'):
    trainer.fit(make_batches((4,)), num_epoch=1)
  assert_trees_close((params_of(trainer.target), optimizer_state(trainer)), before, rtol=0, atol=0)


def test_bare_xy_pair_is_rejected_as_type_error_and_as_brainpys_error():
  x, y = make_batches((4,))[0]
  for error in (TypeError, UnsupportedError):
    with pytest.raises(error, match=r'one bare \(X, Y\) pair.*train_data=\[\(X, Y\)\]'):
      make_trainer().fit((x, y), num_epoch=1)


def test_removed_batch_size_argument_is_named_and_is_brainpys_error():
  for error in (TypeError, NoLongerSupportError):
    with pytest.raises(error, match=r'fit\(batch_size=4\) is no longer supported.*X\[i:i \+ 4\]'):
      make_trainer().fit(make_batches((4,)), batch_size=4)


def test_uncallable_report_function_is_also_the_assertion_error_brainpy_raises():
  with pytest.raises(AssertionError, match='fun_after_report=3 must be callable'):
    make_trainer().fit(make_batches((4,)), fun_after_report=3)


def _mismatched_targets():
  x, y = make_batches((6,))[0]
  return x, y[:4]


def _empty_batch():
  x, y = make_batches((6,))[0]
  return x[:0], y[:0]


def _disagreeing_inputs():
  x, y = make_batches((6,))[0]
  return (x, x[:5]), y


@pytest.mark.parametrize('bad_batch, message', [
  (_mismatched_targets, r'targets has shape \(4, 5, 2\), but the inputs hold batch_size=6'),
  (_empty_batch, 'The batch is empty'),
  (_disagreeing_inputs, r'input arrays disagree on the batch size.*\[0\].: 6.*\[1\].: 5'),
])
def test_rejected_batch_leaves_parameters_and_optimizer_untouched(bad_batch, message):
  trainer = make_trainer()
  trainer.fit(make_batches((6,)), num_epoch=1)
  params, opt_state = params_of(trainer.target), optimizer_state(trainer)
  with pytest.raises(ValueError, match=message):
    trainer.fit([bad_batch()], num_epoch=1)
  assert_trees_close(params_of(trainer.target), params, rtol=0, atol=0)
  assert_trees_close(optimizer_state(trainer), opt_state, rtol=0, atol=0)


def test_target_batch_axis_names_the_fix():
  x, y = make_batches((6,), time_first=True)[0]
  trainer = make_trainer(data_first_axis='T', target_batch_axis=2)
  with pytest.raises(ValueError, match='set target_batch_axis to the axis that holds them'):
    trainer.fit([(x, y)], num_epoch=1)


def test_a_target_leaf_that_holds_no_samples_is_refused_with_the_fix_that_works():
  """Class weights beside the labels hold no samples: every target leaf is cut, so the error says to bind them into
  loss_fun (target_batch_axis cannot leave a leaf whole)."""
  x, y = make_batches((6,))[0]
  trainer = make_trainer()
  with pytest.raises(ValueError, match=r"targets\['w'\] has shape \(3,\).*belongs in loss_fun instead"):
    trainer.fit([(x, {'y': y, 'w': np.ones(3, np.float32)})], num_epoch=1)


def test_non_dict_aux_is_a_type_error():
  trainer = AccumBPTT(make_model('rnn'), lambda p, t: (bp.losses.mean_squared_error(p, t), [1.]),
                      loss_has_aux=True, num_micro_batch=2, progress_bar=False)
  with pytest.raises(TypeError, match=r'\(loss, dict of metrics\); its second item is a list'):
    trainer.fit(make_batches((4,)), num_epoch=1)


def test_stateful_training_needs_state_of_the_batch_size():
  trainer = make_trainer()
  trainer.target.reset(3)
  params = params_of(trainer.target)
  with pytest.raises(ValueError, match=r'reset_state=False.* holds 3 samples along its batch axis 0: batch 0 '
                                       r'\(6 samples\) does not fit it'):
    trainer.fit(make_batches((6,)), num_epoch=1, reset_state=False)
  assert_trees_close(params_of(trainer.target), params, rtol=0, atol=0)


@pytest.mark.parametrize('options', [dict(num_micro_batch=2), dict(num_micro_batch='auto', memory_budget='64MiB')],
                         ids=['N=2', 'auto'])
def test_model_that_fails_on_the_whole_batch_gives_bp_bptts_error(options):
  """(batch, features) inputs without a time axis, with micro-batches of 3 == n_in: each micro-batch's time
  slice passes for one unbatched sample and the failure surfaces in the loss as an unrelated AssertionError.
  The error raised is bp.BPTT's on the same data (the model's shape error), noted as such, before any change."""
  x, y = make_batches((6,))[0]
  batch = [(x[:, 0], y[:, 0])]
  with pytest.raises(Exception) as expected:
    bp.BPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
            progress_bar=False).fit(batch, num_epoch=1)
  trainer = AccumBPTT(make_model('rnn'), bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=0.05),
                      progress_bar=False, cache=False, **options)
  params, opt_state = params_of(trainer.target), optimizer_state(trainer)
  with pytest.raises(type(expected.value)) as raised:
    trainer.fit(batch, num_epoch=1)
  assert str(raised.value) == str(expected.value)
  if options['num_micro_batch'] == 2:  # ('auto' meets the error first on the whole batch: nothing to note)
    assert any('fails on the whole batch, as with bp.BPTT' in note for note in raised.value.__notes__)
  assert_trees_close(params_of(trainer.target), params, rtol=0, atol=0)
  assert_trees_close(optimizer_state(trainer), opt_state, rtol=0, atol=0)
