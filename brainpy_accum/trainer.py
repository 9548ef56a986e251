"""``AccumBPTT``: :class:`brainpy.BPTT` with gradient accumulation over micro-batches inside one compiled step."""

import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import brainpy as bp
import brainpy.math as bm
import brainstate
import brainstate.environ
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from brainpy import tools
from brainpy.running import constants as c
from tqdm import tqdm

from ._accumulate import add_scaled, combine_values, finish_grads, finish_values, same_type, sum_values, wide_zeros_like
from ._checkpoint import load as load_checkpoint_file, save as save_checkpoint_file
from ._batch import BatchLayout, batch_layout, put_samples, take_samples
from ._checks import check_accumulation_args, check_data, check_fit_args, check_remat, check_update_args
from ._checks import warn_batch_statistics
from ._plan import MicroBatchPlan, plan_micro_batches
from ._planner import choose_micro_batch_size, compiled_step_bytes, format_memory, parse_memory
from ._remat import checkpointed_time_loop
from ._two_pass import check_whole_batch_loss, forward_outputs, loss_and_cotangents, output_axes, pull_back
from ._two_pass import second_sizes, traced_shapes, warn_coupled_loss, whole_batch_like
from ._states import declared_batch_axes, variable_batch_axis
from ._fit_loop import LoopOptions, run_epoch
from ._mesh import auto_axes, batch_spec, check_divisible, check_mesh, mesh_size, per_device_random
from ._mesh import place, random_states, sum_across_devices
from ._report import PhaseLog
from ._update import all_finite, clip_by_global_norm, guarded_update
from ._window import GradWindow, check_accumulate_steps

__all__ = ['AccumBPTT']


