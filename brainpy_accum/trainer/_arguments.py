"""Eager checks of user arguments: each error names the argument, shows the value and says what to do.

Where :class:`brainpy.BPTT` raises one of BrainPy's own classes for a mistake, ``AccumBPTT`` raises a class that
derives from it *and* from the built-in ``ValueError`` / ``TypeError`` that says what kind of mistake it is
(:class:`RemovedArgumentError`, :class:`BareBatchError`, :class:`ReportCallbackError`), so ``except`` clauses
written for ``bp.BPTT`` still catch them.
"""

import math
import warnings
from typing import Any, Callable, Iterator, List, Optional, Tuple

import brainpy.math as bm
import brainstate
import numpy as np
from brainpy._errors import NoLongerSupportError, UnsupportedError

from ..checkpoint._resume import check_checkpoint_args
from ..core._combine import check_grad_reduction, check_loss_weight_fn
from ..core._cut import check_cut, check_positive_int, is_int
from ..core._mesh import UnevenSplitError
from ..core._metrics import check_aux_reduction
from ..memory._budget import parse_memory
from ..memory._device import as_fraction
from ._feed import as_pair, holds_batches

__all__ = ['BareBatchError', 'DataFirstAxisError', 'RemovedArgumentError', 'ReportCallbackError', 'carried_states',
           'check_accumulation_args', 'check_fit_call', 'check_carried_batch', 'check_carried_sizes', 'check_data',
           'check_fit_args', 'check_listed_batches', 'check_remat', 'check_trainer_args', 'check_update_args',
           'check_whole_batch_loss', 'warn_batch_statistics', 'warn_inexact', 'warn_sample_monitors']


class RemovedArgumentError(TypeError, NoLongerSupportError):
  """An argument that :class:`brainpy.BPTT` no longer supports (BrainPy raises ``NoLongerSupportError``)."""


class BareBatchError(TypeError, UnsupportedError):
  """Training data given as one bare ``(X, Y)`` pair (BrainPy raises ``UnsupportedError``)."""


class ReportCallbackError(TypeError, AssertionError):
  """A ``fun_after_report`` that cannot be called (BrainPy fails an ``assert``, hence ``AssertionError``)."""


class DataFirstAxisError(ValueError, AssertionError):
  """A ``data_first_axis`` other than ``'B'``, ``'T'`` or ``None`` (BrainPy fails an ``assert``, hence
  ``AssertionError``)."""


def check_trainer_args(*, num_micro_batch, micro_batch_size, grad_reduction, target_batch_axis, memory_budget,
                       remat, mesh, whole_batch_loss, loss_weight_fn, clip_grad_norm, skip_nonfinite,
                       accumulate_steps, aux_reduction, loss_has_aux: bool, data_first_axis=None):
  """Every accumulation option of :class:`AccumBPTT`, before anything is built, and BrainPy's
  ``data_first_axis`` (which BrainPy checks with an ``assert``); returns ``num_micro_batch`` (``1`` where neither
  it nor ``micro_batch_size`` is given: bp.BPTT's whole-batch step) and the checked ``aux_reduction``."""
  if data_first_axis is not None and (not isinstance(data_first_axis, str) or data_first_axis not in ('B', 'T')):
    raise DataFirstAxisError(f"{data_first_axis=} must be 'B' (data shaped (batch, time, ...)), 'T' ((time, "
                             f"batch, ...)) or None (BrainPy's default: 'B' for a model in batching mode).")
  if remat == 'auto' and mesh is not None:
    raise ValueError("remat='auto' is not supported with a mesh (its trial steps run unsharded): choose remat=True "
                     "or False with mesh=..., or drop the mesh.")
  check_whole_batch_loss(whole_batch_loss, grad_reduction, loss_weight_fn, accumulate_steps)
  if num_micro_batch is None and micro_batch_size is None:
    num_micro_batch = 1
  check_accumulation_args(num_micro_batch, micro_batch_size, grad_reduction, target_batch_axis, memory_budget)
  check_remat(remat, num_micro_batch, memory_budget)
  check_update_args(grad_reduction, loss_weight_fn, clip_grad_norm, skip_nonfinite)
  checked = check_aux_reduction(aux_reduction)
  if checked and not loss_has_aux:
    raise ValueError(f'{aux_reduction=} declares how metrics combine, but there are none without '
                     f'loss_has_aux=True (loss_fun returning (loss, dict of metrics)). Pass loss_has_aux=True or '
                     f'drop aux_reduction.')
  return num_micro_batch, checked


