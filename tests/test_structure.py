"""The package's shape: stages, short functions, short calls, no cycles.

Read from the source with `ast`, so a violation names the file and line:

* no function (methods and nested functions included) has more than
  `MAX_FUNCTION_LINES` lines of code, from its `def` line to its last line,
  its docstring not counted;
* no call passes more than `MAX_POSITIONAL_ARGS` positional arguments (a
  long positional list is where swapped arguments hide; pass a named
  structure instead);
* no import cycle, counting imports inside functions and
  `importlib.import_module("...")` calls (those under `TYPE_CHECKING` and
  in `nn`'s lazy Treescope hooks aside);
* the stages import in the pipeline's order (`STAGE_RANK`): `core` imports
  no other stage anywhere (no exception: not in a function, a hook or under
  `TYPE_CHECKING`), `host` and `device` import `core` only, `nn` no `viz`
  but from its Treescope hooks;
* the package root holds `__init__`, `__main__` and at most two more
  modules, and the device stage never loads numba;
* no source cites a document outside the repository (`OUTSIDE_DOCUMENTS`).
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pz_sparsecore"
MAX_FUNCTION_LINES = 80
MAX_POSITIONAL_ARGS = 12
STAGE_RANK = {"core": 0, "host": 1, "device": 1, "nn": 2, "viz": 3}
"""The pipeline's stages in data-flow order: a stage imports only stages of
a lower rank (or itself); `host` and `device` share a rank and never import
each other. `compat`, `models` and `data` sit above every stage."""
LAZY_HOOKS = ("__treescope_repr__", "treescope_summary")
"""Functions whose imports are Treescope's lazy rendering hooks, allowed in
`LAZY_HOOK_STAGES` only: a Penzai layer renders itself through `viz` from
its own `__treescope_repr__` (Penzai's structs define one, which Treescope
asks before its handler registry). `core`'s types have none: `viz`
registers their renderers with Treescope."""
LAZY_HOOK_STAGES = ("nn",)
STRICT_STAGE = "core"
"""The stage whose imports are all counted (hooks and `TYPE_CHECKING`
included): it names no other stage at all."""
IMPORT_CALLS = ("importlib.import_module", "import_module", "__import__")
"""Calls whose literal first argument is an import."""
MAX_ROOT_MODULES = 2
OUTSIDE_DOCUMENTS = ("research notes", "notes section", "notes \u00a7")
"""Citations of documents that are not in the repository."""
SOURCES = sorted(
  p
  for folder in ("pz_sparsecore", "tests", "benchmarks", "csrc")
  for p in (PACKAGE.parent / folder).rglob("*")
  if p.suffix in (".py", ".cc", ".h", ".cu")
)


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


def _docstring_lines(node: ast.AST) -> int:
  """Lines of `node`'s docstring, if its body opens with one."""
  body = getattr(node, "body", None)
  if not body or not isinstance(body[0], ast.Expr):
    return 0
  value = body[0].value
  if not isinstance(value, ast.Constant) or not isinstance(value.value, str):
    return 0
  return body[0].end_lineno - body[0].lineno + 1


def _long_functions(path: pathlib.Path) -> list[str]:
  """Functions with more than `MAX_FUNCTION_LINES` lines of code (docstrings
  of the function and of the functions and classes inside it excluded)."""
  out = []
  for node in ast.walk(_tree(path)):
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      continue
    docs = sum(
      _docstring_lines(inner)
      for inner in ast.walk(node)
      if isinstance(
        inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
      )
    )
    lines = node.end_lineno - node.lineno + 1 - docs
    if lines > MAX_FUNCTION_LINES:
      out.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
  return out


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


def _skipped_nodes(tree: ast.Module, stage: str | None) -> set[int]:
  """Nodes whose imports do not count in a module of `stage`: under `if
  TYPE_CHECKING:` and inside the lazy hooks (`LAZY_HOOK_STAGES` only);
  none in `STRICT_STAGE`."""
  if stage == STRICT_STAGE:
    return set()
  skipped = set()
  for node in ast.walk(tree):
    hook = (
      isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
      and node.name in LAZY_HOOKS
      and stage in LAZY_HOOK_STAGES
    )
    checking = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
      node.test
    )
    if hook or checking:
      skipped.update(id(inner) for inner in ast.walk(node))
  return skipped


