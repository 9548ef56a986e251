"""Metrics in the layouts a loss returns them in (issue 56): each one stitched into the array bp.BPTT records, or
refused by name before the first step; never an error from inside JAX.

The case that found it is BrainPy's gallery "Parametric Working Memory" (brainpy/examples,
``recurrent_networks/ParametricWorkingMemory.ipynb``): a ReLU rate RNN on time-major batches ``(T, B, n_in)``
with integer labels ``(T, B)``, whose loss flattens the outputs to ``(T * B, classes)`` (row ``t * B + b``) and
returns them, ``{'os': os}``. :class:`ReluRateRNN` is that model in small, written for the test.

The reference is ``bp.BPTT`` on the whole batch, from the same parameters on the same batches: the parameters
after every update and the detailed history of every metric (shape, dtype, values), to float32 round-off
(``assert_trees_close``). The layouts of :data:`LAYOUTS` are the ones a user writes: per sample, flattened
time-major and batch-major, transposed, masked, gathered by label, summed over samples, of a shape that does not
change, and their mixtures; :func:`check_layouts` says what each must give. A few fixed cases run here; the
search over them (hypothesis) runs in the long suite.
"""

import re
import warnings
from typing import Callable, Dict, NamedTuple, Sequence

import brainpy as bp
import brainpy.math as bm
import jax
import jax.numpy as jnp
import hypothesis
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from brainpy_accum import AccumBPTT, plan_micro_batches
from brainpy_accum.core._metrics import ORDERS, MetricRule, across_devices, combine_on_host, metric_rules, stitched_into
from helpers import assert_trees_close, params_of, streaming_budget

T, N_IN, N_OUT = 3, 3, 3  # T is never a batch size below, so the targets' batch axis is never ambiguous


class ReluRateRNN(bp.DynamicalSystem):
  """The gallery's rate RNN in small: ``h <- (1 - a) h + a relu(x W_ir + h W_rr + b_rr)``, read out
  ``h W_ro + b_ro``."""

  def __init__(self, n_in=N_IN, n_rec=8, n_out=N_OUT, alpha=0.5):
    super().__init__()
    self.alpha = alpha
    self.w_ir = bm.TrainVar(bp.init.parameter(bp.init.KaimingNormal(), (n_in, n_rec)))
    self.w_rr = bm.TrainVar(bp.init.parameter(bp.init.KaimingNormal(), (n_rec, n_rec)))
    self.b_rr = bm.TrainVar(bm.zeros(n_rec))
    self.w_ro = bm.TrainVar(bp.init.parameter(bp.init.KaimingNormal(), (n_rec, n_out)))
    self.b_ro = bm.TrainVar(bm.zeros(n_out))
    self.h = bm.Variable(bm.zeros((1, n_rec)), batch_axis=0)

  def reset_state(self, batch_size=1):
    self.h.value = bm.zeros((batch_size, self.h.shape[-1]))

  def update(self, x):
    self.h.value = (1 - self.alpha) * self.h + self.alpha * bm.relu(x @ self.w_ir + self.h @ self.w_rr + self.b_rr)
    return self.h @ self.w_ro + self.b_ro


def gallery_loss(predicts, targets):
  """The gallery's loss: the outputs flattened time-major, ``(T * B, 3)``, are the metric."""
  os = bm.reshape(predicts, (-1, predicts.shape[-1]))
  return bp.losses.cross_entropy_loss(os, bm.flatten(targets)), {'os': os}


def make_batches(count, batch, time_first=True, seed=0):
  """``count`` batches of ``batch`` samples: inputs ``(T, B, n_in)`` and integer labels ``(T, B)`` (batch-first:
  ``(B, T, ...)``)."""
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(count):
    x, y = rng.rand(T, batch, N_IN).astype('float32'), rng.randint(0, N_OUT, (T, batch))
    out.append((x, y) if time_first else (x.transpose(1, 0, 2).copy(), y.T.copy()))
  return out


class Run(NamedTuple):
  initial: list    # the parameters before fit
  params: list     # after it
  history: dict    # metric -> its detailed history
  warnings: list   # every warning's text
  error: Exception = None


