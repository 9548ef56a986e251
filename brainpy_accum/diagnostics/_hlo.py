"""Counting the cross-device reductions in a compiled step's optimised HLO text.

A reduction inside a ``while`` loop (the micro-batch scan, or the time loop
inside it) runs once per iteration, though the text shows it once; so the
count is split into reductions reached from a loop and the rest.
"""

import re
from typing import Dict, List, NamedTuple

__all__ = ['AllReduceCount', 'count_all_reduces']

_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$')
_ALL_REDUCE = re.compile(r'\sall-reduce(?:-start)?\(')
_CALLED = re.compile(r'(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_LOOP_PARTS = re.compile(r'(?:body|condition)=%?([\w.\-]+)')
_SHAPE = re.compile(r'[a-z]+\d*\[([\d,]*)\]')


def _elements(line: str) -> int:
  result_type = line.split('=', 1)[1].split(' all-reduce', 1)[0]
  total = 0
  for dims in _SHAPE.findall(result_type):
    size = 1
    for dim in filter(None, dims.split(',')):
      size *= int(dim)
    total += size
  return total


class AllReduceCount(NamedTuple):
  """All-reduce instructions of one compiled program.

  Attributes
  ----------
  total : int
    All-reduce instructions in the program text.
  in_loops : int
    Those inside a ``while`` loop (run once per iteration).
  elements : int
    Array elements all the instructions reduce together (each counted once).
  """
  total: int
  in_loops: int
  elements: int


def _computations(hlo_text: str) -> Dict[str, List[str]]:
  bodies: Dict[str, List[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line)
    if match and not line.startswith(' '):
      current = match.group(1)
      bodies[current] = []
    elif current is not None and line.startswith(' '):
      bodies[current].append(line)
  return bodies


def _called(lines: List[str]) -> List[str]:
  names = []
  for line in lines:
    names += _CALLED.findall(line)
    for group in _BRANCHES.findall(line):
      names += [name.strip().lstrip('%') for name in group.split(',')]
  return names


def count_all_reduces(hlo_text: str) -> AllReduceCount:
  """Count the all-reduce instructions of optimised HLO text (``compiled.as_text()``).

  Parameters
  ----------
  hlo_text : str
    The text of a compiled program, e.g. ``trainer.compile_step(x, y).as_text()``.

  Returns
  -------
  AllReduceCount
    ``(total, in_loops)``.

  Examples
  --------
  >>> from brainpy_accum import count_all_reduces
  >>> text = '''
  ... %body (p: f32[]) -> f32[] {
  ...   %p = f32[] parameter(0)
  ...   ROOT %r = f32[] all-reduce(%p), to_apply=%add
  ... }
  ... ENTRY %main (x: f32[]) -> f32[] {
  ...   %w = f32[] while(%x), condition=%cond, body=%body
  ...   ROOT %s = f32[] all-reduce(%w), to_apply=%add
  ... }
  ... '''
  >>> count_all_reduces(text)
  AllReduceCount(total=2, in_loops=1, elements=2)
  """
  bodies = _computations(hlo_text)
  loops = set()
  for lines in bodies.values():
    for line in lines:
      if ' while(' in line:
        loops.update(_LOOP_PARTS.findall(line))
  pending = list(loops)
  while pending:  # everything a loop body calls runs once per iteration too
    for name in _called(bodies.get(pending.pop(), [])):
      if name not in loops:
        loops.add(name)
        pending.append(name)
  found = {name: [line for line in lines if _ALL_REDUCE.search(line)] for name, lines in bodies.items()}
  return AllReduceCount(total=sum(len(lines) for lines in found.values()),
                        in_loops=sum(len(lines) for name, lines in found.items() if name in loops),
                        elements=sum(_elements(line) for lines in found.values() for line in lines))
