"""Where a first ``fit`` spends its time, by phase: what the planner, the first-batch check and the steps cost.

The package marks its few phases that bp.BPTT does not have with :func:`phase` (a list append and pop when
nothing records them); :func:`record_phases` records, for each phase, its wall seconds on the thread that
calls ``fit`` (a phase nested in another counts in the inner one only) and the XLA compilations in it (JAX's
own monitoring events: ``/jax/core/compile/backend_compile_duration``). Time in no phase is the steps' own: on
the ``fit`` thread, its XLA compilations (``step compile``, bp.BPTT's included) and the rest (tracing, the
batches' transfer and run, the loop: ``runs and the rest``). Work on another thread (the first-batch check
compiling beside the steps) is recorded apart, as ``beside``: it costs the ``fit`` thread only what it waits
for it (``first-batch check``).

Examples
--------
>>> from brainpy_accum.diagnostics._phases import phase, record_phases
>>> with record_phases() as recorded:
...   with phase('planning probes'):
...     pass
>>> sorted(recorded.table())[:2]
['beside', 'first-batch check']
"""

import contextlib
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

import jax.monitoring

__all__ = ['PHASES', 'PhaseRecord', 'phase', 'record_phases']

# the marked phases, then the time in none split in two; ``total``: the whole span
PHASES = ('planning probes', 'planned step compiles', 'trial runs', 'planning (other)', 'first-batch check',
          'step compile', 'runs and the rest')
_BACKEND_COMPILE = '/jax/core/compile/backend_compile_duration'
_local = threading.local()  # each thread's stack of open phases: [name, start, seconds of the phases inside]
_recorders: List['PhaseRecord'] = []


def _stack() -> list:
  if not hasattr(_local, 'stack'):
    _local.stack = []
  return _local.stack


@contextlib.contextmanager
def phase(name: str, note: Optional[str] = None) -> Iterator[None]:
  """Mark the work inside as phase ``name`` (one of :data:`PHASES`) for any :func:`record_phases` open now;
  ``note`` (what it was: a plan compiled) adds the span to the record's :attr:`PhaseRecord.events` (its whole
  span, phases opened inside it included, where the phase table counts those apart)."""
  stack = _stack()
  stack.append([name, time.perf_counter(), 0.])
  try:
    yield
  finally:
    name, start, inner = stack.pop()
    seconds = time.perf_counter() - start
    if stack:
      stack[-1][2] += seconds
    for record in list(_recorders):
      record.add(name, seconds - inner, 'seconds')
      if note is not None:
        record.events.append((name, note, seconds))


class PhaseRecord:
  """Seconds and XLA compilations by phase, recorded while :func:`record_phases` is open; ``events``: the spans
  marked with a note, in order, ``(phase, note, seconds)`` (the planner's compilations, each with its plan)."""

  def __init__(self, thread: threading.Thread):
    self.thread, self.start, self.total = thread, time.perf_counter(), None
    self.phases: Dict[str, Dict[str, float]] = {}
    self.events: List[Tuple[str, str, float]] = []
    self._lock = threading.Lock()

  def add(self, name: str, value: float, field: str) -> None:
    """Add ``value`` to ``field`` (``'seconds'``, ``'compile_seconds'``, ``'compilations'``) of phase ``name``;
    work on another thread than the recording one goes to ``'beside'``."""
    if threading.current_thread() is not self.thread:
      name = 'beside'
    with self._lock:
      entry = self.phases.setdefault(name, {'seconds': 0., 'compile_seconds': 0., 'compilations': 0})
      entry[field] += value

  def compiled(self, seconds: float) -> None:
    """One XLA compilation of ``seconds``, in the phase open on the thread that compiled (``step compile``
    where none is)."""
    stack = _stack()
    name = stack[-1][0] if stack else 'step compile'
    self.add(name, seconds, 'compile_seconds')
    self.add(name, 1, 'compilations')

  def table(self) -> Dict[str, Dict[str, float]]:
    """``{phase: {'seconds', 'compile_seconds', 'compilations'}}`` for every phase of :data:`PHASES`, ``'beside'``
    and ``'total'``: the steps' compilations outside the marked phases are ``step compile``'s seconds, and the
    time in no phase, less those, ``runs and the rest``."""
    total = (time.perf_counter() - self.start) if self.total is None else self.total
    table = {name: dict(self.phases.get(name, {'seconds': 0., 'compile_seconds': 0., 'compilations': 0}))
             for name in PHASES + ('beside',)}
    table['step compile']['seconds'] = table['step compile']['compile_seconds']
    marked = sum(table[name]['seconds'] for name in PHASES if name != 'runs and the rest')
    table['runs and the rest']['seconds'] = max(0., total - marked)
    table['total'] = {'seconds': total, 'compile_seconds': sum(t['compile_seconds'] for t in table.values()),
                      'compilations': sum(t['compilations'] for t in table.values())}
    return table


def _compiled(event: str, duration_secs: float, **kwargs) -> None:
  if event == _BACKEND_COMPILE:
    for record in list(_recorders):
      record.compiled(duration_secs)


jax.monitoring.register_event_duration_secs_listener(_compiled)


@contextlib.contextmanager
def record_phases() -> Iterator[PhaseRecord]:
  """``with record_phases() as recorded: trainer.fit(...)``; then ``recorded.table()`` (see
  :meth:`PhaseRecord.table`), the calling thread's seconds by phase."""
  record = PhaseRecord(threading.current_thread())
  _recorders.append(record)
  try:
    yield record
  finally:
    record.total = time.perf_counter() - record.start
    _recorders.remove(record)
