"""Shared test setup: eight virtual CPU devices for the sharding tests."""

import os

# Must run before jax is imported anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
