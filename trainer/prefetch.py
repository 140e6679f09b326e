"""Prepare the next batch on a background thread while the current step runs.

:class:`Prefetcher` draws items from an iterable and applies ``prepare`` (build a batch from rows, check it, pin it,
start its copy to the device: :meth:`trainer.loop.LocalEngine.prepare`) on one background thread, at most ``depth``
items ahead of the consumer, so the host-side work of step k+1 overlaps step k (a CPU step releases the GIL inside
its torch ops; a CUDA step is asynchronous). The pattern of ``torch.utils.data.DataLoader(pin_memory=True)``'s pin
thread and of TorchRec's ``TrainPipelineBase`` (copy batch i+1 while batch i trains), without worker processes:
the items here are row indices into arrays already in this process.

Guarantees: items come out in the order the iterable gives them, each once; an exception raised by the iterable or
by ``prepare`` is re-raised by the consumer's ``next`` at that item's place (with its traceback); :meth:`close`
(also on leaving the ``with`` block, or when the consumer stops early) stops the thread after the item in hand,
closes the iterable on the thread that iterated it, and waits for it. The iterable is only ever advanced by the
background thread (``depth`` >= 1) so its side effects (a cursor moving past a read batch) happen there, at most
``depth`` items before the consumer sees the item.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

_POLL_S = 0.05
"""How often a blocked producer looks at the stop flag (s): bounds how long :meth:`Prefetcher.close` waits for it."""


class Prefetcher(Generic[T, U]):
    """Iterate ``(item, prepare(item))`` over ``items``, prepared up to ``depth`` items ahead on a background thread.

    Args:
        items: the work, in order (drawn from the background thread; a generator is closed there).
        prepare: item -> what the consumer needs of it (called on the background thread).
        depth: items drawn and prepared ahead of the one the consumer holds (>= 1); 0 prepares each item on the
            consumer's thread when it is asked for (no thread: the same results, for comparison and debugging).

    Raises:
        ValueError: ``depth`` < 0.
    """

    def __init__(self, items: Iterable[T], prepare: Callable[[T], U], *, depth: int = 1) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self._items, self._prepare, self._depth = items, prepare, depth
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False

    def __enter__(self) -> Prefetcher[T, U]:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple[T, U]]:
        if self._depth == 0:
            for item in self._items:
                yield item, self._prepare(item)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
            self._thread.start()
        try:
            while not self._done:
                kind, value = self._queue.get()
                self._slots.release()  # the consumer holds this item now: the producer may draw the next one
                if kind == "item":
                    yield value
                elif kind == "error":
                    self._done = True
                    raise value
                else:
                    self._done = True
        finally:
            self.close()

    def _acquire(self) -> bool:
        """Wait for a free slot; False once :meth:`close` asked the producer to stop."""
        while not self._stop.is_set():
            if self._slots.acquire(timeout=_POLL_S):
                return True
        return False

    def _produce(self) -> None:
        iterator = iter(self._items)
        try:
            while self._acquire():
                try:
                    item = next(iterator)
                except StopIteration:
                    self._queue.put(("end", None))
                    return
                self._queue.put(("item", (item, self._prepare(item))))
        except BaseException as exc:  # re-raised by the consumer, at this item's place
            self._queue.put(("error", exc))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        """Stop the background thread (after the item it is preparing) and wait for it; idempotent."""
        self._done = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