def train(cls, loss, data, time_first=True, lr=0.05, num_epoch=1, trainers=None, test_data=None, **options) -> Run:
  """Fit a fresh :class:`ReluRateRNN` (the same parameters every call) with ``cls``; a refusal is returned, not
  raised. ``trainers``, given, receives the trainer; the history of ``test_data`` is under ``'test:' + name``."""
  bm.random.seed(0)
  with bm.training_environment():
    model = ReluRateRNN()
  initial = params_of(model)
  trainer = cls(model, loss, optimizer=bp.optim.Adam(lr=lr), loss_has_aux=True, progress_bar=False,
                data_first_axis='T' if time_first else 'B', **options)
  if trainers is not None:
    trainers.append(trainer)
  error = None
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    try:
      trainer.fit(data, test_data=test_data, num_epoch=num_epoch)
    except Exception as raised:  # noqa: BLE001 -- check_layouts classifies every outcome
      error = raised
  history = {} if error else {name: trainer.get_hist_metric('fit', name, 'detailed')
                              for name in trainer._detailed_train_metrics}
  if test_data is not None and not error:
    history.update({f'test:{name}': trainer.get_hist_metric('test', name, 'detailed')
                    for name in trainer._detailed_test_metrics})
  return Run(initial, params_of(model), history, [str(w.message) for w in caught], error)


def test_gallery_outputs_flattened_time_major_train_and_record_as_bptt():
  """The gallery's ``{'os': os}``, ``(T * B, 3)`` rows ``t * B + b``, on batches of 10 cut 4 + 4 + 2: the
  parameters after three updates and the recorded ``os`` (every batch's, interleaved as bp.BPTT's) equal bp.BPTT's,
  and nothing warns (it stopped at the first step with JAX's dynamic_update_slice error)."""
  data = make_batches(3, 10)
  expected = train(bp.BPTT, gallery_loss, data)
  run = train(AccumBPTT, gallery_loss, data, num_micro_batch=3)
  assert run.error is None, run.error
  assert run.history['os'].shape == (3, T * 10, N_OUT)
  assert_trees_close(run.params, expected.params)
  assert_trees_close(run.history, expected.history)
  assert not [w for w in run.warnings if 'metric' in w or 'couples' in w], run.warnings


# ---------------------------------------------------------------- the layouts a user writes

class Layout(NamedTuple):
  of: Callable      # of(p, y): the metric, from the time-major outputs p (T, B, 3) and labels y (T, B)
  outcome: str      # 'equal': bp.BPTT's; 'refused': a ValueError naming it; 'warned': no combination gives
  #                   bp.BPTT's value, so a warning names it (or, where the micro-batch sizes change its shape, a
  #                   refusal)


LAYOUTS: Dict[str, Layout] = {
  'per_sample': Layout(lambda p, y: p[-1], 'equal'),                                   # (B, 3)
  'per_step': Layout(lambda p, y: p[..., 0], 'equal'),                                 # (T, B)
  'time_major': Layout(lambda p, y: p.reshape(-1, p.shape[-1]), 'equal'),             # (T * B, 3), the gallery's
  'batch_major': Layout(lambda p, y: p.transpose(1, 0, 2).reshape(-1, p.shape[-1]), 'equal'),  # (B * T, 3)
  'transposed': Layout(lambda p, y: p.transpose(2, 1, 0), 'equal'),                    # (3, B, T)
  'masked': Layout(lambda p, y: jnp.where((y == 1)[..., None], p, 0.), 'equal'),       # samples of label 1
  'masked_flat': Layout(lambda p, y: jnp.where(y == 1, p[..., 0], jnp.nan).reshape(-1), 'equal'),  # NaN elsewhere
  'by_label': Layout(lambda p, y: jnp.take_along_axis(p, y[..., None], -1)[..., 0], 'equal'),  # (T, B)
  'by_label_flat': Layout(lambda p, y: jnp.take_along_axis(p, y[..., None], -1).reshape(-1), 'equal'),
  'labels_batch_major': Layout(lambda p, y: y.T.reshape(-1), 'equal'),                 # (B * T,) int, targets only
  'two_blocks': Layout(lambda p, y: jnp.concatenate([p[-1, :, 0], p[0, :, 1]]), 'equal'),  # (2 B,) time-major
  'repeated': Layout(lambda p, y: jnp.repeat(p[-1, :, 0], 2), 'equal'),                # (2 B,) batch-major
  'class_sums': Layout(lambda p, y: p.sum((0, 1)), 'equal'),                           # (3,): a sum over samples
  'n_correct': Layout(lambda p, y: (jnp.argmax(p, -1) == y).sum(), 'equal'),           # an int32 count
  'largest': Layout(lambda p, y: p.max(), 'equal'),
  'mean_out': Layout(lambda p, y: p.mean(), 'equal'),
  'pairwise': Layout(lambda p, y: p[-1] @ p[-1].T, 'refused'),                         # (B, B)
  'padded': Layout(lambda p, y: jnp.concatenate([p[-1, :, 0], jnp.zeros(1)]), 'refused'),  # (B + 1,)
  'take_by_label': Layout(lambda p, y: jnp.take(p[-1], y[-1], axis=0), 'refused'),     # (B, 3): rows of samples 0-2
  'running_sum': Layout(lambda p, y: jnp.cumsum(p[-1, :, 0]), 'refused'),
  'normalised': Layout(lambda p, y: p[-1, :, 0] / p[-1, :, 0].sum(), 'refused'),
  'zeros_flat': Layout(lambda p, y: jnp.zeros(p.shape[0] * p.shape[1]), 'refused'),   # (T * B,): order unknowable
  'first_two': Layout(lambda p, y: p[-1, :2], 'warned'),                               # (2, 3): a shape that stays
  'spread': Layout(lambda p, y: p.std(), 'warned'),
}


