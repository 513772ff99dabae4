"""The package's shape: short functions, short calls, no import cycles.

Read from the source with `ast`, so a violation names the file and line:

* no function (methods and nested functions included) is longer than
  `MAX_FUNCTION_LINES`, from its `def` line to its last line;
* no call passes more than `MAX_POSITIONAL_ARGS` positional arguments (a
  long positional list is where swapped arguments hide; pass a named
  structure instead);
* no module imports, at import time, a module that imports it back (imports
  inside functions are not import-time imports).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pz_sparsecore"
MAX_FUNCTION_LINES = 80
MAX_POSITIONAL_ARGS = 12


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name → source file, for every module of the package."""
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


MODULES = _modules()


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(), filename=str(path))


def _long_functions(path: pathlib.Path) -> list[str]:
  return [
    f"{path.name}:{node.lineno} {node.name} "
    f"({node.end_lineno - node.lineno + 1} lines)"
    for node in ast.walk(_tree(path))
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
  ]


def _long_calls(path: pathlib.Path) -> list[str]:
  return [
    f"{path.name}:{node.lineno} ({len(node.args)} positional arguments)"
    for node in ast.walk(_tree(path))
    if isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL_ARGS
  ]


def _resolve(name: str) -> str | None:
  """The package module an imported dotted name refers to, if any."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _import_time_imports(module: str) -> set[str]:
  """Package modules `module` imports at module level."""
  path = MODULES[module]
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  found = set()
  for node in _tree(path).body:
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.rsplit(".", node.level - 1)[0]
        base = f"{anchor}.{base}" if base else anchor
      names = [f"{base}.{alias.name}" for alias in node.names]
    else:
      continue
    for name in names:
      target = _resolve(name)
      # A module always imports its parent packages first; that is Python's
      # doing, not a dependency the module chose.
      if target and target != module and not module.startswith(target + "."):
        found.add(target)
  return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_are_short(module):
  assert _long_functions(MODULES[module]) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_calls_pass_few_positional_arguments(module):
  assert _long_calls(MODULES[module]) == []


def test_no_import_cycles():
  graph = {m: _import_time_imports(m) for m in MODULES}
  cycles = []

  def visit(module, stack, done):
    if module in stack:
      cycles.append(stack[stack.index(module) :] + [module])
      return
    if module in done:
      return
    for target in sorted(graph[module]):
      visit(target, stack + [module], done)
    done.add(module)

  done: set[str] = set()
  for module in sorted(graph):
    visit(module, [], done)
  assert cycles == []


def test_the_checks_see_violations(tmp_path):
  """The checks flag what they are meant to flag (they can fail)."""
  source = tmp_path / "bad.py"
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
  args = ", ".join(str(i) for i in range(MAX_POSITIONAL_ARGS + 1))
  source.write_text(f"def f():\n{body}\n  g({args})\n")
  assert len(_long_functions(source)) == 1
  assert len(_long_calls(source)) == 1
