"""Hostile input, searched for with hypothesis rather than listed.

For every generated batch (shapes, dtypes, NaN and Inf, empty and disagreeing leaves, non-array leaves) the
rule is the one ``bp.BPTT`` sets: where ``bp.BPTT`` trains, ``AccumBPTT`` trains to the same parameters (NaN
where it gives NaN) or refuses with ``ValueError``/``TypeError``; where ``bp.BPTT`` fails, ``AccumBPTT`` refuses
with ``ValueError``/``TypeError``. A refusal leaves parameters and optimizer state exactly as they were.
Examples are derandomised so that CI sees the same cases every run.
"""

import os
import warnings

import brainpy as bp
import numpy as np
import pytest

hypothesis = pytest.importorskip('hypothesis')
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from brainpy_accum import AccumBPTT  # noqa: E402
from helpers import make_model, optimizer_state, params_of  # noqa: E402
from test_stateful_sizes import check_stateful_run, stateful_runs  # noqa: E402

pytestmark = pytest.mark.long  # the long suite (--long): CI runs it on one long leg (tests/conftest.py)

DTYPES = ['float32', 'float16', 'float64', 'int32', 'bool']
# Each training example compiles two trainers; CI runs 10 of them, BRAINPY_ACCUM_SEARCH=200 searches further.
FIT_EXAMPLES = int(os.environ.get('BRAINPY_ACCUM_SEARCH', 10))
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def _array(shape, dtype, special, seed):
  x = np.random.RandomState(seed).rand(*shape) * 2.
  if special == 'nan' and x.size:
    x.flat[0] = np.nan
  if special == 'inf' and x.size:
    x.flat[-1] = np.inf
  return x.astype(dtype)


@st.composite
def batches(draw):
  """One (inputs, targets) batch for a 3-input, 2-output network, hostile or not."""
  size = draw(st.sampled_from([0, 1, 2, 3, 5]))
  steps = draw(st.sampled_from([1, 3]))
  x = _array((size, steps, 3), draw(st.sampled_from(DTYPES)), draw(st.sampled_from(['', '', 'nan', 'inf'])), 0)
  target_size = draw(st.sampled_from([size, size, size, size + 1]))
  y = _array((target_size, steps, 2), draw(st.sampled_from(['float32', 'float32', 'int32', 'float16'])),
             draw(st.sampled_from(['', '', 'nan'])), 1)
  hostile = draw(st.sampled_from(['none', 'none', 'none', 'string_leaf', 'none_target', 'list_input',
                                  'scalar_target', 'rank1_input']))
  if hostile == 'string_leaf':
    y = 'targets'
  elif hostile == 'none_target':
    y = None
  elif hostile == 'list_input':
    x = x.tolist()
  elif hostile == 'scalar_target':
    y = np.float32(1.)
  elif hostile == 'rank1_input':
    x = x.reshape(-1)
  return x, y


def _run(cls, batch, **kwargs):
  trainer = cls(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False,
                **kwargs)
  before = params_of(trainer.target), optimizer_state(trainer)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      trainer.fit([batch], num_epoch=1)
  except Exception as error:  # noqa: BLE001 -- the test classifies every outcome
    return trainer, before, error
  return trainer, before, None