STITCHED = sorted(name for name, layout in LAYOUTS.items() if layout.outcome == 'equal' and name not in (
  'class_sums', 'n_correct', 'largest', 'mean_out'))


def layout_loss(names: Sequence[str], time_first: bool):
  """Cross entropy of the outputs, and the metrics ``{f'{layout}_{i}': ...}`` of the layouts ``names``."""

  def loss(predicts, targets):
    p, y = bm.as_jax(predicts), bm.as_jax(targets)
    if not time_first:
      p, y = p.transpose(1, 0, 2), y.T
    value = bp.losses.cross_entropy_loss(p.reshape(-1, p.shape[-1]), y.reshape(-1))
    return value, {f'{name}_{i}': LAYOUTS[name].of(p, y) for i, name in enumerate(names)}

  return loss


def _named(error: Exception) -> str:
  """The layout of the metric a refusal names."""
  found = re.match(r"The metric metrics\['(\w+)_\d+'\] has shape \(.*\) for a micro-batch of \d+ samples and "
                   r'\(.*\) for one of \d+: ', str(error))
  assert found, f'{type(error).__name__}: {error}'
  return found.group(1)


def check_layouts(names: Sequence[str], time_first=True, batch=5, **options) -> str:
  """Train on two batches with metrics in the layouts ``names``; AccumBPTT's default mode must give bp.BPTT's
  parameters and the history of every metric of outcome ``'equal'`` (without a warning), warn by name of each
  ``'warned'`` one that does not equal bp.BPTT's, and refuse every run with a ``'refused'`` one: a ``ValueError``
  naming a metric that is not ``'equal'``, its shapes and ``whole_batch_loss=True``, with the parameters as they
  were. Never another error. A batch in one micro-batch is bp.BPTT's step: every metric equals bp.BPTT's.
  Returns what happened."""
  loss, data = layout_loss(names, time_first), make_batches(2, batch, time_first)
  run = train(AccumBPTT, loss, data, time_first, **options)
  cut = plan_micro_batches(batch, **options).num_micro_batches > 1
  outcome = {name: LAYOUTS[name].outcome if cut else 'equal' for name in names}
  if run.error is not None:
    assert isinstance(run.error, ValueError), f'{type(run.error).__name__}: {run.error}'
    assert outcome[_named(run.error)] != 'equal', f'refused a layout it can stitch: {run.error}'
    assert 'whole_batch_loss=True' in str(run.error), run.error
    assert_trees_close(run.params, run.initial, rtol=0, atol=0)
    return 'refused'
  assert 'refused' not in outcome.values(), f'trained metrics it must refuse: {names}'
  expected = train(bp.BPTT, loss, data, time_first)
  assert_trees_close(run.params, expected.params)
  for i, name in enumerate(names):
    key = f'{name}_{i}'
    warned = [w for w in run.warnings if w.startswith(f"The metric metrics['{key}']")]
    if warned:  # (a 'warned' one that equals bp.BPTT's at these sizes, p[-1, :2] of a batch of 2, need not warn)
      assert outcome[name] == 'warned', (key, warned)
      continue
    got, want = run.history[key], expected.history[key]
    assert got.shape == want.shape and got.dtype == want.dtype, (key, got.shape, got.dtype, want.shape, want.dtype)
    assert_trees_close(got, want)
  return 'trained'


