"""A lower bound of a step's temporary memory, read from its jaxpr without compiling.

Back-propagation through time keeps every step's residuals alive for the backward pass: JAX's ``scan``
stacks them into arrays of ``T x micro-batch x ...``, and XLA runs a scan as a loop whose stacked outputs
are buffers of their own, written step by step. The forward loop's stacked residuals are then read by the
backward loop, all of them alive while it runs. So::

  bytes_at_least(jaxpr) = max over the jaxpr's equations of
                            (stacked outputs of loops that this loop reads or writes)
                          + bytes_at_least(the equation's inner jaxpr, if any)

XLA packs a step's temporaries into space reused by liveness, so buffers alive at once take disjoint
bytes: the figure never exceeds XLA's ``temp_size_in_bytes``. The planner uses it to rule out micro-batch
sizes whose step cannot fit, without compiling them (a trace takes a tenth of a compilation).

What keeps it a lower bound: only buffers that XLA must materialise are counted, the stacked outputs of
loops (a loop is never fused into its user or sunk into another loop), and of those only the ones used
afterwards (after JAX's dead-code elimination) and made from the step's data (not from constants alone,
which XLA may fold). Anything else a loop reads (a slice of the batch, a cotangent made of zeros) may be
sunk into the loop's body by XLA and is not counted; two stacked outputs of the same value count once;
loops of one step, which XLA inlines, count nothing of their own. Where JAX's internals are not as
expected the bound is 0, which rules nothing out.
"""

from typing import Dict, Iterable, Optional, Set, Tuple

import numpy as np

__all__ = ['temp_bytes_at_least']

# what XLA may compute without a buffer of its own: a view of its input, or folded into its use
_VIEWS = frozenset({'reshape', 'squeeze', 'expand_dims', 'transpose', 'copy', 'copy_p', 'broadcast_in_dim',
                    'convert_element_type', 'bitcast_convert_type'})


def temp_bytes_at_least(jaxpr) -> int:
  """Bytes of temporaries that XLA's compilation of ``jaxpr`` holds at least: see the module's docstring.

  Parameters
  ----------
  jaxpr
    A traced step's jaxpr: ``jax.jit(f).trace(*args).jaxpr`` (closed or open).

  Examples
  --------
  >>> import jax, jax.numpy as jnp
  >>> from brainpy_accum.memory._live import temp_bytes_at_least
  >>> def loss(w, xs):  # a scan over 100 steps: its residuals are stacked for the backward pass
  ...   return jax.lax.scan(lambda h, x: (jnp.tanh(h * w + x),) * 2, jnp.zeros(64), xs)[1].sum()
  >>> xs = jnp.ones((100, 64))
  >>> traced = jax.jit(jax.grad(loss)).trace(1., xs)
  >>> bound = temp_bytes_at_least(traced.jaxpr)
  >>> bound >= 100 * 64 * 4  # at least one stacked residual of 100 x 64 float32
  True
  >>> bound <= traced.lower().compile().memory_analysis().temp_size_in_bytes
  True
  """
  try:
    from jax._src.interpreters.partial_eval import dce_jaxpr  # JAX's own dead-code elimination
    opened = _opened(jaxpr)
    # brainstate's debug info may name fewer arguments than there are: the names dropped, the rest kept (no
    # debug info at all is deprecated in JAX 0.10)
    opened = opened.replace(debug_info=opened.debug_info.with_unknown_names())
    live, _ = dce_jaxpr(opened, [True] * len(opened.outvars))
    return _bound(live, data=set(live.invars))
  except Exception:  # an internal of JAX not as expected: no bound, nothing ruled out
    return 0


def _opened(jaxpr):
  """The open jaxpr of a closed one (its constants are constants of the compiled step, not data)."""
  while getattr(jaxpr, 'jaxpr', jaxpr) is not jaxpr:  # (in newer JAX a jaxpr is its own closed jaxpr)
    jaxpr = jaxpr.jaxpr
  return jaxpr


