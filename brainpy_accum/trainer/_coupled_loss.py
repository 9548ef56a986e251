"""The default mode's one-time check, at the first batch, that ``loss_fun`` is a mean over samples.

Accumulating micro-batch gradients trains the weighted mean (``'sum'``: the sum) of the micro-batch losses.
For a loss that couples the samples of a batch (a batch-wide regulariser, a maximum) that is another
objective. One forward pass of the first batch, cut as training cuts it, gives both the whole batch's loss
and the combination of the micro-batch losses, from the same predictions; if they differ, a warning says
by how much and points to ``whole_batch_loss=True``. The check changes nothing and never stops training.
"""

import warnings
from typing import Callable, Sequence

import brainpy.math as bm
import jax

from ..core._combine import finish_values
from ..core._cut import MicroBatchPlan, plan_micro_batches
from ..core._states import values_restored, whole_batch_variables
from ..core._two_pass import forward_pass

__all__ = ['check_first_batch', 'check_loss', 'warn_coupled_loss', 'whole_and_combined_loss']


def whole_and_combined_loss(forward: Callable, loss_of: Callable, weigh: Callable, args: tuple, axes,
                            plan: MicroBatchPlan, states, reduction: str):
  """``(loss of the whole batch, combination of the micro-batch losses)`` from one forward pass.

  ``forward(micro_args, size)`` gives what ``loss_of(outputs, targets) -> (loss, aux)`` receives; ``args``
  is ``(inputs, targets)``; ``states`` hold the whole batch.
  """
  micro_loss = lambda outputs, micro_args: loss_of(outputs, micro_args[1])
  sums, _ = forward_pass(forward, args, axes, plan, states, micro_loss, weigh)
  return loss_of(sums.samples, args[1])[0], finish_values(sums.loss_sum, sums.total_weight, reduction)


def check_loss(compare: Callable, variables: Sequence, plan: MicroBatchPlan, reduction: str) -> None:
  """Run ``compare() -> (whole, combined)``, give ``variables`` their values back, and warn if they differ.

  A check that fails warns instead of raising: it must never stop training that would run without it.
  """
  with values_restored(variables):
    try:
      whole, combined = compare()
    except Exception as error:
      warnings.warn(f'Could not check whether loss_fun is a mean over samples ({type(error).__name__}: '
                    f'{str(error)[:200]}); if it couples the samples of a batch, pass whole_batch_loss=True.',
                    UserWarning, stacklevel=5)  # fit's line
      return
  warn_coupled_loss(float(whole), float(combined), plan, reduction)


def warn_coupled_loss(whole: float, combined: float, plan: MicroBatchPlan, grad_reduction: str,
                      rtol: float = 1e-5, atol: float = 1e-6) -> bool:
  """Warn if the loss of the whole batch differs from the combination of its micro-batch losses.

  Both come from the same predictions, so a loss that is a weighted mean (``'sum'``: a sum) of per-sample
  terms agrees to float32 round-off; one that couples the samples does not. Returns whether it warned.
  """
  if abs(whole - combined) <= atol + rtol * abs(whole):
    return False
  how = 'sum' if grad_reduction == 'sum' else 'weighted mean'
  warnings.warn(f'loss_fun couples the samples of a batch: on the first batch its value on the whole batch is '
                f'{whole:.7g}, but the {how} of its values on the {plan.describe_cuts()} micro-batches is '
                f'{combined:.7g} (difference {whole - combined:.3g}). Accumulating micro-batch gradients would '
                f'train that other objective (e.g. a batch-wide firing-rate regulariser shrinks with the '
                f'micro-batch). Pass whole_batch_loss=True to train the whole-batch loss exactly (about one '
                f'extra forward pass), or make the loss a mean over samples.', UserWarning, stacklevel=2)
  return True


def check_first_batch(model, shared_args, inputs, targets, *, check_batch: Callable, plan_for: Callable,
                      forward: Callable, loss_of: Callable, weigh: Callable, variables: Sequence, jit: bool,
                      reduction: str) -> None:
  """Default mode, first batch: warn if the loss is not the weighted mean of its micro-batch values.

  ``check_batch(inputs, targets) -> BatchLayout``; ``plan_for(batch_size)``: the batch's micro-batches;
  ``forward(shared_args)``: the ``forward(micro_args, size)`` of :func:`whole_and_combined_loss`;
  ``loss_of(predicts, targets) -> (loss, aux)``; ``weigh(micro_args, size)``: a micro-batch's weight;
  ``variables``: what the check must leave as it found it; ``jit``: compile the forward pass.
  """
  layout = check_batch(inputs, targets)
  plan = plan_micro_batches(layout.batch_size, micro_batch_size=plan_for(layout.batch_size).micro_batch_size)
  if plan.num_micro_batches == 1:
    return

  def compare(shared_args, inputs, targets):
    layout = check_batch(inputs, targets)
    axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    with whole_batch_variables(model, layout.batch_size) as states:
      return whole_and_combined_loss(forward(shared_args), loss_of, weigh, (inputs, targets), axes, plan, states,
                                     reduction)

  compare = bm.jit(compare, static_argnums=(0,)) if jit else compare
  check_loss(lambda: compare(shared_args, inputs, targets), variables, plan, reduction)