@pytest.mark.parametrize('names, options, outcome', [
  (['batch_major', 'transposed', 'masked_flat', 'by_label', 'labels_batch_major', 'two_blocks', 'repeated',
    'class_sums', 'n_correct'], dict(num_micro_batch=2), 'trained'),
  (['time_major', 'take_by_label'], dict(micro_batch_size=2), 'refused'),
  (['padded'], dict(num_micro_batch=2), 'refused'),
  (['per_sample', 'zeros_flat'], dict(num_micro_batch=3), 'refused'),
], ids=['stitched', 'rows-of-other-samples', 'shape', 'order-unknowable'])
def test_layouts_users_write_are_stitched_or_refused_by_name(names, options, outcome):
  """A few fixed cases of the search below: several layouts stitched together (batch-major, transposed, masked
  with NaN, gathered by label, labels only, two blocks, repeated) beside sums; refusals by values (a gather across
  samples; rows alike in both orders) and by shape."""
  assert check_layouts(names, time_first=True, batch=5, **options) == outcome


@pytest.mark.long  # the long suite (--long): about 3 s an example
@settings(max_examples=10, deadline=None, derandomize=True, print_blob=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(names=st.lists(st.sampled_from(sorted(LAYOUTS) + STITCHED), min_size=1, max_size=3),  # stitched: twice
       time_first=st.booleans(), batch=st.sampled_from([4, 5, 7]),
       options=st.sampled_from([dict(num_micro_batch=2), dict(num_micro_batch=3), dict(micro_batch_size=1),
                                dict(micro_batch_size=2)]))
def test_search_of_layouts_finds_no_jax_error_and_no_silent_difference(names, time_first, batch, options):
  hypothesis.event(check_layouts(names, time_first, batch, **options))


def test_a_refused_metric_is_refused_again_by_the_next_fit():
  """The check that refused a metric runs again at the next fit of the same trainer: skipped, the step would
  stitch the metric unchecked."""
  bm.random.seed(0)
  with bm.training_environment():
    model = ReluRateRNN()
  trainer = AccumBPTT(model, layout_loss(['take_by_label'], True), loss_has_aux=True, data_first_axis='T',
                      num_micro_batch=2, progress_bar=False)
  for _ in range(2):
    with pytest.raises(ValueError, match=r"The metric metrics\['take_by_label_0'\] .* depend on other samples"):
      trainer.fit(make_batches(1, 5), num_epoch=1)


# ---------------------------------------------------------------- the rules, without a trainer

def _shape(*dims):
  return jax.ShapeDtypeStruct(dims, jnp.float32)


def test_rows_per_sample_are_told_from_two_shapes_and_other_changes_are_refused_with_them():
  small = {'flat': _shape(T * 4, 3), 'fixed': _shape(3), 'mid': _shape(3, 4, T)}
  large = {'flat': _shape(T * 2, 3), 'fixed': _shape(3), 'mid': _shape(3, 2, T)}
  plan = metric_rules(small, large, (4, 2), {}, 'mean', 10, found={"['flat']": 'batch-major'})
  assert plan.rules == [MetricRule(None, 'mean'), MetricRule(0, 'stitch', T, 'batch-major'), MetricRule(1, 'stitch')]
  assert [s.shape for s in plan.stitched_like] == [(T * 10, 3), (3, 10, T)]
  for shapes, why in [(((5,), (3,)), r'its axis 0 holds 5 rows for 4 samples and 3 for 2, not the same whole number'),
                      (((4, 4), (2, 2)), r'it changes on axes \[0, 1\]'),
                      (((16,), (4,)), r'its axis 0 holds 16 rows for 4 samples and 4 for 2')]:
    shown = re.escape(f"The metric metrics['m'] has shape {shapes[0]} for a micro-batch of 4 samples and {shapes[1]} "
                      f'for one of 2: ')
    with pytest.raises(ValueError, match=f'{shown}{why}.*whole_batch_loss=True.*per sample'):
      metric_rules({'m': _shape(*shapes[0])}, {'m': _shape(*shapes[1])}, (4, 2), {}, 'mean', 10)


@pytest.mark.parametrize('order', ORDERS)
def test_micro_batches_streamed_chunks_and_devices_put_rows_where_the_whole_batch_has_them(order):
  """A ``(T * B, 2)`` metric flattened in ``order``: written micro-batch by micro-batch (10 = 4 + 4 + 2), joined
  chunk by chunk on the host, and gathered from 5 devices (``vmap`` stands for the mesh axis), it is the whole
  batch's array: for time-major, each part's blocks interleaved with the others', not appended."""
  whole = np.arange(T * 10 * 2, dtype=np.float32).reshape(T, 10, 2)  # (T, B, 2): sample b's rows hold b
  flat = lambda x: (x if order == ORDERS[0] else x.transpose(1, 0, 2)).reshape(-1, 2)  # noqa: E731
  rule = MetricRule(0, 'stitch', T, order)
  buffer, start = [jnp.zeros((T * 10, 2))], 0
  for size in plan_micro_batches(10, num_micro_batch=3).sizes:
    buffer = stitched_into(buffer, [rule], start, [flat(whole[:, start:start + size])])
    start += size
  np.testing.assert_array_equal(buffer[0], flat(whole))
  chunks = [{'m': flat(whole[:, a:b])} for a, b in ((0, 3), (3, 7), (7, 10))]
  np.testing.assert_array_equal(combine_on_host(chunks, [3., 4., 3.], [3, 4, 3], [rule], True)['m'], flat(whole))
  shares = jnp.stack([flat(whole[:, 2 * d:2 * d + 2]) for d in range(5)])
  gathered = jax.vmap(lambda x: across_devices([x], [rule], 'devices'), axis_name='devices')(shares)[0]
  np.testing.assert_array_equal(gathered[3], flat(whole))


# ---------------------------------------------------------------- windows, streamed batches

@pytest.mark.long  # the long suite (--long): README suite time
def test_window_records_the_gallery_outputs_of_every_batch():
  """``accumulate_steps=2`` at a learning rate of 0 (every batch at the same parameters, so bp.BPTT's history is
  the reference batch by batch): the time-major and batch-major metrics of every batch of the window, and of
  the test batches (9 samples, 3 x 3), are bp.BPTT's."""
  loss, data, test = layout_loss(['time_major', 'batch_major'], True), make_batches(4, 7), make_batches(2, 9, seed=1)
  expected = train(bp.BPTT, loss, data, lr=0., test_data=test)
  run = train(AccumBPTT, loss, data, lr=0., test_data=test, num_micro_batch=3, accumulate_steps=2)
  assert run.error is None, run.error
  assert run.history.keys() == expected.history.keys() and 'test:batch_major_1' in run.history
  assert_trees_close(run.history, expected.history)


@pytest.mark.long  # the long suite (--long): the planner's search of the chunks
def test_streamed_chunks_join_the_gallery_outputs_as_bptt_records_them():
  """Batches larger than the budget stream from the host in chunks of 2, whose metrics join on the host: the
  time-major metric's chunks interleave block by block, the batch-major one's follow one another; bp.BPTT's
  parameters and history."""
  loss, data = layout_loss(['time_major', 'batch_major'], time_first=False), make_batches(2, 10, time_first=False)
  bm.random.seed(0)
  with bm.training_environment():
    model = ReluRateRNN()
  options = dict(loss_has_aux=True, target_batch_axis=0, num_micro_batch='auto')  # (a chunk of 3 would be (3, T))
  probe = AccumBPTT(model, loss, memory_budget='1GiB', progress_bar=False, **options)
  trainers = []
  expected = train(bp.BPTT, loss, data, time_first=False)
  run = train(AccumBPTT, loss, data, time_first=False, memory_budget=streaming_budget([probe], data, chunk=2),
              trainers=trainers, **{k: v for k, v in options.items() if k != 'loss_has_aux'})
  assert run.error is None, run.error
  assert trainers[0].stream_chunks == {10: 2}
  assert_trees_close(run.params, expected.params)
  assert_trees_close(run.history, expected.history)
