"""Processes that agree: one checkpoint restored, one outcome of each save.

With several processes (`jax.distributed`), every process calls
`save_checkpoint` and `restore_checkpoint` with the same arguments, and
each does its own part: it lists the directory, reads and writes its own
devices' shards. Two things can go wrong that no process sees alone:

* the processes see different folders (a network file system whose view
  lags, a copy still in progress) and would pick different checkpoints,
  restoring a table half from one step and half from another;
* one process fails (a missing or damaged file, a full disk) while the
  others wait for it in orbax's barriers or in a collective, which have no
  error path: they wait until JAX's heartbeat or shutdown timeouts abort
  them minutes later, without saying why.

So a save or a restore is an `Operation` with *sync points*: at each, every
process publishes that it got there in the key-value store of JAX's
coordination service (the one `jax.distributed.initialize` starts) and
reads the other processes' keys, polling until all have arrived (at most
`PEER_TIMEOUT_S`). An exception anywhere in the operation is published
before it propagates, so every peer waiting at a sync point of the
operation leaves it within a second with a `PeerError` naming the process,
what it was doing and the cause; the failing process raises its own
exception. Sync points come before orbax's barriers and before any
collective, so no process waits in one for a process that has failed. A
sync point can carry a value: the checkpoint each process would restore
(or the step a save would write) must be the same on all, else every
process raises a `ValueError` naming what each saw (`Operation.agree_step`).

Saves. orbax's barriers already make a save complete only when every
process's part is: the commit (process 0 renames the temporary directory)
waits for every process to finish writing, and every process returns only
after it. They are collectives, though, with no error path: a process
whose write fails leaves the others in them. So the handlers of a save
(`synced`) end at a sync point once their writes are on disk, before
orbax's barrier: a failed write reaches every process there. One gap
remains: process 0 commits alone between two of orbax's barriers, so if
its commit fails (the rename, the merge of the processes' OCDBT files)
the others wait in the second barrier until process 0's program ends
(which ends theirs, `docs/multihost.md`). A last sync point after `keep`'s
deletions makes every process return the save's outcome.

Keys: `pz_sparsecore/checkpoint/<operation>/<sync point>/<process>` (a
JSON value, null where none is shared) and
`.../<operation>/error/<process>` (the cause). Operations are numbered
by a count each process keeps (`_NUMBERS`): all processes make the same
checkpoint calls in the same order, so equal numbers name the same
operation. When a process has passed an operation's
first sync point, every process has begun it, so the keys of the previous
operation are deleted.

Example: restoring onto 2 processes, process 1 cannot read a shard::

  process 0: choose (step 3) ── read ──────────── PeerError: process 1 ...
  process 1: choose (step 3) ── error published ─ ValueError: ...

With one process there is nothing to agree on: sync points return at once
and exceptions propagate as they are.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import traceback
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax._src import distributed

PEER_TIMEOUT_S = 1200
"""Most seconds a process waits at a sync point for a peer that has not
arrived (orbax's own limit on a save). A peer that fails reports at once;
one that died is found by JAX's heartbeat (`docs/multihost.md`)."""

_PREFIX = "pz_sparsecore/checkpoint"
_ERROR = "error"
_POLL_S = (0.01, 0.5)
"""First and longest pause between two reads of the peers' keys."""

_NUMBERS = itertools.count()
"""This process's count of operations (see the module docstring)."""


class PeerError(RuntimeError):
  """A checkpoint operation failed on another process."""


def _cause(error: BaseException) -> str:
  return "".join(traceback.format_exception_only(error)).strip()


def local_only() -> ocp.options.MultiprocessingOptions:
  """orbax options of a reader that waits for no other process (its sync
  points are the operation's)."""
  me = jax.process_index()
  return ocp.options.MultiprocessingOptions(
    primary_host=me, active_processes={me}
  )


class Operation:
  """One save or restore, made by every process; a context manager that
  publishes the exception ending it.

  Attributes:
    what: The call, for messages, e.g. `restore_checkpoint('/ckpt')`.
  """

  def __init__(self, what: str):
    self.what = what
    self._count = jax.process_count()
    self._number = next(_NUMBERS) if self._count > 1 else None
    self._started = False
    self._failed = False

  def __enter__(self) -> Operation:
    return self

  def __exit__(self, kind, error, tb) -> None:
    if error is not None and not isinstance(error, PeerError):
      self.fail(error)

  def _key(self, *parts: Any) -> str:
    return "/".join(map(str, (_PREFIX, self._number, *parts)))

  def fail(self, error: BaseException) -> None:
    """Publishes this process's failure (once) for every peer to raise."""
    if self._number is None or self._failed:
      return
    self._failed = True
    distributed.global_state.client.key_value_set(
      self._key(_ERROR, jax.process_index()), _cause(error)
    )

  def sync(self, point: str, doing: str, value: Any = None) -> list[Any]:
    """Waits until every process has reached sync point `point`.

    Args:
      point: The sync point's name, the same on every process.
      doing: What the processes do before it, for messages, e.g.
        "reading checkpoint 3".
      value: A JSON value to share with the other processes.

    Returns:
      Every process's value, by process index.

    Raises:
      PeerError: If a process failed in the operation (naming it and the
        cause) or did not arrive within `PEER_TIMEOUT_S`.
    """
    if self._number is None:
      return [value]
    client = distributed.global_state.client
    client.key_value_set(
      self._key(point, jax.process_index()), json.dumps(value)
    )
    values = self._gather(point, doing)
    if not self._started and self._number > 0:
      client.key_value_delete(f"{_PREFIX}/{self._number - 1}")
    self._started = True
    return [values[i] for i in range(self._count)]

  def _gather(self, point: str, doing: str) -> dict[int, Any]:
    """Every process's value at `point` (polls the store)."""
    client = distributed.global_state.client
    deadline = time.monotonic() + PEER_TIMEOUT_S
    pause = _POLL_S[0]
    while True:
      values, errors = {}, {}
      for key, value in client.key_value_dir_get(self._key()):
        *_, where, process = key.split("/")
        if where == _ERROR:
          errors[int(process)] = value
        elif where == point:
          values[int(process)] = json.loads(value)
      if errors:
        first = min(errors)
        causes = "; ".join(f"process {i}: {errors[i]}" for i in sorted(errors))
        raise PeerError(
          f"{self.what} failed on process {first} of {self._count} "
          f"({causes}); process {jax.process_index()} was {doing}"
        )
      if len(values) == self._count:
        return values
      if time.monotonic() > deadline:
        silent = sorted(set(range(self._count)) - set(values))
        raise PeerError(
          f"{self.what}: processes {silent} did not finish {doing} "
          f"within {PEER_TIMEOUT_S} s"
        )
      time.sleep(pause)
      pause = min(2 * pause, _POLL_S[1])

  def agree_step(self, point: str, what: str, step: int | None) -> int | None:
    """A step every process must have found equal, e.g. the one to restore.

    Args:
      point: The sync point's name.
      what: What the step is, e.g. "the checkpoint to restore from /ckpt".
      step: This process's step (None: it found no checkpoint).

    Returns:
      The step.

    Raises:
      ValueError: On every process, if the steps differ (naming each
        process's).
      PeerError: If a process failed before it.
    """
    steps = self.sync(point, f"finding {what}", step)
    if any(s != steps[0] for s in steps):
      seen = ", ".join(
        f"process {i} sees " + ("no checkpoint" if s is None else f"step {s}")
        for i, s in enumerate(steps)
      )
      self._failed = True  # Every process raises this; none publishes it.
      raise ValueError(
        f"{self.what}: the processes disagree on {what}: {seen}; every "
        "process must see the same checkpoints (wait until the file system "
        "shows every process the same files, or the copy has finished)"
      )
    return steps[0]


def synced(handler: Any, op: Operation, point: str) -> Any:
  """An orbax handler whose saves end at sync point `point` of `op` once
  their writes are done (commit futures included), or publish why they
  failed.

  The handler keeps its type (orbax finds a handler's arguments by its
  type); only this instance's `async_save` is wrapped.
  """
  save = handler.async_save

  async def async_save(directory, *args, **kwargs) -> None:
    try:
      futures = await save(directory, *args, **kwargs)
      for f in futures or ():
        await asyncio.to_thread(f.result)
    except Exception as e:  # Published for the peers, then raised here.
      op.fail(e)
      raise
    await asyncio.to_thread(op.sync, point, f"writing its {point}")

  handler.async_save = async_save
  return handler
