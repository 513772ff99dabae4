"""Shared test setup: eight virtual CPU devices for the sharding tests."""

import os

# Must run before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def pytest_collection_modifyitems(config, items):
  """Keeps `--dist loadgroup`'s groups together on pytest 9.

  pytest-xdist (3.8) marks a test of an `xdist_group` by appending
  `@group` to its node id through `item._nodeid`, which pytest 9 no longer
  reads (the id lives in `item._id`), so grouped tests spread over the
  workers: the docs build and the CLI's run were built on both, and the
  multi-process tests ran beside each other. On the workers (where xdist
  sets `config.option.loadgroup`), the suffix is added here.
  """
  if not getattr(config.option, "loadgroup", False):
    return
  try:
    from _pytest.nodeid import coerce_node_id
  except ImportError:  # pytest 8: xdist's own renaming works.
    return
  for item in items:
    names = sorted(
      {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
      }
    )
    suffix = "@" + "_".join(names)
    if names and hasattr(item, "_id") and not item.nodeid.endswith(suffix):
      item._id = coerce_node_id(item.nodeid + suffix)