def check_accumulation_args(num_micro_batch, micro_batch_size, grad_reduction, target_batch_axis,
                            memory_budget) -> None:
  """Validate the accumulation options of :class:`AccumBPTT`."""
  if num_micro_batch is not None and micro_batch_size is not None:
    check_cut(num_micro_batch, micro_batch_size)  # raises: exactly one of them
  if num_micro_batch == 'auto':
    if memory_budget is not None and as_fraction(memory_budget) is None:
      parse_memory(memory_budget)  # (None or a share: the device's memory, checked when the budget is made)
  elif memory_budget is not None:
    raise ValueError(f"{memory_budget=} is only used with num_micro_batch='auto'; got {num_micro_batch=} "
                     f"and {micro_batch_size=}.")
  else:
    check_cut(num_micro_batch, micro_batch_size)
  check_grad_reduction(grad_reduction)
  if target_batch_axis is not None:
    if not is_int(target_batch_axis) or target_batch_axis < 0:
      raise ValueError(f'{target_batch_axis=} must be None (follow data_first_axis) or a non-negative int.')


def check_remat(remat, num_micro_batch=None, memory_budget=None) -> None:
  """``remat`` is a bool, a positive int (steps per checkpointed segment), or ``'auto'`` with the memory planner."""
  if isinstance(remat, bool):
    return
  if isinstance(remat, str) and remat == 'auto':
    if num_micro_batch != 'auto':
      raise ValueError(f"remat='auto' lets the memory planner choose remat together with the micro-batches, so it "
                       f"needs num_micro_batch='auto' and a memory_budget; got {num_micro_batch=} and "
                       f"{memory_budget=}. Add num_micro_batch='auto' (and on a CPU memory_budget='2GiB'; on a "
                       f"GPU or TPU the device's own memory is the budget), or choose remat=True or False yourself.")
    return
  check_positive_int('remat', remat, "Use remat=True (segments of sqrt(T) steps), an int segment length, False, or "
                                     "'auto' (with num_micro_batch='auto').")


def check_update_args(grad_reduction, loss_weight_fn, clip_grad_norm, skip_nonfinite) -> None:
  """Validate ``loss_weight_fn``, ``clip_grad_norm`` and ``skip_nonfinite``."""
  check_loss_weight_fn(loss_weight_fn, grad_reduction, 'loss_weight_fn(inputs, targets)')
  if clip_grad_norm is not None:
    if isinstance(clip_grad_norm, (bool, np.bool_)) or not isinstance(clip_grad_norm, (int, float, np.integer, np.floating)):
      raise TypeError(f'{clip_grad_norm=} must be a positive number (the maximal global L2 norm) or None.')
    if not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0:
      raise ValueError(f'{clip_grad_norm=} must be a positive, finite number, e.g. clip_grad_norm=1.0.')
  if not isinstance(skip_nonfinite, bool):
    raise TypeError(f'{skip_nonfinite=} must be True or False.')


