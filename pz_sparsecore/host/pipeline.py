"""A prefetching input pipeline: preprocess the next batches during the step.

Host preprocessing (the numba kernels release the GIL) costs about as much
per id as the device step, so running them one after the other wastes half
the time. `prefetch(batches, preprocess, depth=2)` runs `preprocess` on the
raw batches in one background thread and hands the results over, in order,
through a queue of `depth` slots::

  with pzsc.prefetch(raw_batches, prepare) as pipeline:
    for kwargs in pipeline:
      trainer.step(**kwargs)

With a step of 10 ms and a preprocessing of 8 ms per batch, a plain loop
takes 18 ms per step. Pipelined, the caller waits 8 ms for batch 0; from
then on the thread has batch k + 1 ready before step k ends, so the loop
takes 10 ms per step (the thread idles 2 ms per step; with preprocessing
slower than the step, the step waits instead). The overlap is as good as
the share of `preprocess` that runs without the GIL (numba kernels, large
numpy operations, transfers): its Python-level work takes turns with the
step's dispatch in the caller's thread. On CPU devices the step and the
preprocessing also share the cores.

Bounds: the thread pulls a batch from `batches` only when a slot is free, so
it is never more than `depth + 1` batches ahead of the caller (`depth`
waiting in the queue, one in its hands).

Errors: an exception raised by the source (`next(batches)`) or by
`preprocess` for batch `k` reaches the caller when it asks for batch `k`,
after batches `0..k-1` were delivered, as a `PrefetchError` naming the batch
and chained to the original (`raise ... from exc`). When the original is an
`Exception` of another type, the error is also an instance of that type, so
`except ValueError` around a loop catches a bad batch's `ValueError`.
Nothing after batch `k` is pulled from the source, so a new pipeline over
the same iterator continues with batch `k + 1`.

Shutdown: `close()` (also on leaving the `with` block, or when the pipeline
is garbage collected, e.g. after `break` out of a `for` loop over a
temporary) stops the thread: it finishes the batch in its hands (the
source's `next` or `preprocess`), pulls no other, and exits, even when the
source is infinite or the queue is full. `close()` waits for it; the
batches still queued are dropped.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

Raw = TypeVar("Raw")
Out = TypeVar("Out")

# How often a thread waiting on the queue checks whether it was stopped.
_POLL_S = 0.05

# Kinds of queue entries.
_BATCH, _END, _SOURCE_ERROR, _PREPROCESS_ERROR = range(4)

# Exceptions that keep their own meaning in iteration protocols, so they are
# never re-raised as their own type from `__next__`.
_NOT_MIXED = (StopIteration, StopAsyncIteration, GeneratorExit)


class PrefetchError(Exception):
  """A batch of a `prefetch` pipeline failed; `__cause__` is why.

  Attributes:
    batch_number: The failing batch's position in the source (from 0).
  """

  batch_number: int

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""


@functools.cache
def _error_type(cause: type[BaseException]) -> type[PrefetchError]:
  """`PrefetchError`, also a subclass of `cause` where that is possible."""
  if not issubclass(cause, Exception) or issubclass(cause, _NOT_MIXED):
    return PrefetchError
  if issubclass(cause, PrefetchError):
    return cause
  try:
    return type(
      f"Prefetch{cause.__name__}",
      (PrefetchError, cause),
      {"__module__": __name__},
    )
  except TypeError:  # Base classes with incompatible instance layouts.
    return PrefetchError


def _batch_error(kind: int, index: int, exc: BaseException) -> PrefetchError:
  """The caller's exception for batch `index`'s failure `exc`."""
  where = "the source" if kind == _SOURCE_ERROR else "preprocess"
  message = f"batch {index}: {where} raised {type(exc).__name__}: {exc}"
  try:
    error = _error_type(type(exc))(message)
  except TypeError:  # The type's constructor wants other arguments.
    error = PrefetchError(message)
  error.batch_number = index
  return error


def _put(out: queue.Queue, entry: tuple, stop: threading.Event) -> bool:
  """Puts `entry` once a slot is free; False if stopped while waiting."""
  while not stop.is_set():
    try:
      out.put(entry, timeout=_POLL_S)
      return True
    except queue.Full:
      pass
  return False


def _produce(
  source: Iterator[Any],
  preprocess: Callable[[Any], Any] | None,
  out: queue.Queue,
  stop: threading.Event,
) -> None:
  """The thread: pulls, preprocesses and queues batches until told to stop.

  Holds no reference to the `Prefetcher`, so an abandoned one can be
  garbage collected (which stops this thread).
  """
  index = 0
  while not stop.is_set():
    try:
      raw = next(source)
    except StopIteration:
      _put(out, (_END, index, None), stop)
      return
    except BaseException as exc:  # Handed to the caller.
      _put(out, (_SOURCE_ERROR, index, exc), stop)
      return
    try:
      value = raw if preprocess is None else preprocess(raw)
    except BaseException as exc:  # Even StopIteration: not an end here.
      _put(out, (_PREPROCESS_ERROR, index, exc), stop)
      return
    if not _put(out, (_BATCH, index, value), stop):
      return
    del raw, value
    index += 1


def _stop(stop: threading.Event, out: queue.Queue) -> None:
  """Tells the thread to stop and drops the queued batches."""
  stop.set()
  while True:
    try:
      out.get_nowait()
    except queue.Empty:
      return


class Prefetcher(Generic[Out]):
  """Iterator over preprocessed batches, computed ahead in a thread.

  Built by `prefetch`; see the module docstring. Iterate it once; use it as
  a context manager (or call `close`) to stop the thread early.
  """

  def __init__(
    self,
    batches: Iterable[Raw],
    preprocess: Callable[[Raw], Out] | None = None,
    *,
    depth: int = 2,
  ):
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
      raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    if preprocess is not None and not callable(preprocess):
      raise ValueError(f"preprocess must be callable, got {preprocess!r}")
    self.depth = depth
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop_event = threading.Event()
    self._done = False
    self._thread = threading.Thread(
      target=_produce,
      args=(iter(batches), preprocess, self._queue, self._stop_event),
      name="pzsc-prefetch",
      daemon=True,
    )
    # Runs `_stop` on `close()` or when this object is collected.
    self._finalizer = weakref.finalize(
      self, _stop, self._stop_event, self._queue
    )
    self._thread.start()

  def __iter__(self) -> Prefetcher[Out]:
    return self

  def __next__(self) -> Out:
    """The next preprocessed batch (waits for it if it is not ready).

    Raises:
      StopIteration: After the last batch, or once closed.
      PrefetchError: If the source or `preprocess` failed on this batch
        (chained to the original exception; also an instance of its type
        where possible). The pipeline is then closed.
    """
    if self._done:
      raise StopIteration
    while True:
      try:
        kind, index, value = self._queue.get(timeout=_POLL_S)
        break
      except queue.Empty:
        if self._stop_event.is_set():  # Closed from another thread.
          self._done = True
          raise StopIteration from None
    if kind == _BATCH:
      return value
    self.close()
    if kind == _END:
      raise StopIteration
    raise _batch_error(kind, index, value) from value

  def close(self) -> None:
    """Stops the thread and waits for it; queued batches are dropped.

    The thread finishes the batch it is preprocessing, if any, first.
    Calling `close` again does nothing.
    """
    self._done = True
    self._finalizer()
    if threading.current_thread() is not self._thread:
      self._thread.join()

  @property
  def running(self) -> bool:
    """Whether the background thread is still alive."""
    return self._thread.is_alive()

  def __enter__(self) -> Prefetcher[Out]:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()


def prefetch(
  batches: Iterable[Raw],
  preprocess: Callable[[Raw], Out] | None = None,
  *,
  depth: int = 2,
) -> Prefetcher[Out]:
  """Preprocesses `batches` in a background thread, up to `depth` ahead.

  Args:
    batches: Any iterable of raw batches (finite or not). Its iterator is
      advanced only by the pipeline's thread.
    preprocess: Maps a raw batch to what the step takes (for example
      `SparseCoreEmbed.preprocess` plus `jnp.asarray` of the labels);
      None passes the batches through.
    depth: Preprocessed batches that may wait for the caller (>= 1).

  Returns:
    A `Prefetcher`: an iterator of `preprocess(batch)` in order, and a
    context manager that stops the thread on exit.

  Raises:
    ValueError: If `depth` is not an integer >= 1 or `preprocess` is not
      callable.
  """
  return Prefetcher(batches, preprocess, depth=depth)
