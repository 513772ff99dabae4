"""Loading a compiled extension module from a given file.

The package's compiled modules (`_pzsc_ffi`, `_pzsc_ragged`) can each be
replaced by a file named in an environment variable (`PZSC_FFI_LIBRARY`,
`PZSC_RAGGED_LIBRARY`), e.g. a sanitizer build (`make test-asan`); the file
is loaded under the installed module's name.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType


def load_file(path: str, module_name: str) -> ModuleType:
  """Loads the extension module in `path` under `module_name`."""
  spec = importlib.util.spec_from_file_location(module_name, path)
  if spec is None or spec.loader is None:
    raise ImportError(f"{path} is not a Python extension module")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sys.modules[module_name] = module
  return module


def load(module_name: str, env_var: str) -> ModuleType:
  """`module_name`, or the file that `env_var` names when it is set."""
  path = os.environ.get(env_var)
  if path:
    return load_file(path, module_name)
  return importlib.import_module(module_name)


READER_MODULE = "pz_sparsecore._pzsc_ragged"
"""The compiled ragged-id reader of host preprocessing."""
READER_ENV = "PZSC_RAGGED_LIBRARY"
"""Environment variable: a path to the reader module to load instead of the
installed one (e.g. a sanitizer build)."""


def reader_path() -> str | None:
  """The compiled ragged-id reader's file, or None if it does not load
  (host preprocessing loads it; `backend_info` reports it)."""
  module = sys.modules.get(READER_MODULE)
  if module is None:
    try:
      module = load(READER_MODULE, READER_ENV)
    except ImportError:
      return None
  return getattr(module, "__file__", None)
