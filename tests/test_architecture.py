"""The package's shape, measured: a thin trainer, short functions, folders of a readable size, no reaching in.

Run as a script (``python tests/test_architecture.py``) it prints the figures; as tests they must hold. Lines of
code are counted as the source lines of a class or function, docstrings aside (blank lines and comments count).
"""

import ast
import pathlib
import sys
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'brainpy_accum'
MAX_CLASS_LINES, MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PUBLIC_NAMES, MAX_MODULES = 350, 600, 45, 12, 12
# the fit loop: its module, the other trainer modules, the arguments of its methods (besides self), the fields of
# the view it has of the trainer and of the trainer's hooks, and the lines that handle the first-batch check
LOOP = PACKAGE / 'trainer' / '_fit_loop.py'
# the memory planner composes its parts (the budget, the plan cache's dialogue, streaming) and plans a batch size
PLANNER, MAX_PLANNER_LINES = PACKAGE / 'memory' / '_planner.py', 500
MAX_LOOP_LINES, MAX_TRAINER_MODULE_LINES, MAX_LOOP_ARGUMENTS, MAX_VIEW_FIELDS, MAX_HOOKS, MAX_CHECK_LINES = (
  350, 500, 4, 12, 10, 10)
PARTS = {'StepParts', 'StepOptions', 'CheckParts', 'PlannedModel', 'TrainerHooks', 'LoopView', 'LoopSettings'}
# what NamedTuples offer as their public API, despite the underscore
NAMED_TUPLE_API = {'_replace', '_asdict', '_fields', '_make'}


def _modules() -> Iterator[Tuple[pathlib.Path, ast.Module]]:
  for path in sorted(PACKAGE.rglob('*.py')):
    yield path, ast.parse(path.read_text())


def _docstring_lines(tree: ast.AST) -> Set[int]:
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def _code_lines(node: ast.AST, docstrings: Set[int]) -> int:
  return sum(1 for line in range(node.lineno, node.end_lineno + 1) if line not in docstrings)


def trainer_class_lines() -> Dict[str, int]:
  """Lines of code of AccumBPTT and of every base class the package defines."""
  import brainpy_accum
  counts = {}
  for cls in brainpy_accum.AccumBPTT.__mro__:
    if cls.__module__.startswith('brainpy_accum'):
      path = pathlib.Path(sys.modules[cls.__module__].__file__)
      tree = ast.parse(path.read_text())
      node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
      counts[cls.__name__] = _code_lines(node, _docstring_lines(tree))
  return counts


def trainer_module_lines() -> int:
  return len((PACKAGE / 'trainer' / '_accum_bptt.py').read_text().splitlines())


def module_lines() -> Dict[str, int]:
  """Lines of every module of the package, by its path."""
  return {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
          for path in sorted(PACKAGE.rglob('*.py'))}


def long_functions() -> List[Tuple[int, str]]:
  """``(lines, 'module:function')`` of every function longer than the limit, docstrings aside."""
  found = []
  for path, tree in _modules():
    docstrings = _docstring_lines(tree)
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = _code_lines(node, docstrings)
        if lines > MAX_FUNCTION_LINES:
          found.append((lines, f'{path.relative_to(PACKAGE.parent)}:{node.name}'))
  return sorted(found, reverse=True)


def public_names_beyond_bptt() -> List[str]:
  import brainpy as bp
  import brainpy_accum
  return sorted(n for n in set(dir(brainpy_accum.AccumBPTT)) - set(dir(bp.BPTT)) if not n.startswith('_'))


def modules_per_folder() -> Dict[str, int]:
  """Modules of each folder of the package, ``__init__.py`` aside."""
  return {str(folder.relative_to(PACKAGE.parent)): len([p for p in folder.glob('*.py') if p.name != '__init__.py'])
          for folder in [PACKAGE, *sorted(p for p in PACKAGE.iterdir() if p.is_dir() and p.name != '__pycache__')]}


def _root(node: ast.AST) -> ast.AST:
  while isinstance(node, ast.Attribute):
    node = node.value
  return node