def check_whole_batch_loss(whole_batch_loss, grad_reduction, loss_weight_fn, accumulate_steps) -> None:
  """Refuse ``whole_batch_loss`` where it is not a bool or cannot be exact, before anything is built."""
  if not isinstance(whole_batch_loss, bool):
    raise TypeError(f'whole_batch_loss={whole_batch_loss!r} must be True or False.')
  if not whole_batch_loss:
    return
  if accumulate_steps != 1:
    raise ValueError(f'whole_batch_loss=True with accumulate_steps={accumulate_steps!r} cannot be exact: the loss '
                     f'of several batches together is not known from their separate losses when it couples '
                     f'samples. Use one larger batch and more micro-batches (num_micro_batch), or '
                     f'accumulate_steps=1.')
  if grad_reduction != 'mean' or loss_weight_fn is not None:
    raise ValueError(f'whole_batch_loss=True evaluates loss_fun once on the whole batch, so it needs no '
                     f'weighting: drop grad_reduction={grad_reduction!r} and loss_weight_fn={loss_weight_fn!r} '
                     f'(keep the defaults).')


def warn_inexact(model, monitors: Optional[dict] = None) -> None:
  """At construction: warn of the model's parts that micro-batches cannot make exact (batch statistics, monitors
  that pick samples)."""
  warn_batch_statistics(model)
  warn_sample_monitors(model, monitors or {})


def warn_sample_monitors(model, monitors: dict) -> None:
  """Warn of each monitor ``(Variable, index)`` whose index picks samples: entries along axis 0 of a Variable
  whose batch axis is 0, in batching mode. In a micro-batch it picks that micro-batch's samples, not the batch's
  (a loss reading samples 0 and 1 reads other samples in every micro-batch), and nothing else can tell."""
  if not isinstance(getattr(model, 'mode', None), bm.BatchingMode):
    return
  for name, monitor in monitors.items():
    if not isinstance(monitor, tuple) or len(monitor) != 2 or monitor[1] is None:
      continue
    variable, index = monitor
    if getattr(variable, 'batch_axis', None) == 0:
      warnings.warn(f'Monitor {name!r} takes entries {np.asarray(index).tolist()} along axis 0 of a Variable whose '
                    f'batch axis is 0: samples of the batch. In each micro-batch it takes that micro-batch\'s '
                    f'samples, so a loss_fun that reads it trains another objective than bp.BPTT (with '
                    f'whole_batch_loss=True too). Monitor the whole Variable and take the samples in loss_fun, with '
                    f'whole_batch_loss=True, which puts the micro-batches\' monitors together first.',
                    UserWarning, stacklevel=4)


def warn_batch_statistics(model) -> None:
  """Warn once per model class when layers keep batch statistics, which see micro-batches, not the batch."""
  kinds = sorted({type(node).__name__ for node in model.nodes().unique().values() if 'BatchNorm' in type(node).__name__})
  if kinds:
    warnings.warn(f'{type(model).__name__} has batch-statistics layers ({", ".join(kinds)}): under micro-batching '
                  f'they normalise each micro-batch with its own statistics, and their running averages keep one '
                  f'micro-batch\'s update, so training is not equivalent to whole-batch bp.BPTT. Use num_micro_batch=1 '
                  f'(and accumulate_steps=1), or layers without batch statistics (e.g. LayerNorm), for exact results.',
                  UserWarning, stacklevel=3)


def check_fit_args(num_epoch, num_report, reset_state, fun_after_report, batch_size=None, shared_args=None) -> None:
  """Validate the loop arguments of :meth:`AccumBPTT.fit`."""
  if batch_size is not None:
    raise RemovedArgumentError(f'fit({batch_size=}) is no longer supported (neither by bp.BPTT): give the data as '
                               f'an iterable of (inputs, targets) batches of the size you want, e.g. '
                               f'[(X[i:i + {batch_size}], Y[i:i + {batch_size}]) for i in range(0, len(X), {batch_size})].')
  if not is_int(num_epoch) or num_epoch < 0:
    raise ValueError(f'{num_epoch=} must be a non-negative int.')
  if not is_int(num_report):
    raise TypeError(f'{num_report=} must be an int: -1 reports once per epoch, k > 0 every k steps.')
  if not isinstance(reset_state, bool):
    raise TypeError(f'{reset_state=} must be True or False.')
  if shared_args is not None and not isinstance(shared_args, dict):
    raise TypeError(f'shared_args={shared_args!r} must be a dict of arguments shared by the model, or None.')
  if fun_after_report is not None and not callable(fun_after_report):
    raise ReportCallbackError(f'{fun_after_report=} must be callable as fun_after_report(idx, metrics, phase).')