class AccumBPTT(bp.BPTT):
  """Back-propagation through time with gradient accumulation over micro-batches.

  A drop-in replacement for :class:`brainpy.BPTT`: the same constructor
  arguments and the same :meth:`fit`, plus the accumulation options below.
  Each batch is cut into micro-batches that run one after another inside one
  compiled train step, so only one micro-batch's activations are alive at a
  time; their gradients are combined and the optimizer updates once::

    for each micro-batch i of the batch (n_i samples):
      model state <- its n_i samples of the batch's model state
      g_i, loss_i = grad(loss)(micro-batch i)
      acc += w_i * g_i                      # w_i = n_i ('mean') or 1 ('sum')
    optimizer.update(acc / sum_i w_i)       # one update per batch ('mean')

  With ``grad_reduction='mean'`` and a loss that averages over samples, the
  update, the reported loss and the auxiliary metrics equal those of
  :class:`brainpy.BPTT` on the whole batch (to float32 round-off), for any
  batch size: a batch that does not divide evenly runs one shorter
  micro-batch, weighted by its sample count.

  Parameters
  ----------
  target : DynamicalSystem
    The model to train, in a batching or training mode.
  loss_fun : str, callable
    The loss ``loss_fun(predicts, targets)``, or a name from ``brainpy.losses``.
  optimizer : Optimizer, optional
    The optimizer; defaults as in :class:`brainpy.BPTT`.
  num_micro_batch : int or 'auto', optional
    Cut each batch into at most this many micro-batches of
    ``ceil(batch_size / num_micro_batch)`` samples. Give this or ``micro_batch_size``;
    with neither, each batch runs whole (``1``), exactly as in :class:`brainpy.BPTT`.
    ``'auto'`` picks, for each batch size, the fewest micro-batches whose
    compiled train step fits ``memory_budget`` (see :meth:`plan_memory`).
  micro_batch_size : int, optional
    Cut each batch into micro-batches of this many samples (the last one may
    be shorter). Give this or ``num_micro_batch``.
  grad_reduction : {'mean', 'sum'}
    ``'mean'`` (default) weights each micro-batch by its sample count and
    divides by the batch size: the right choice for losses that average over
    samples. ``'sum'`` adds the micro-batch gradients, losses and metrics: the
    right choice for losses that sum over samples.
  target_batch_axis : int, optional
    The batch axis of every target leaf. By default it follows
    ``data_first_axis`` (axis 0 for ``'B'``, axis 1 for ``'T'``) and falls back
    to axis 0 for leaves whose preferred axis does not hold the batch.
  memory_budget : int or str, optional
    With ``num_micro_batch='auto'``: bytes, or a string like ``'512MiB'`` or ``'2GiB'``.
  accumulate_steps : int or dict
    Also accumulate across batches: one optimizer update every ``k`` batches
    of the data iterator (and at the last batch of each epoch), weighted by
    what each batch held, so ``k`` batches of ``b`` samples give the update of
    one batch of ``k * b``. A dict ``{first_epoch: k}`` changes ``k`` by epoch
    (``{0: 1, 5: 4}``). The running sums live in Variables on the device.
  loss_weight_fn : callable, optional
    ``loss_weight_fn(inputs, targets) -> weight`` of a (micro-)batch, for
    losses normalised by something other than the sample count, e.g. the
    number of valid time steps of a masked loss. Each micro-batch's gradient
    is weighted by it and the total divided by the batch's total weight: the
    gradient of the whole batch's normalised loss. ``'mean'`` only.
  clip_grad_norm : float, optional
    Clip the combined gradient (after all micro-batches and batches of an
    update) to this global L2 norm, once per optimizer update.
  skip_nonfinite : bool
    Skip an update whose gradient holds a NaN or an infinity: parameters,
    optimizer state and the learning-rate step stay exactly as before, the
    skip is counted in :attr:`skipped_steps` and shown in the report line.
    With ``accumulate_steps`` a non-finite batch is left out of its window
    (and counted); the rest of the window still makes its update.
  remat : bool or int
    Rematerialise over time: ``True`` checkpoints the time loop every
    ``round(sqrt(T))`` steps, an int every that many steps, so that the
    backward pass keeps one model state per segment instead of every step's
    activations (about one extra forward pass of compute; same gradients).
    ``False`` (default) stores every step, as :class:`brainpy.BPTT` does.
  mesh : jax.sharding.Mesh, optional
    Data parallelism: every batch is split along its batch axis over the
    devices of ``mesh_axis`` (contiguous shares of ``batch_size / D``
    samples), each device runs its own micro-batch loop on its share, and
    the devices' gradient sums are added once per train step, not once per
    micro-batch. Parameters and optimizer state are replicated. The
    micro-batch options then describe each device's share: with
    ``num_micro_batch=N`` each device runs ``N`` micro-batches of
    ``batch_size / (D N)`` samples, and ``memory_budget`` is per device.
    Batch sizes must be multiples of ``D``. For several hosts, call
    :func:`jax.distributed.initialize` first and build the mesh from
    :func:`jax.devices` (all hosts' devices); every process runs the same
    :meth:`fit` on the same batches. Without a mesh nothing changes.
  mesh_axis : str, optional
    The mesh axis that splits the batch; needed only when the mesh has more
    than one axis (the others then hold replicas).
  whole_batch_loss : bool
    ``False`` (default): each micro-batch's loss is its own, and the combined
    gradient is exact for losses that are a (weighted) mean or sum of
    per-sample terms. At the first batch :meth:`fit` checks once, with one
    forward pass, whether the loss is such a mean and warns, with the
    measured difference, if it is not. ``True``: exact for ANY loss of the
    whole batch's predictions and monitors (batch-wide firing-rate
    regularisers, batch statistics, maxima, contrastive terms), by two
    passes inside the one compiled step: every micro-batch runs forward
    keeping only its predictions, ``loss_fun`` runs once on the whole
    batch's predictions and gives their gradient, then every micro-batch
    runs forward and backward again from the same initial state and random
    numbers, pulling back its slice of that gradient. Memory: the whole
    batch's predictions plus one micro-batch's activations; compute: about
    one extra forward pass. It combines with ``remat``, ``clip_grad_norm``,
    ``skip_nonfinite`` and the memory planner, but not with
    ``accumulate_steps > 1`` (the loss of several batches together is not
    known from their separate losses), ``grad_reduction='sum'``,
    ``loss_weight_fn`` (the loss itself normalises) or ``mesh``.
  **kwargs
    Any other :class:`brainpy.BPTT` argument (``loss_has_aux``, ``monitors``,
    ``jit``, ``data_first_axis``, ``progress_bar``, ...).

  Attributes
  ----------
  trace_counts : dict
    How many times the train step (``'fit'``) and the evaluation step
    (``'loss'``) were traced: one per distinct batch shape when jitted.
    :attr:`compilations` counts the XLA executables behind them.

  Examples
  --------
  >>> import brainpy as bp, brainpy.math as bm, numpy as np
  >>> from brainpy_accum import AccumBPTT
  >>> bm.random.seed(0)
  >>> with bm.training_environment():
  ...   model = bp.Sequential(bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, 2))
  >>> trainer = AccumBPTT(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=1e-2),
  ...                     num_micro_batch=4, progress_bar=False)
  >>> x, y = np.ones((10, 5, 3), 'float32'), np.zeros((10, 5, 2), 'float32')
  >>> trainer.fit([(x, y)], num_epoch=2)  # doctest: +ELLIPSIS
  Train 0 epoch, use ... s, loss ... (batch 10 = 3 x 3 + 1)
  Train 1 epoch, use ... s, loss ... (batch 10 = 3 x 3 + 1)
  >>> trainer.train_losses.shape
  (2,)
  """

  def __init__(
      self,
      target: bp.DynamicalSystem,
      loss_fun: Union[str, Callable],
      optimizer: Optional[bp.optim.Optimizer] = None,
      *,
      num_micro_batch: Union[int, str, None] = None,
      micro_batch_size: Optional[int] = None,
      grad_reduction: str = 'mean',
      target_batch_axis: Optional[int] = None,
      memory_budget: Union[int, str, None] = None,
      remat: Union[bool, int] = False,
      accumulate_steps: Union[int, Dict[int, int]] = 1,
      loss_weight_fn: Optional[Callable] = None,
      clip_grad_norm: Optional[float] = None,
      skip_nonfinite: bool = False,
      mesh: Optional[Mesh] = None,
      mesh_axis: Optional[str] = None,
      whole_batch_loss: bool = False,
      **kwargs,
  ):
    self.mesh_axis = check_mesh(mesh, mesh_axis)
    check_whole_batch_loss(whole_batch_loss, grad_reduction, loss_weight_fn, accumulate_steps, mesh)
    if num_micro_batch is None and micro_batch_size is None:
      num_micro_batch = 1  # no option: bp.BPTT's whole-batch step
    check_accumulation_args(num_micro_batch, micro_batch_size, grad_reduction, target_batch_axis, memory_budget)
    check_remat(remat)
    check_update_args(grad_reduction, loss_weight_fn, clip_grad_norm, skip_nonfinite)
    accumulate_steps = check_accumulate_steps(accumulate_steps)
    super().__init__(target, loss_fun, optimizer=optimizer, **kwargs)
    self.num_micro_batch = num_micro_batch
    self.micro_batch_size = micro_batch_size
    self.grad_reduction = grad_reduction
    self.target_batch_axis = target_batch_axis
    self.remat = remat
    self.memory_budget = None if memory_budget is None else parse_memory(memory_budget)
    self.memory_plans: Dict[int, Tuple[MicroBatchPlan, int]] = {}
    self.accumulate_steps = accumulate_steps
    self.loss_weight_fn = loss_weight_fn
    self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
    self.skip_nonfinite = skip_nonfinite
    self.whole_batch_loss = whole_batch_loss
    self._loss_checked = whole_batch_loss
    self.mesh = None if mesh is None else auto_axes(mesh)
    self.skipped_steps = bm.Variable(jnp.zeros((), jnp.int32))
    params = self.target.train_vars().unique()
    copies = None if mesh is None else self.num_devices
    self._window = None if accumulate_steps == 1 else GradWindow(params, copies)
    self.trace_counts = {'fit': 0, 'loss': 0}
    self._compilations = {'fit': 0, 'loss': 0}
    self._jit_step_func_eval = bm.jit(self._step_func_eval, static_argnums=(0,))
    self._jit_step_func_collect = bm.jit(self._step_func_collect, static_argnums=(0,))
    warn_batch_statistics(self.target)

  def __repr__(self):
    return (f'{self.__class__.__name__}(target={self.target}, num_micro_batch={self.num_micro_batch}, '
            f'micro_batch_size={self.micro_batch_size}, grad_reduction={self.grad_reduction!r}, '
            f'optimizer={self.optimizer})')

  @property
  def compilations(self) -> Dict[str, int]:
    """XLA compilations so far of the train (``'fit'``) and evaluation (``'loss'``) steps run by :meth:`fit`.

    Counted from JAX's backend-compilation events while a step is called, so it
    is exact with or without a mesh: one per distinct batch shape (and, with
    ``accumulate_steps``, one more for the step that only collects).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(3, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2, progress_bar=False)
    >>> trainer.fit([(np.ones((4, 5, 3), 'float32'), np.ones((4, 5, 2), 'float32'))] * 3, num_epoch=2)
    ... # doctest: +ELLIPSIS
    Train 0 epoch, ...
    Train 1 epoch, ...
    >>> trainer.compilations
    {'fit': 1, 'loss': 0}
    """
    return dict(self._compilations)

  def note_compilations(self, phase: str, count: int) -> None:
    """Add ``count`` XLA compilations to :attr:`compilations` (``phase`` is ``'fit'`` or ``'loss'``)."""
    self._compilations[phase] += count

  # ------------------------------------------------------------------ planning

  def plan_for(self, batch_size: int) -> MicroBatchPlan:
    """The micro-batches that a batch of ``batch_size`` samples is cut into.

    With ``num_micro_batch='auto'`` the batch size must have been planned
    (:meth:`plan_memory`, which :meth:`fit` calls on each new batch size).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> AccumBPTT(model, 'mean_squared_error', num_micro_batch=4).plan_for(10).sizes
    (3, 3, 3, 1)
    """
    if self.num_micro_batch != 'auto':
      return plan_micro_batches(self._share_size(batch_size), num_micro_batch=self.num_micro_batch,
                                micro_batch_size=self.micro_batch_size)
    if batch_size not in self.memory_plans:
      raise ValueError(f'No micro-batch plan for {batch_size=} yet under memory_budget='
                       f'{format_memory(self.memory_budget)}: call trainer.plan_memory(inputs, targets) '
                       f'with a batch of that size first (fit does this itself).')
    return self.memory_plans[batch_size][0]

  def num_micro_batch_for(self, batch_size: int) -> int:
    """How many micro-batches a batch of ``batch_size`` samples runs in.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> AccumBPTT(model, 'mean_squared_error', micro_batch_size=4).num_micro_batch_for(10)
    3
    """
    return self.plan_for(batch_size).num_micro_batches

  @property
  def num_devices(self) -> int:
    """Devices a batch is split over: the size of the mesh's batch axis (1 without a mesh)."""
    return 1 if self.mesh is None else mesh_size(self.mesh, self.mesh_axis)

  def _share_size(self, batch_size: int) -> int:
    """Samples each device holds of a batch of ``batch_size``."""
    return batch_size if self.mesh is None else check_divisible(batch_size, self.num_devices, self.mesh_axis)

  def place_on_mesh(self, batch_size: Optional[int] = None) -> None:
    """Put the trainer's Variables on the mesh: model states split along their batch axis, the
    ``accumulate_steps`` window one row per device, everything else (parameters, optimizer state,
    counters, random keys) replicated. :meth:`fit` calls it before every step; without a mesh it does nothing.
    """
    if self.mesh is None:
      return
    split = self._split_variables(with_window=True, batch_size=batch_size)
    specs = {id(var): spec for var, spec in split}
    variables = list(self.vars().unique().values()) + [var for var, _ in split] + random_states(self.target)
    place([(var, specs.get(id(var), PartitionSpec())) for var in variables], self.mesh)

  def _split_variables(self, with_window: bool, batch_size: Optional[int] = None):
    """``(Variable, partition)`` of every Variable split over the mesh: model states along their batch axis
    and, ``with_window``, the ``accumulate_steps`` window one row per device. All others are replicated."""
    axis = self.mesh_axis
    split = [(var, batch_spec(state_axis, axis)) for var, state_axis in self._batched_states(batch_size).values()]
    if with_window and self._window is not None:
      split += [(var, batch_spec(0, axis)) for var in self._window.variables().values()]
    return split

  def describe_batch(self, batch_size: int) -> str:
    """How a batch of ``batch_size`` samples is cut, as the report line shows it.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> AccumBPTT(model, 'mean_squared_error', num_micro_batch=4).describe_batch(10)
    'batch 10 = 3 x 3 + 1'
    """
    plan = self.plan_for(batch_size)
    if self.mesh is None:
      return plan.describe()
    return f'batch {batch_size} = {self.num_devices} devices x ({plan.describe_cuts()})'

  def plan_memory(self, inputs: Any, targets: Any, shared_args: Optional[Dict] = None) -> MicroBatchPlan:
    """Choose and cache the fewest micro-batches whose compiled train step fits ``memory_budget``.

    Each candidate micro-batch size is compiled ahead of time and measured
    with XLA's memory analysis; no step runs and nothing changes but the
    cached choice, which is printed and kept in :attr:`memory_plans` as
    ``{batch_size: (plan, bytes)}``.

    Raises
    ------
    ValueError
      If one sample per micro-batch does not fit either (the message gives
      the smallest budget that would).

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.Sequential(bp.dyn.RNNCell(3, 16), bp.dnn.Dense(16, 2))
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch='auto', memory_budget='64KiB')
    >>> x, y = np.ones((32, 20, 3), 'float32'), np.zeros((32, 20, 2), 'float32')
    >>> plan = trainer.plan_memory(x, y)  # doctest: +ELLIPSIS
    memory plan: batch 32 = ... micro-batches), train step ... of memory_budget 64.0 KiB
    >>> trainer.memory_plans[32][1] <= 64 * 1024
    True
    """
    if self.num_micro_batch != 'auto':
      raise ValueError(f"plan_memory needs num_micro_batch='auto'; this trainer has "
                       f"num_micro_batch={self.num_micro_batch!r}, micro_batch_size={self.micro_batch_size!r}.")
    layout = self.check_batch(inputs, targets)
    batch_size, share = layout.batch_size, self._share_size(layout.batch_size)
    if batch_size not in self.memory_plans:
      shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
      measure = lambda size: self.compiled_step_bytes(
        plan_micro_batches(share, micro_batch_size=size), shared_args, inputs, targets)
      try:
        size, used = choose_micro_batch_size(share, self.memory_budget, measure)
      except ValueError as error:
        if self.mesh is None:
          raise
        raise ValueError(f'{error} With the mesh, each of the {self.num_devices} devices holds {share} samples of '
                         f'the batch of {batch_size}, and memory_budget is per device.') from None
      plan = plan_micro_batches(share, micro_batch_size=size)
      self.memory_plans[batch_size] = (plan, used)
      per_device = '' if self.mesh is None else ' per device'
      tqdm.write(f'memory plan: {self.describe_batch(batch_size)} ({plan.num_micro_batches} micro-batches), '
                 f'train step {format_memory(used)}{per_device} of memory_budget {format_memory(self.memory_budget)}')
    return self.memory_plans[batch_size][0]

  def compiled_step_bytes(self, plan: MicroBatchPlan, shared_args, inputs, targets) -> int:
    """Memory of the train step compiled ahead of time for ``plan`` (arguments + outputs + temporaries - aliases).

    The model state enters at its current size, as :meth:`fit` leaves it before a step
    (reset at the batch size); nothing is executed and nothing changes. With a
    mesh the figure is per device.
    """
    return compiled_step_bytes(self.compile_step(inputs, targets, shared_args, plan=plan))

  def compile_step(self, inputs, targets, shared_args: Optional[Dict] = None,
                   plan: Optional[MicroBatchPlan] = None, update: bool = True):
    """The train step for this batch shape, compiled ahead of time by XLA; nothing runs, nothing changes.

    Returns JAX's compiled object: ``memory_analysis()`` gives its memory
    (per device with a mesh), ``as_text()`` its optimised HLO, e.g. to count
    the cross-device reductions (``all-reduce``) of a sharded step. The model
    state enters at its current size: call ``model.reset(batch_size)`` first,
    as :meth:`fit` does. ``plan`` overrides the trainer's micro-batch plan;
    ``update=False`` compiles the step that only adds a batch to the
    ``accumulate_steps`` window.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.Sequential(bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, 2))
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=4)
    >>> x, y = np.ones((16, 5, 3), 'float32'), np.zeros((16, 5, 2), 'float32')
    >>> model.reset(16)
    >>> compiled = trainer.compile_step(x, y)
    >>> compiled.memory_analysis().temp_size_in_bytes > 0
    True
    """
    shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
    step = bm.jit(functools.partial(self._train_step, plan=plan, update=update), static_argnums=(0,))
    with self._without_time_step_bars():
      return step.compile(shared_args, inputs, targets)

  @contextlib.contextmanager
  def _without_time_step_bars(self):
    """Trace steps without bp.BPTT's per-time-step progress bars (host callbacks inside the compiled step)."""
    shown, self.progress_bar = self.progress_bar, False
    try:
      yield
    finally:
      self.progress_bar = shown

  def check_batch(self, inputs: Any, targets: Any) -> BatchLayout:
    """Check one batch and return its layout; raises ``ValueError`` before anything changes.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm, numpy as np
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(3, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2)
    >>> trainer.check_batch(np.ones((8, 5, 3)), np.ones((8, 5, 2))).batch_size
    8
    >>> trainer.check_batch(np.ones((8, 5, 3)), np.ones((6, 5, 2)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: targets has shape (6, 5, 2), but the inputs hold batch_size=8 samples ...
    """
    layout = batch_layout(inputs, targets, self.data_first_axis, self.target_batch_axis)
    self._share_size(layout.batch_size)
    return layout

  # ------------------------------------------------------------------ checkpoints

  def save_checkpoint(self, path: str) -> str:
    """Save parameters, model state, optimizer state (learning-rate step included), accumulation counters and
    BrainPy's global random state to ``path``, atomically (temporary file, then rename).

    :meth:`save_state` / :meth:`load_state` and ``state_dict`` keep their BrainPy meanings.

    Examples
    --------
    >>> import os, tempfile, brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2)
    >>> path = trainer.save_checkpoint(os.path.join(tempfile.mkdtemp(), 'run.ckpt'))
    >>> trainer.load_checkpoint(path)
    """
    return save_checkpoint_file(self, path)

  def load_checkpoint(self, path: str) -> None:
    """Restore what :meth:`save_checkpoint` wrote; a corrupt or mismatched file raises and changes nothing.

    Examples
    --------
    >>> import os, tempfile, brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> trainer = AccumBPTT(model, 'mean_squared_error', num_micro_batch=2)
    >>> trainer.load_checkpoint(os.path.join(tempfile.mkdtemp(), 'missing.ckpt'))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    FileNotFoundError: No checkpoint at path=...
    """
    load_checkpoint_file(self, path)

  # ------------------------------------------------------------------ compiled steps

  @property
  def f_loss(self):
    """The micro-batched evaluation step (jitted unless ``jit`` says otherwise)."""
    return self._jit_step_func_eval if self.jit[c.LOSS_PHASE] else self._step_func_eval

  @property
  def f_collect(self):
    """The train step that adds a batch to the ``accumulate_steps`` window without updating."""
    return self._jit_step_func_collect if self.jit[c.FIT_PHASE] else self._step_func_collect

  def _step_func_fit(self, shared_args, inputs, targets):
    self.trace_counts['fit'] += 1
    return self._train_step(shared_args, inputs, targets)

  def _step_func_collect(self, shared_args, inputs, targets):
    self.trace_counts['fit'] += 1
    return self._train_step(shared_args, inputs, targets, update=False)

  def _train_step(self, shared_args, inputs, targets, plan: Optional[MicroBatchPlan] = None, update: bool = True):
    if self.mesh is not None and self._window is not None:
      return self._train_step_sharded_window(shared_args, inputs, targets, plan, update)
    grads, weight, loss, aux = self._accumulate(shared_args, inputs, targets, with_grads=True, plan=plan)
    finite = all_finite(grads) if self.skip_nonfinite else None
    if self._window is None:
      self._apply_update(grads, finite)
    else:
      self._window.add(grads, weight, keep=finite)
      if self.skip_nonfinite:
        self._count_skipped(finite)
      if update:
        grads, weight = self._window.close(self.grad_reduction)
        self._apply_update(grads, (weight > 0) if self.skip_nonfinite else None, count=False)
    return (loss, aux) if self.loss_has_aux else (loss,)

  def _train_step_sharded_window(self, shared_args, inputs, targets, plan: Optional[MicroBatchPlan], update: bool):
    """An ``accumulate_steps`` step on a mesh: each device adds its sums to its own row of the window, and the
    devices add their gradients only when the window closes (``update``): one gradient all-reduce per update."""
    layout = self.check_batch(inputs, targets)
    plan = plan or self.plan_for(layout.batch_size)
    with declared_batch_axes(self._batched_states(layout.batch_size).values()):
      grad_sum, window_weight, total, loss_sum, aux_sum, bad = self._accumulate_sharded(
        shared_args, inputs, targets, layout, plan, with_grads=True, window_update=update)
    loss, aux = finish_values((loss_sum, aux_sum), total, self.grad_reduction)
    if self.skip_nonfinite:
      self._count_skipped(bad == 0)
    if update:
      divide = jnp.where(window_weight > 0, window_weight, 1.)
      grads = finish_grads(grad_sum, divide, self.grad_reduction)
      self._apply_update(grads, (window_weight > 0) if self.skip_nonfinite else None, count=False)
    return (loss, aux) if self.loss_has_aux else (loss,)

  def _window_in_shard(self, sums, update: bool, axis: str):
    """Inside a shard: add this device's batch sums to its window row; all-reduce gradients only if ``update``.

    Returns ``(grad_sum, window_weight, total, loss_sum, aux_sum, bad)``: the window's sums over all devices
    (``None, None`` unless ``update``), then the batch's total weight, loss and metric sums and the number of
    devices whose gradient was not finite (one small all-reduce of scalars per batch, for the report).
    """
    grad_sum, local_total, loss_sum, aux_sum = sums
    bad = jnp.zeros((), jnp.int32) if not self.skip_nonfinite else (~all_finite(grad_sum)).astype(jnp.int32)
    total, loss_sum, aux_sum, bad = sum_across_devices((local_total, loss_sum, aux_sum, bad), axis)
    self._window.add_sums(grad_sum, local_total, keep=(bad == 0) if self.skip_nonfinite else None)
    window_sums, window_weight = sum_across_devices(self._window.take_sums(), axis) if update else (None, None)
    return window_sums, window_weight, total, loss_sum, aux_sum, bad

  def _apply_update(self, grads, apply, count: bool = True) -> None:
    params = self.target.train_vars().unique()
    grads = {k: same_type(g, params[k].value) for k, g in grads.items()}
    if self.clip_grad_norm is not None:
      grads = clip_by_global_norm(grads, self.clip_grad_norm)
    guarded_update(self.optimizer, dict(params), grads, apply)
    if apply is not None and count:
      self._count_skipped(apply)

  def _count_skipped(self, finite) -> None:
    self.skipped_steps.value += jnp.where(finite, 0, 1).astype(self.skipped_steps.dtype)

  def _step_func_eval(self, shared_args, inputs, targets):
    self.trace_counts['loss'] += 1
    _, _, loss, aux = self._accumulate(shared_args, inputs, targets, with_grads=False)
    return (loss, aux) if self.loss_has_aux else loss

  def _fun_predict(self, indices, *inputs, shared_args=None):
    if not self.remat or self._memory_efficient:
      return super()._fun_predict(indices, *inputs, shared_args=shared_args)
    step = functools.partial(self._step_func_predict, shared_args=shared_args)
    segment = None if self.remat is True else self.remat
    return checkpointed_time_loop(step, indices, inputs, segment, jit=self.jit['predict'])

  def _predicts(self, shared_args, inputs):
    """What ``loss_fun`` receives for ``inputs``: the outputs, and the monitors if any (as in bp.BPTT)."""
    indices = np.arange(self.i0, self.i0 + self._get_input_time_step(xs=inputs), dtype=np.int_)
    if isinstance(self.target.mode, bm.BatchingMode) and self.data_first_axis == 'B':
      inputs = jax.tree_util.tree_map(lambda x: bm.moveaxis(x, 0, 1), inputs, is_leaf=lambda x: isinstance(x, bm.Array))
    outs, mons = self._predict(indices, *(inputs if isinstance(inputs, (tuple, list)) else (inputs,)),
                               shared_args=shared_args)
    predicts = (outs, mons) if len(mons) > 0 else outs
    return jax.tree_util.tree_map(bm.as_jax, predicts, is_leaf=lambda x: isinstance(x, bm.Array))

  def _loss_of(self, predicts, targets):
    return self._checked_aux(self._loss_func(predicts, targets))

  def _loss_and_aux(self, shared_args, inputs, targets):
    return self._checked_aux(self._step_func_loss(shared_args, inputs, targets))

  def _checked_aux(self, out):
    if not self.loss_has_aux:
      return out, {}
    loss, aux = out
    if not isinstance(aux, dict):
      raise TypeError(f'With loss_has_aux=True the loss must return (loss, dict of metrics); '
                      f'its second item is a {type(aux).__name__}.')
    return loss, aux

  def _micro_weight(self, inputs, targets, size: int):
    if self.grad_reduction == 'sum':
      return jnp.ones((), jnp.float32)
    if self.loss_weight_fn is None:
      return jnp.asarray(size, jnp.float32)
    return jnp.asarray(self.loss_weight_fn(inputs, targets), jnp.float32)

  def _micro_step(self, shared_args, inputs, targets, size: int, with_grads: bool):
    """``(grads or None, loss, aux, weight)`` of one micro-batch of ``size`` samples, from the current state."""
    weight = self._micro_weight(inputs, targets, size)
    if not with_grads:
      return (None,) + tuple(self._loss_and_aux(shared_args, inputs, targets)) + (weight,)
    grad_fn = bm.grad(self._loss_and_aux, grad_vars=self.target.train_vars().unique(),
                      return_value=True, has_aux=True)
    grads, loss, aux = grad_fn(shared_args, inputs, targets)
    return {k: bm.as_jax(g) for k, g in grads.items()}, loss, aux, weight

  def _batched_states(self, batch_size: Optional[int]) -> Dict[str, Tuple[bm.Variable, int]]:
    """``{name: (Variable, batch axis)}`` of the model states that micro-batches cut (see :mod:`._states`)."""
    found = {k: (v, variable_batch_axis(k, v, batch_size or 0)) for k, v in self.target.vars().unique().items()}
    return {k: (v, axis) for k, (v, axis) in found.items() if axis is not None}

  @staticmethod
  def _state_for_batch(name: str, var: bm.Variable, axis: int, batch_size: int):
    value = bm.as_jax(var.value)
    if value.shape[axis] == batch_size:
      return value
    if value.shape[axis] == 1:
      return jnp.repeat(value, batch_size, axis=axis)
    raise ValueError(f'Model state {name} holds {value.shape[axis]} samples along its batch axis {axis}, but '
                     f'the batch has {batch_size}. Call model.reset({batch_size}) first, or fit with reset_state=True.')

  def _accumulate(self, shared_args, inputs, targets, with_grads: bool, plan: Optional[MicroBatchPlan] = None):
    """Run every micro-batch of one batch; return its combined ``(grads, weight, loss, aux)``.

    ``grads`` is the weighted mean of the micro-batch gradients (their sum for
    ``'sum'``), still in accumulator precision (cast to the parameters' types
    only in :meth:`_apply_update`, so a window across batches sums them in
    float32 too), and ``weight`` the batch's total weight. With a mesh every
    device runs this on its share and the shares are added once.
    """
    layout = self.check_batch(inputs, targets)
    plan = plan or self.plan_for(layout.batch_size)
    with declared_batch_axes(self._batched_states(layout.batch_size).values()):
      if self.mesh is None:
        return self._accumulate_local(shared_args, inputs, targets, layout, plan, with_grads, finish=True)
      return self._accumulate_sharded(shared_args, inputs, targets, layout, plan, with_grads)

  def _accumulate_sharded(self, shared_args, inputs, targets, layout: BatchLayout, plan: MicroBatchPlan,
                          with_grads: bool, window_update: Optional[bool] = None):
    """:meth:`_accumulate` split over the mesh: local micro-batch loops, one ``psum`` of their sums.

    With ``window_update`` set, the batch goes into the ``accumulate_steps`` window
    instead (see :meth:`_window_in_shard`, whose results are returned).
    """
    axis = self.mesh_axis
    for k, (var, state_axis) in self._batched_states(layout.batch_size).items():
      var.value = self._state_for_batch(k, var, state_axis, layout.batch_size)
    state_specs = dict(self._split_variables(with_window=window_update is not None, batch_size=layout.batch_size))
    leaves, treedef = jax.tree_util.tree_flatten((inputs, targets), is_leaf=lambda x: isinstance(x, bm.Array))
    leaf_axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    local_layout = BatchLayout(plan.batch_size, layout.input_axes, layout.target_axes)
    random = random_states(self.target)

    def local(*local_leaves):
      local_inputs, local_targets = jax.tree_util.tree_unflatten(treedef, local_leaves)
      with per_device_random(random, axis):
        sums = self._accumulate_local(shared_args, local_inputs, local_targets, local_layout, plan, with_grads,
                                      finish=False)
      if window_update is not None:
        return self._window_in_shard(sums, window_update, axis)
      return sum_across_devices(sums, axis)

    run = brainstate.transform.shard_map(
      local, self.mesh, in_specs=tuple(batch_spec(a, axis) for a in leaf_axes), out_specs=PartitionSpec(),
      state_in_specs=state_specs, state_out_specs=state_specs, check_vma=False)
    out = run(*[bm.as_jax(x) for x in leaves])
    if window_update is not None:
      return out
    grad_sum, total, loss_sum, aux_sum = out
    loss, aux = finish_values((loss_sum, aux_sum), total, self.grad_reduction)
    grads = finish_grads(grad_sum, total, self.grad_reduction) if with_grads else None
    return grads, total, loss, aux

  def _accumulate_local(self, shared_args, inputs, targets, layout: BatchLayout, plan: MicroBatchPlan,
                        with_grads: bool, finish: bool):
    """Every micro-batch of ``plan`` on this device.

    With ``finish`` return ``(grads, weight, loss, aux)`` as :meth:`_accumulate`
    does; without, the weighted sums ``(grad_sum, weight, loss_sum, aux_sum)``
    that devices add before dividing.
    """
    if plan.num_micro_batches == 1:
      grads, loss, aux, weight = self._micro_step(shared_args, inputs, targets, plan.batch_size, with_grads)
      if finish:
        return grads, weight, loss, aux
    elif self.whole_batch_loss:
      return self._two_passes(shared_args, inputs, targets, layout, plan, with_grads)
      grad_sum = add_scaled(wide_zeros_like(grads), weight, grads) if with_grads else None
      return (grad_sum, weight) + sum_values((loss[None], jax.tree_util.tree_map(lambda v: v[None], aux)),
                                             weight[None], self.grad_reduction)

    found = self._batched_states(plan.batch_size)  # inside a shard: the share's states
    states, state_axes = {k: v for k, (v, _) in found.items()}, {k: a for k, (_, a) in found.items()}
    if finish:
      buffer = {k: self._state_for_batch(k, v, state_axes[k], plan.batch_size) for k, v in states.items()}
    else:  # a device's share, already cut to its samples by the mesh
      buffer = {k: take_samples(v.value, state_axes[k], 0, plan.batch_size) for k, v in states.items()}
    params = {k: v.value for k, v in self.target.train_vars().unique().items()}
    size, num_full = plan.micro_batch_size, plan.num_full

    def run(start, size, buffer):
      # Each micro-batch starts from its own samples of the batch's model state and
      # leaves its final state there, so the state after the step is the whole batch's.
      for k, var in states.items():
        var.value = take_samples(buffer[k], state_axes[k], start, size)
      out = self._micro_step(shared_args, take_samples(inputs, layout.input_axes, start, size),
                             take_samples(targets, layout.target_axes, start, size), size, with_grads)
      buffer = put_samples(buffer, state_axes, start, {k: var.value for k, var in states.items()})
      return out, buffer

    def park_states(buffer):
      for k, var in states.items():
        var.value = take_samples(buffer[k], state_axes[k], 0, size)

    def run_short(buffer):
      out, buffer = run(num_full * size, plan.remainder, buffer)
      park_states(buffer)  # leave the state at the full micro-batch size, as the other branch does
      return out, buffer

    def body(carry, index):
      grad_sum, buffer = carry
      run_full = lambda buffer: run(index * size, size, buffer)
      if plan.remainder:
        # The short micro-batch runs in the same loop, in a branch of its own: XLA gives
        # the two branches the same working memory, where two loops would each get theirs.
        (grads, loss, aux, weight), buffer = bm.cond(index < num_full, run_full, run_short, buffer)
      else:
        (grads, loss, aux, weight), buffer = run_full(buffer)
      if with_grads:
        grad_sum = add_scaled(grad_sum, weight, grads)
      return (grad_sum, buffer), (loss, aux, weight)

    park_states(buffer)  # the scan carries the model state at the micro-batch size
    carry = (wide_zeros_like(params) if with_grads else None, buffer)
    (grad_sum, buffer), (losses, auxs, weights) = bm.scan(body, carry, jnp.arange(plan.num_micro_batches))
    for k, var in states.items():
      var.value = buffer[k]
    total = weights.sum()
    if not finish:
      return (grad_sum, total) + sum_values((losses, auxs), weights, self.grad_reduction)
    loss, aux = combine_values((losses, auxs), weights, self.grad_reduction)
    grads = finish_grads(grad_sum, total, self.grad_reduction) if with_grads else None
    return grads, total, loss, aux

  def _whole_batch_states(self, batch_size: int):
    """The batched model states as ``(Variable, axis)``, set to the whole batch's values."""
    states = self._batched_states(batch_size)
    for k, (var, axis) in states.items():
      var.value = self._state_for_batch(k, var, axis, batch_size)
    return list(states.values())

  def _forward_pass(self, shared_args, inputs, targets, layout: BatchLayout, plan: MicroBatchPlan, states,
                    checked=False):
    """Pass 1 of :mod:`._two_pass` from the batched ``states``' whole-batch values.

    Returns the pass's sums (``samples``: the whole batch's predictions), the leaf axes, the predictions'
    batch axes and the forward function. With ``checked`` the sums also hold each micro-batch's own loss
    and metrics.
    """
    args = (inputs, targets)
    axes = jax.tree_util.tree_leaves((layout.input_axes, layout.target_axes))
    forward = lambda micro_args, size: self._predicts(shared_args, micro_args[0])
    small, large = traced_shapes(forward, args, axes, states, second_sizes(plan))
    out_axes = output_axes(small, large)
    micro_loss = (lambda outputs, micro_args: self._loss_of(outputs, micro_args[1])) if checked else None
    weigh = lambda micro_args, size: self._micro_weight(*micro_args, size)
    sums = forward_outputs(forward, args, axes, plan, states, whole_batch_like(small, out_axes, plan.batch_size),
                           out_axes, micro_loss, weigh)
    return sums, axes, out_axes, forward

  def _two_passes(self, shared_args, inputs, targets, layout: BatchLayout, plan: MicroBatchPlan, with_grads: bool):
    """``whole_batch_loss=True``: ``(grads, weight, loss, aux)`` of ``loss_fun`` on the whole batch's predictions."""
    states = self._whole_batch_states(plan.batch_size)
    replayed = [v for v in self.target.vars().unique().values() if not isinstance(v, bm.TrainVar)]
    replayed += [v for v in random_states(self.target) if all(v is not r for r in replayed)]
    before = [v.value for v in replayed]
    sums, axes, out_axes, forward = self._forward_pass(shared_args, inputs, targets, layout, plan, states)
    loss, aux, cotangents = loss_and_cotangents(lambda p: self._loss_of(p, targets), sums.samples)
    total = jnp.asarray(plan.batch_size, jnp.float32)
    if not with_grads:
      return None, total, loss, aux
    for var, value in zip(replayed, before):
      var.value = value  # pass 2 starts where pass 1 started: same states, same random keys
    params = self.target.train_vars().unique()
    grad = lambda f: lambda *a: {k: bm.as_jax(g) for k, g in bm.grad(f, grad_vars=params)(*a).items()}
    grad_sum = pull_back(forward, grad, (inputs, targets), axes, plan, states, cotangents, out_axes,
                         {k: v.value for k, v in params.items()})
    return grad_sum, total, loss, aux

  def _check_loss_once(self, shared_args, inputs, targets) -> None:
    """Default mode, first batch: warn if the loss is not the weighted mean of its micro-batch values."""
    if self._loss_checked:
      return
    self._loss_checked = True
    layout = self.check_batch(inputs, targets)
    plan = plan_micro_batches(layout.batch_size, micro_batch_size=self.plan_for(layout.batch_size).micro_batch_size)
    if plan.num_micro_batches == 1:
      return
    variables = list(self.vars().unique().values()) + random_states(self.target)
    saved = [v.value for v in variables]
    compare = functools.partial(self._whole_and_combined_loss, layout=layout, plan=plan)
    try:
      with self._without_time_step_bars():
        whole, combined = (bm.jit(compare, static_argnums=(0,)) if self.jit[c.FIT_PHASE] else compare)(
          shared_args, inputs, targets)
    except Exception as error:  # the check must never stop training that would run without it
      warnings.warn(f'Could not check whether loss_fun is a mean over samples ({type(error).__name__}: '
                    f'{str(error)[:200]}); if it couples the samples of a batch, pass whole_batch_loss=True.',
                    UserWarning, stacklevel=3)
      return
    finally:
      for var, value in zip(variables, saved):
        var.value = value
    warn_coupled_loss(float(whole), float(combined), plan, self.grad_reduction)

  def _whole_and_combined_loss(self, shared_args, inputs, targets, layout, plan):
    with declared_batch_axes(self._batched_states(layout.batch_size).values()):
      states = self._whole_batch_states(plan.batch_size)
      sums = self._forward_pass(shared_args, inputs, targets, layout, plan, states, checked=True)[0]
    combined = finish_values(sums.loss_sum, sums.total_weight, self.grad_reduction)
    return self._loss_of(sums.samples, targets)[0], combined

  # ------------------------------------------------------------------ training loop

  def fit(
      self,
      train_data: Union[Callable, Iterable],
      test_data: Optional[Union[Callable, Iterable]] = None,
      num_epoch: int = 100,
      num_report: int = -1,
      reset_state: bool = True,
      shared_args: Optional[Dict] = None,
      fun_after_report: Optional[Callable] = None,
      batch_size: None = None,
  ) -> None:
    """Train on ``train_data`` for ``num_epoch`` epochs, one optimizer update per batch.

    The arguments and the recorded metrics are those of
    :meth:`brainpy.BPTT.fit`; every batch is micro-batched, and so is the
    evaluation on ``test_data``.

    Parameters
    ----------
    train_data : iterable or callable
      Batches ``(inputs, targets)``, or a function returning such an iterable
      (called once per epoch).
    test_data : iterable or callable, optional
      Evaluation batches, run after each training epoch.
    num_epoch : int
      Number of passes over ``train_data``.
    num_report : int
      ``-1`` reports once per epoch; ``k > 0`` every ``k`` batches.
    reset_state : bool
      Reset the model state at the batch size before each batch. With
      ``False`` each sample keeps its model state from the previous batch
      (truncated BPTT over consecutive chunks).
    shared_args : dict, optional
      Shared arguments for the model; ``fit`` is set to ``True`` unless given.
    fun_after_report : callable, optional
      Called as ``fun_after_report(idx, metrics, phase)`` after each report.
    batch_size : None
      Removed from :class:`brainpy.BPTT`: give batches in the data. Anything
      but ``None`` raises, as in BrainPy (an instance of its ``NoLongerSupportError``).
    """
    check_fit_args(num_epoch, num_report, reset_state, fun_after_report, batch_size)
    check_data('train_data', train_data)
    if test_data is not None:
      check_data('test_data', test_data)
    shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
    options = LoopOptions(num_report, reset_state, shared_args, fun_after_report, show_bars=self.progress_bar)
    logs = {'fit': PhaseLog('Train'), 'test': PhaseLog('Test')}
    try:
      with self._without_time_step_bars(), brainstate.environ.context(fit=True):
        for epoch in range(num_epoch):
          run_epoch(self, 'fit', train_data, logs['fit'], epoch, options)
          self.optimizer.lr.step_epoch()
          if test_data is not None:
            run_epoch(self, 'test', test_data, logs['test'], epoch, options)
    finally:
      self._report_train_metrics, self._detailed_train_metrics = logs['fit'].arrays()
      self._report_test_metrics, self._detailed_test_metrics = logs['test'].arrays()