@settings(SETTINGS, max_examples=FIT_EXAMPLES)
@given(batch=batches(), num_micro_batch=st.sampled_from([1, 2, 3]))
def test_hostile_batches_train_as_bptt_or_are_refused_before_any_change(batch, num_micro_batch):
  reference, _, reference_error = _run(bp.BPTT, batch)
  trainer, before, error = _run(AccumBPTT, batch, num_micro_batch=num_micro_batch)
  if error is not None:
    assert isinstance(error, (ValueError, TypeError)), f'{type(error).__name__}: {error}'
    for a, b in zip(params_of(trainer.target) + optimizer_state(trainer), before[0] + before[1]):
      np.testing.assert_array_equal(a, b)
    return
  assert reference_error is None, f'bp.BPTT failed ({reference_error!r}) where AccumBPTT trained'
  for a, b in zip(params_of(trainer.target), params_of(reference.target)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


OPTION_VALUES = {
  'num_micro_batch': [0, -1, 2.5, '3', True, None, 'auto'],
  'micro_batch_size': [0, -2, 1.0, 'x', False],
  'grad_reduction': ['avg', 1, None],
  'memory_budget': ['lots', -5, 0, '1XB'],
  'remat': [-1, 0.5, 'yes'],
  'accumulate_steps': [0, -3, 1.5, {0: 0}, {-1: 2}, 'k'],
  'loss_weight_fn': ['f', 3],
  'clip_grad_norm': [0, -1., float('nan'), float('inf'), 'big'],
  'skip_nonfinite': ['no', 1],
  'target_batch_axis': [-1, 'a', 1.5],
  'whole_batch_loss': ['yes', 1, None],
  'mesh': ['mesh', 3],
  'data_first_axis': ['X', 1],
}


@SETTINGS
@given(options=st.dictionaries(st.sampled_from(sorted(OPTION_VALUES)), st.integers(0, 6), min_size=1, max_size=3))
def test_bad_constructor_options_raise_value_or_type_error_naming_one(options):
  kwargs = {name: OPTION_VALUES[name][i % len(OPTION_VALUES[name])] for name, i in options.items()}
  try:
    AccumBPTT(make_model('rnn'), 'mean_squared_error', **kwargs)
  except (ValueError, TypeError) as error:
    assert any(name in str(error) for name in kwargs) or 'num_micro_batch' in str(error), str(error)
  else:  # a combination that is valid after all must then train like bp.BPTT; only these are
    assert all(v in (None, 'auto', True, False) or name in ('accumulate_steps', 'remat') for name, v in kwargs.items()), kwargs


FIT_OPTION_VALUES = {
  'num_epoch': [-1, 1.5, '2', None],
  'num_report': ['x', 1.5, None],
  'reset_state': [1, 'no', None],
  'shared_args': ['fit', 3, ['fit']],
  'fun_after_report': [3, 'print'],
  'checkpoint': [3, 2.5, ['run.ckpt']],
  'checkpoint_every': [0, -1, 'k', 1.5],
}


@SETTINGS
@given(options=st.dictionaries(st.sampled_from(sorted(FIT_OPTION_VALUES)), st.integers(0, 3), min_size=1, max_size=3))
def test_bad_fit_options_are_refused_naming_one_before_any_change(options, tmp_path_factory):
  kwargs = {name: FIT_OPTION_VALUES[name][i % len(FIT_OPTION_VALUES[name])] for name, i in options.items()}
  if 'checkpoint_every' in kwargs and 'checkpoint' not in kwargs:
    kwargs['checkpoint'] = str(tmp_path_factory.mktemp('run') / 'run.ckpt')
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', num_micro_batch=2, progress_bar=False)
  before = params_of(trainer.target) + optimizer_state(trainer)
  with pytest.raises((ValueError, TypeError)) as caught:
    trainer.fit([(_array((2, 3, 3), 'float32', '', 0), _array((2, 3, 2), 'float32', '', 1))], **kwargs)
  assert any(name in str(caught.value) for name in kwargs), str(caught.value)
  for a, b in zip(params_of(trainer.target) + optimizer_state(trainer), before):
    np.testing.assert_array_equal(a, b)


def _data(kind: str, good, stop: int):
  """Training data of ``len(good)`` batches that misbehaves after ``stop`` of them, as ``kind`` says."""
  class ClaimsMore:  # a sized iterable that ends before its __len__ (a generator ending early)
    def __len__(self):
      return len(good) + 3

    def __iter__(self):
      return iter(good[:stop])

  def raises():
    yield from good[:stop]
    raise RuntimeError('the data source failed')

  def bad_item(item):
    def data():
      yield from good[:stop]
      yield item
    return data

  return {'ends_early': ClaimsMore(), 'raises': raises, 'triple': bad_item(good[0] + (good[0][1],)),
          'single_array': bad_item(good[0][0]), 'none_item': bad_item(None)}[kind]


@settings(SETTINGS, max_examples=FIT_EXAMPLES)
@given(kind=st.sampled_from(['ends_early', 'raises', 'triple', 'single_array', 'none_item']),
       stop=st.integers(0, 3), num_micro_batch=st.sampled_from([1, 2, 3]))
def test_misbehaving_data_trains_what_it_gave_then_refuses_or_reraises(kind, stop, num_micro_batch):
  """Data that ends early trains on what it gave; a source error passes through unchanged; a malformed batch
  is refused with ValueError/TypeError naming train_data. In every case the batches before were trained
  exactly as bp.BPTT trains them, and nothing after."""
  good = [(_array((3, 3, 3), 'float32', '', i), _array((3, 3, 2), 'float32', '', i + 10)) for i in range(4)]
  reference = bp.BPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False)
  reference.fit(good[:stop], num_epoch=1)
  trainer = AccumBPTT(make_model('rnn'), 'mean_squared_error', optimizer=bp.optim.Adam(lr=1e-2), progress_bar=False,
                      num_micro_batch=num_micro_batch)
  try:
    trainer.fit(_data(kind, good, stop), num_epoch=1)
  except RuntimeError as error:
    assert kind == 'raises' and str(error) == 'the data source failed'
  except (ValueError, TypeError) as error:
    assert kind in ('triple', 'single_array', 'none_item') and 'train_data' in str(error), str(error)
  else:
    assert kind == 'ends_early'
  for a, b in zip(params_of(trainer.target), params_of(reference.target)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  if kind == 'ends_early':
    assert len(trainer.get_hist_metric('fit', which='detailed')) == stop


# Each example builds a trainer; refused runs compile nothing. BRAINPY_ACCUM_SEARCH=150 searches further.
STATEFUL_EXAMPLES = int(os.environ.get('BRAINPY_ACCUM_SEARCH', 40))


@settings(SETTINGS, max_examples=STATEFUL_EXAMPLES)
@given(run=stateful_runs())
def test_stateful_runs_of_changing_sizes_searched_further(run):
  """With ``reset_state=False`` and batches of changing sizes, no error from inside JAX and no half-applied update:
  the quick search of ``test_stateful_sizes.py``, further (see its ``check_stateful_run``)."""
  check_stateful_run(run)