def check_fit_call(train_data, test_data, num_epoch, num_report, reset_state, shared_args, fun_after_report,
                   batch_size, checkpoint, checkpoint_every) -> Optional[int]:
  """Every argument of :meth:`AccumBPTT.fit`, before anything runs; returns ``checkpoint_every`` (``None``: a
  checkpoint at each epoch's end only)."""
  check_fit_args(num_epoch, num_report, reset_state, fun_after_report, batch_size, shared_args)
  checkpoint_every = check_checkpoint_args(checkpoint, checkpoint_every)
  check_data('train_data', train_data)
  if test_data is not None:
    check_data('test_data', test_data)
  return checkpoint_every


def check_data(name: str, data) -> None:
  """Reject a bare ``(X, Y)`` pair, which :meth:`fit` would otherwise iterate sample by sample."""
  if callable(data):
    return
  if not hasattr(data, '__iter__') and not hasattr(data, '__getitem__'):  # (Python iterates either)
    raise TypeError(f'{name} must be an iterable of (inputs, targets) batches or a callable returning one; '
                    f'got {type(data).__name__}.')
  if isinstance(data, (tuple, list)) and len(data) == 2 and all(hasattr(d, 'shape') or isinstance(d, dict)
                                                               for d in data):
    raise BareBatchError(f'{name} looks like one bare (X, Y) pair. Give an iterable of batches instead, '
                    f'e.g. {name}=[(X, Y)] for a single batch.')


# ------------------------------------------------------------------ reset_state=False: batches of the state's size


def carried_states(model) -> List[Tuple[str, int, int]]:
  """``(name, batch axis, samples)`` of each model state that ``fit(reset_state=False)`` carries into the next
  batch: the brainpy Variables with a ``batch_axis``, not trainable, not random keys. Empty for a model without
  batched state, which takes batches of any size."""
  found = []
  for name, var in model.vars().unique().items():
    axis = getattr(var, 'batch_axis', None)
    if axis is None or isinstance(var, (bm.TrainVar, brainstate.random.RandomState)):
      continue
    shape = np.shape(var.value)
    if len(shape) > axis:
      found.append((name, axis, shape[axis]))
  return found


def _carrying(name: str, axis: int, samples: int) -> str:
  built = (' (a model is built with states of one sample: one never reset at the batch size holds 1)'
           if samples == 1 else '')
  return (f'with reset_state=False each batch continues, sample by sample, the model state it finds, and model '
          f'state {name} holds {_samples(samples)} along its batch axis {axis}{built}')


def _samples(n: int) -> str:
  return f'{n} sample{"s" * (n != 1)}'


def check_carried_batch(model, batch_size: int, data_name: str, position: int) -> None:
  """With ``reset_state=False``: a batch of ``batch_size`` samples fits the model state it continues, or a
  ``ValueError`` naming the sizes, before the batch changes anything (:class:`brainpy.BPTT` fails there too, inside
  JAX: its time loop cannot carry a state of another size)."""
  for name, axis, samples in carried_states(model):
    if samples != batch_size:
      raise ValueError(f'Batch {position} of {data_name} has {batch_size} samples, but {_carrying(name, axis, samples)}'
                       f'. Reset the model at the batch size first (model.reset({batch_size})), fit with '
                       f'reset_state=True (each batch starts from a state reset at its size), or give batches of '
                       f'{_samples(samples)}. Nothing of this batch has run.')


def _listed_pairs(data) -> Iterator[Tuple[int, Any, Any]]:
  """``(position, inputs, targets)`` of each batch of a source that holds its batches already (a list, a tuple, a
  stacked array: :func:`~brainpy_accum.trainer._feed.holds_batches`), up to a malformed one, which the loop refuses
  when it reaches it, as bp.BPTT would; nothing for any other source (a generator, a callable, a dataset object
  that loads or draws each batch: read ahead it would load twice or draw other batches), which the loop checks
  batch by batch."""
  for position, batch in enumerate(map(as_pair, data) if holds_batches(data) else ()):
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
      return
    yield position, batch[0], batch[1]