def _sub_jaxprs(eqn) -> Iterable:
  from jax.extend.core import jaxprs_in_params
  return [_opened(sub) for sub in jaxprs_in_params(eqn.params)]


def _is_var(x) -> bool:
  return hasattr(x, 'aval') and not hasattr(x, 'val') and type(x).__name__ != 'DropVar'


def _nbytes(var) -> int:
  """Bytes of a variable's array; 0 for what has no plain dtype (random keys, tokens): a lower bound."""
  aval = var.aval
  try:
    itemsize = np.dtype(aval.dtype).itemsize
  except TypeError:
    return 0
  return int(np.prod(aval.shape, dtype=np.int64)) * itemsize


def _bound(jaxpr, data: Set) -> int:
  """The bound of one jaxpr whose input variables ``data`` hold the step's data (the others may be constants)."""
  producer = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
  data = set(data)
  for eqn in jaxpr.eqns:  # what is made from the step's data, not from constants alone
    if any(_is_var(x) and x in data for x in eqn.invars):
      data.update(eqn.outvars)
  used_later: Set = {x for x in jaxpr.outvars if _is_var(x)}
  best = 0
  for eqn in reversed(jaxpr.eqns):
    alive = _loop_buffers(eqn, producer, data, used_later) if eqn.primitive.name == 'scan' else 0
    inner = max((_bound(sub, _data_inputs(eqn, sub, data)) for sub in _sub_jaxprs(eqn)), default=0)
    best = max(best, alive + inner)
    used_later.update(x for x in eqn.invars if _is_var(x))
  return best


def _data_inputs(eqn, sub, data: Set) -> Set:
  """The inputs of an inner jaxpr fed by the step's data: its inputs match the equation's last operands
  (a scan's body all of them; a cond's branches all but the predicate; a while's body all but the cond's
  constants). Any other layout: none (which only lowers the bound)."""
  inner, outer = list(sub.invars), list(eqn.invars)
  if len(inner) > len(outer):
    return set()
  return {v for v, x in zip(inner, outer[len(outer) - len(inner):]) if _is_var(x) and x in data}


def _loop_buffers(eqn, producer: Dict, data: Set, used_later: Set) -> int:
  """Bytes of the stacked loop outputs that a scan reads, and of its own stacked outputs used afterwards."""
  length = eqn.params.get('length', 0)
  subs = _sub_jaxprs(eqn)
  if length < 2 or len(subs) != 1:
    return 0  # a loop of one step is inlined by XLA, its buffers fused away
  body = subs[0]
  if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
    return 0
  stacked = lambda outer, inner: tuple(outer.aval.shape) == (length, *inner.aval.shape)
  buffers = {}
  for outer, inner in zip(eqn.invars, body.invars):
    if _is_var(outer) and stacked(outer, inner):
      made = _made_by_loop(outer, producer, data)
      if made is not None:
        buffer, size = made
        buffers[buffer] = max(buffers.get(buffer, 0), size)
  values, body_inputs = set(), set(body.invars)
  for outer, inner in zip(eqn.outvars, body.outvars):
    if (_is_var(outer) and outer in used_later and outer in data and stacked(outer, inner)
        and _is_var(inner) and inner not in body_inputs and inner not in values):
      values.add(inner)  # (the same value stacked twice: XLA may keep one buffer)
      buffers[outer] = _nbytes(outer)
  return sum(buffers.values())


def _made_by_loop(var, producer: Dict, data: Set) -> Optional[Tuple[object, int]]:
  """``(loop output, bytes)``: the stacked output of a loop, made from the step's data, that ``var`` is (a
  view of), with the fewest bytes along the way (a view may be materialised instead of its source);
  ``None`` for anything else."""
  size = _nbytes(var)
  while True:
    eqn = producer.get(var)
    if eqn is None or var not in data:
      return None
    size = min(size, _nbytes(var))
    if eqn.primitive.name in ('scan', 'while'):
      return var, size
    sources = [x for x in eqn.invars if _is_var(x)]
    if eqn.primitive.name not in _VIEWS or len(sources) != 1:
      return None
    var = sources[0]