def private_reads() -> List[str]:
  """``x._name`` where ``x`` is neither ``self``/``cls`` nor a module (or an attribute of one, a library's own
  state): a reach into another object's privates."""
  found = []
  for path, tree in _modules():
    imported = {(alias.asname or alias.name).split('.')[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr.startswith('_') and not node.attr.startswith('__')
          and node.attr not in NAMED_TUPLE_API):
        owner, root = node.value, _root(node.value)
        if isinstance(owner, ast.Name) and owner.id in ('self', 'cls'):
          continue
        if isinstance(root, ast.Name) and root.id in imported and root.id not in ('self', 'cls'):
          continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == 'super':
          continue  # a method of the base class the subclass overrides
        found.append(f'{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}')
  return found


def trainer_module_sizes() -> Dict[str, int]:
  """Lines of every module of ``trainer/`` but the trainer's own (:func:`trainer_module_lines`)."""
  return {path.name: len(path.read_text().splitlines()) for path in sorted((PACKAGE / 'trainer').glob('_*.py'))
          if path.name not in ('__init__.py', '_accum_bptt.py')}


def loop_arguments() -> Dict[str, List[str]]:
  """The arguments, ``self`` aside, of every function and method of the fit loop's module and of the first-batch
  check's life in it (``_fit_check.py``), by ``module:name``."""
  found = {}
  for module in (LOOP, LOOP.parent / '_fit_check.py'):
    for node in ast.walk(ast.parse(module.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
        found[f'{module.stem}:{node.name}'] = [a.arg for a in args if a.arg not in ('self', 'cls')] + (
          [node.args.vararg.arg] if node.args.vararg else []) + ([node.args.kwarg.arg] if node.args.kwarg else [])
  return found


def named_tuple_fields(name: str) -> int:
  """Fields of the NamedTuple ``name`` of the fit loop's module."""
  tree = ast.parse(LOOP.read_text())
  node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
  return sum(isinstance(item, ast.AnnAssign) for item in node.body)


def parts_built_by_position() -> List[str]:
  """Calls in the trainer's module that build one of its parts with positional arguments."""
  tree = ast.parse((PACKAGE / 'trainer' / '_accum_bptt.py').read_text())
  return [f'{node.func.id}:{node.lineno}' for node in ast.walk(tree) if isinstance(node, ast.Call)
          and isinstance(node.func, ast.Name) and node.func.id in PARTS and node.args]


def trainer_module_lambdas() -> List[int]:
  """Lines of the trainer's module with a lambda (parts that read the trainer later than they were built)."""
  tree = ast.parse((PACKAGE / 'trainer' / '_accum_bptt.py').read_text())
  return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Lambda)]


def callables_returning_callables() -> List[str]:
  """Annotations in ``trainer/`` of a callable that returns a callable."""
  found = []
  for path in sorted((PACKAGE / 'trainer').glob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      annotations = []
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
        annotations.append(node.returns)
      if isinstance(node, (ast.AnnAssign, ast.arg)) and getattr(node, 'annotation', None) is not None:
        annotations.append(node.annotation)
      for annotation in annotations:
        text = ast.unparse(annotation)
        if text.count('Callable[') >= 2 or (isinstance(node, ast.FunctionDef) and 'Callable[' in text
                                            and 'ContextManager' not in text):
          found.append(f'{path.name}:{node.lineno}: {text}')
  return found


def check_lines() -> List[int]:
  """Lines of the fit loop's module that handle the first-batch check (its object and its calls)."""
  return [i for i, line in enumerate(LOOP.read_text().splitlines(), 1) if 'self.check' in line or 'FitCheck' in line]


def test_trainer_class_is_thin():
  counts = trainer_class_lines()
  assert set(counts) == {'AccumBPTT'}, f'no base classes of the package (mixins): {counts}'
  assert sum(counts.values()) <= MAX_CLASS_LINES, counts


def test_every_module_is_readable_in_one_sitting():
  assert trainer_module_lines() <= MAX_MODULE_LINES
  assert {path: n for path, n in module_lines().items() if n > MAX_MODULE_LINES} == {}


def test_the_planner_composes_its_parts_in_a_short_module():
  assert len(PLANNER.read_text().splitlines()) <= MAX_PLANNER_LINES


def test_no_function_is_long():
  assert long_functions() == []


def test_trainer_adds_few_public_names_to_bptt():
  names = public_names_beyond_bptt()
  assert len(names) <= MAX_PUBLIC_NAMES, names


def test_no_folder_is_crowded():
  crowded = {folder: count for folder, count in modules_per_folder().items() if count > MAX_MODULES}
  assert crowded == {}


def test_nothing_reads_another_objects_privates():
  assert private_reads() == []


def test_the_fit_loop_is_an_object_of_few_arguments_that_never_takes_the_trainer():
  assert len(LOOP.read_text().splitlines()) <= MAX_LOOP_LINES
  arguments = loop_arguments()
  assert {name: args for name, args in arguments.items() if len(args) > MAX_LOOP_ARGUMENTS} == {}
  assert [name for name, args in arguments.items() if 'trainer' in args] == []
  assert named_tuple_fields('LoopView') <= MAX_VIEW_FIELDS and named_tuple_fields('TrainerHooks') <= MAX_HOOKS
  assert len(check_lines()) <= MAX_CHECK_LINES, check_lines()


def test_trainer_modules_are_readable_and_parts_are_built_by_keyword():
  assert {name: n for name, n in trainer_module_sizes().items() if n > MAX_TRAINER_MODULE_LINES} == {}
  assert parts_built_by_position() == [] and trainer_module_lambdas() == []
  assert callables_returning_callables() == []


if __name__ == '__main__':
  print('AccumBPTT class lines (docstrings aside):', trainer_class_lines(), f'(<= {MAX_CLASS_LINES})')
  print('trainer module lines:', trainer_module_lines(), f'(<= {MAX_MODULE_LINES}); planner module lines:',
        len(PLANNER.read_text().splitlines()), f'(<= {MAX_PLANNER_LINES})')
  print('modules over the limit:', {p: n for p, n in module_lines().items() if n > MAX_MODULE_LINES},
        f'(<= {MAX_MODULE_LINES})')
  print(f'functions over {MAX_FUNCTION_LINES} lines:', long_functions())
  names = public_names_beyond_bptt()
  print(f'public names beyond bp.BPTT: {len(names)} (<= {MAX_PUBLIC_NAMES})', names)
  print('modules per folder:', modules_per_folder(), f'(<= {MAX_MODULES})')
  print('reads of another object\'s privates:', private_reads())
  print('fit loop lines:', len(LOOP.read_text().splitlines()), f'(<= {MAX_LOOP_LINES}); trainer modules:',
        trainer_module_sizes(), f'(<= {MAX_TRAINER_MODULE_LINES})')
  print('fit loop arguments over the limit:', {n: a for n, a in loop_arguments().items() if len(a) > MAX_LOOP_ARGUMENTS})
  print('LoopView fields:', named_tuple_fields('LoopView'), 'TrainerHooks fields:', named_tuple_fields('TrainerHooks'))
  print('parts built by position:', parts_built_by_position(), 'lambdas in the trainer module:',
        trainer_module_lambdas(), 'callables returning callables:', callables_returning_callables())
  print('lines of the loop that handle the first-batch check:', check_lines())