def check_listed_batches(model, batch_size_of: Callable[[Any, Any], int], carried: bool, shared: bool,
                         resume: Callable[[], bool], **data_sets) -> bool:
  """Every batch of each data set given as a sequence (``train_data=..., test_data=...``), before the first
  update, so that no run stops half-trained at a batch it cannot take; ``resume()`` (which loads a checkpoint, if
  any, and says whether it did) is called between the two checks, and what it returned is returned:

  - first, on a mesh (``shared``), each batch of a list, tuple or array (batches already in memory: a dataset
    object that loads or draws each batch is not read ahead, :func:`_listed_pairs`) is checked by
    ``batch_size_of`` (which refuses one that does not split over the devices), and an error is raised naming its
    place: nothing has changed then;
  - then, with ``reset_state=False`` (``carried``), each must have the size of the model state it continues,
    which a checkpoint just loaded may have set (:func:`check_carried_sizes`).

  Generators and callables are checked batch by batch."""
  with brainstate.environ.context(fit=True):  # (the check may trace the model, which may read the setting)
    for data_name, data in data_sets.items() if shared else ():
      for position, inputs, targets in _listed_pairs(data):
        try:
          batch_size_of(inputs, targets)
        except UnevenSplitError as error:
          raise UnevenSplitError(f'Batch {position} of {data_name}: {error} Checked before training: nothing has '
                                 f'changed.') from error
        except (ValueError, TypeError):
          break  # (as above: the loop's own checks say it better, in their turn)
    resumed = resume()
    if carried:
      check_carried_sizes(model, batch_size_of, loaded=resumed, **data_sets)
  return resumed


_LOADED = "nothing has trained (the checkpoint was loaded, and the model state continued is its own)"


def check_carried_sizes(model, batch_size_of: Callable[[Any, Any], int], loaded: bool = False,
                        **data_sets) -> None:
  """With ``reset_state=False``, before the first update: every batch of each data set given as a list, tuple or
  array (``train_data=..., test_data=...``; :func:`_listed_pairs`) has the size of the model state it continues, so
  that no run stops half-trained at a batch of another size. ``batch_size_of(inputs, targets)``: a batch's size
  (its checks); ``loaded``: a checkpoint was loaded just before (the error says so: its state is the trainer's now).
  Other sources are checked batch by batch (:func:`check_carried_batch`)."""
  states = carried_states(model)
  if not states:
    return
  for data_name, data in data_sets.items():
    sizes = []
    for _, inputs, targets in _listed_pairs(data):
      try:
        sizes.append(batch_size_of(inputs, targets))
      except (ValueError, TypeError):  # (the loop's own checks say it better, in their turn)
        break
    for name, axis, samples in states:
      wrong = [position for position, size in enumerate(sizes) if size != samples]
      if wrong:
        shown = ', '.join(f'{p} ({sizes[p]} samples)' for p in wrong[:5]) + (', ...' if len(wrong) > 5 else '')
        raise ValueError(f'{data_name} has batches of {_listed(sizes)} samples, but {_carrying(name, axis, samples)}'
                         f': batch{"es" * (len(wrong) > 1)} {shown} do{"es" * (len(wrong) == 1)} not fit it. '
                         f'Checked before training: {_LOADED if loaded else "nothing has changed"}. Give batches '
                         f'of {_samples(samples)}, reset '
                         f'the model at your batches\' size first (model.reset(size)), or fit with reset_state=True '
                         f'(each batch starts from a state reset at its size).')


def _listed(sizes: List[int]) -> str:
  """The distinct sizes in order of appearance: ``'2, 4 and 3'``."""
  distinct = [str(size) for size in dict.fromkeys(sizes)]
  return distinct[0] if len(distinct) == 1 else ', '.join(distinct[:-1]) + ' and ' + distinct[-1]