def _imported_names(node: ast.AST, package: str) -> list[str]:
  """The dotted names `node` imports: an `import`, a `from ... import` or
  an import call (`IMPORT_CALLS`) with a literal name; else none."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:
      anchor = package.rsplit(".", node.level - 1)[0]
      base = f"{anchor}.{base}" if base else anchor
    return [f"{base}.{alias.name}" for alias in node.names]
  if (
    isinstance(node, ast.Call)
    and ast.unparse(node.func) in IMPORT_CALLS
    and node.args
    and isinstance(node.args[0], ast.Constant)
    and isinstance(node.args[0].value, str)
  ):
    return [node.args[0].value]
  return []


def _imports(module: str, path: pathlib.Path | None = None) -> dict[str, int]:
  """Package modules `module` (read from `path`, by default its file)
  imports anywhere (module level or inside functions) -> the line of the
  first such import."""
  path = path or MODULES[module]
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  tree = _tree(path)
  skipped = _skipped_nodes(tree, _stage(module))
  found: dict[str, int] = {}
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    names = _imported_names(node, package)
    for name in names:
      target = _resolve(name)
      # A module always imports its parent packages first; that is Python's
      # doing, not a dependency the module chose.
      if target and target != module and not module.startswith(target + "."):
        found.setdefault(target, node.lineno)
  return found


def _stage(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and parts[1] in STAGE_RANK else None


def _upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
  """Imports against the stage order, as `module:line -> target`."""
  out = []
  for module, targets in sorted(graph.items()):
    source = _stage(module)
    for target, line in sorted(targets.items()):
      stage = _stage(target)
      if source is None or stage is None or stage == source:
        continue
      if STAGE_RANK[stage] >= STAGE_RANK[source]:
        out.append(f"{module}:{line} -> {target}")
  return out


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
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
  return cycles


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_are_short(module):
  assert _long_functions(MODULES[module]) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_calls_pass_few_positional_arguments(module):
  assert _long_calls(MODULES[module]) == []


def test_no_import_cycles():
  graph = {m: _imports(m) for m in MODULES}
  assert _cycles(graph) == []


def test_stages_import_in_pipeline_order():
  graph = {m: _imports(m) for m in MODULES}
  assert _upward_imports(graph) == []


def test_package_root_is_small():
  extra = sorted(
    p.name
    for p in PACKAGE.glob("*.py")
    if p.name not in ("__init__.py", "__main__.py")
  )
  assert len(extra) <= MAX_ROOT_MODULES, extra


def _loaded_after_importing(modules: list[str], bad: str) -> list[str]:
  """The modules `m` loaded in a fresh process that imported `modules`
  for which the expression `bad` is true."""
  code = (
    "import importlib, json, sys\n"
    f"for m in {modules!r}: importlib.import_module(m)\n"
    f"print(json.dumps(sorted(m for m in sys.modules if {bad})))\n"
  )
  run = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=False
  )
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout)


def test_device_stage_loads_no_numba_and_no_host():
  """Every module under `device` imports without numba or `host`."""
  device = sorted(m for m in MODULES if _stage(m) == "device")
  bad = "m == 'numba' or m.startswith(('numba.', 'pz_sparsecore.host'))"
  assert _loaded_after_importing(device, bad) == []


def test_core_stage_loads_no_other_stage():
  """Every module under `core` imports without another stage."""
  core = sorted(m for m in MODULES if _stage(m) == STRICT_STAGE)
  bad = (
    "m.startswith('pz_sparsecore.') and "
    "m.split('.')[1] not in ('core', '_extension')"
  )
  assert _loaded_after_importing(core, bad) == []


def _outside_citations(path: pathlib.Path) -> list[str]:
  return [
    f"{path.name}:{number}"
    for number, line in enumerate(path.read_text().splitlines(), 1)
    if any(phrase in line.lower() for phrase in OUTSIDE_DOCUMENTS)
    and path.name != "test_structure.py"
  ]


def test_sources_cite_only_the_repository():
  found = [hit for path in SOURCES for hit in _outside_citations(path)]
  assert found == []


def test_the_checks_see_violations(tmp_path):
  """The checks flag what they are meant to flag (they can fail)."""
  source = tmp_path / "bad.py"
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
  args = ", ".join(str(i) for i in range(MAX_POSITIONAL_ARGS + 1))
  source.write_text(f"def f():\n{body}\n  g({args})\n")
  assert len(_long_functions(source)) == 1
  assert len(_long_calls(source)) == 1
  # A long docstring does not count; code does.
  doc = "\n".join(['  """Doc.'] + ["  more"] * MAX_FUNCTION_LINES + ['  """'])
  short = tmp_path / "short.py"
  short.write_text(f"def f():\n{doc}\n  return 1\n")
  assert _long_functions(short) == []
  cites = tmp_path / "cites.py"
  cites.write_text('"""The equations (research notes, 4.3)."""\n')
  assert _outside_citations(cites) == ["cites.py:1"]
  # Cycles and upward imports through function-level imports are seen.
  graph = {
    "pz_sparsecore.core.a": {"pz_sparsecore.host.b": 3},
    "pz_sparsecore.host.b": {"pz_sparsecore.core.a": 5},
    "pz_sparsecore.device.c": {"pz_sparsecore.host.b": 7},
  }
  assert _cycles(graph)
  assert _upward_imports(graph) == [
    "pz_sparsecore.core.a:3 -> pz_sparsecore.host.b",
    "pz_sparsecore.device.c:7 -> pz_sparsecore.host.b",
  ]


def test_core_imports_count_everywhere(tmp_path):
  """An import of `viz` in a `core` module is seen wherever it is: in a
  Treescope hook, under `TYPE_CHECKING`, or as `importlib.import_module`;
  the hook is allowed in `nn` only."""
  source = tmp_path / "hooked.py"
  source.write_text(
    "import importlib\n"
    "from typing import TYPE_CHECKING\n"
    "if TYPE_CHECKING:\n"
    "  from pz_sparsecore.host import fdo\n"
    "class A:\n"
    "  def __treescope_repr__(self, path, renderer):\n"
    "    from pz_sparsecore.viz import treescope\n"
    "  def later(self):\n"
    "    return importlib.import_module('pz_sparsecore.device.topology')\n"
  )
  core = _imports("pz_sparsecore.core.hooked", source)
  assert core == {
    "pz_sparsecore.host.fdo": 4,
    "pz_sparsecore.viz.treescope": 7,
    "pz_sparsecore.device.topology": 9,
  }
  assert len(_upward_imports({"pz_sparsecore.core.hooked": core})) == 3
  layer = _imports("pz_sparsecore.nn.hooked", source)
  assert layer == {"pz_sparsecore.device.topology": 9}
  # Elsewhere the hook's import counts too; `TYPE_CHECKING` does not.
  device = _imports("pz_sparsecore.device.hooked", source)
  assert device == {
    "pz_sparsecore.viz.treescope": 7,
    "pz_sparsecore.device.topology": 9,
  }
