"""pdkv for synchronous schedulers: the asyncio side on a thread of its own.

A serving engine's scheduler runs a synchronous loop and must never block in it. These
classes own an event loop on a background thread and give that loop the work; every call
returns at once (it only hands a callable to the loop), and outcomes are read by polling
a handle or by a callback (which runs on pdkv's thread: keep it short).

    fetcher = SyncFetcher(pool, registry_url)
    handle = fetcher.fetch("prefill0", room, dst_pages, ticket=ticket)
    ...                                    # scheduler iterations
    if handle.poll() is FetchStatus.DONE:  # non-blocking
        result = handle.result()
    fetcher.close()

    exporter = SyncExporter(pool, "prefill0", cp_rank, cp_size, registry_url)
    exporter.publish_room(room, pages)
    exporter.mark_ready(room, upto_layer)  # records a CUDA event on the caller's stream
    ticket_pin = exporter.pin(room)        # a handle: poll() / result()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from pdkv.errors import ClosedError
from pdkv.pages import PageIds
from transfer.decode import DecodeFetcher
from transfer.engine_kv import KVBuffers
from transfer.metadata import OwnerPin, RoomTicket
from transfer.prefill import PrefillExporter
from transfer.results import FetchResult
from transfer.timeouts import Timeouts

__all__ = ["BackgroundLoop", "Handle", "FetchStatus", "SyncFetcher", "SyncExporter"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FetchStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class BackgroundLoop:
    """An asyncio loop running on a daemon thread until `stop()`."""

    def __init__(self, name: str = "pdkv-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; returns at once."""
        if self.loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise ClosedError("pdkv's loop has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop's thread soon; returns at once."""
        self.loop.call_soon_threadsafe(fn)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and wait for it (set-up and tear-down only)."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


class Handle(Generic[T]):
    """An operation running on pdkv's loop, read without blocking."""

    def __init__(self, future: concurrent.futures.Future[T]) -> None:
        self._future = future

    def poll(self) -> FetchStatus:
        if not self._future.done():
            return FetchStatus.PENDING
        return FetchStatus.FAILED if self._future.cancelled() or self._future.exception() else FetchStatus.DONE

    def result(self, timeout: float | None = 0) -> T:
        """The outcome; raises its `PdkvError`. With the default `timeout=0` it does not
        block: a pending operation raises `TimeoutError`."""
        return self._future.result(timeout)

    def exception(self) -> BaseException | None:
        """The failure of a finished operation (None if it succeeded or is pending)."""
        if not self._future.done():
            return None
        if self._future.cancelled():
            return ClosedError("cancelled")
        return self._future.exception()

    def cancel(self) -> None:
        """Ask the operation to stop; a fetch then raises and leaves nothing pinned."""
        self._future.cancel()

    def on_done(self, callback: Callable[[Handle[T]], None]) -> None:
        """Call `callback(self)` once finished (on pdkv's thread, or at once if it is)."""
        self._future.add_done_callback(lambda _: callback(self))


class SyncFetcher:
    """A `DecodeFetcher` driven from a synchronous scheduler thread."""

    def __init__(self, pool: KVBuffers, registry_url: str, start_timeout: float = 30.0, **kwargs: Any) -> None:
        self._bg = BackgroundLoop("pdkv-decode")
        self.fetcher: DecodeFetcher = self._bg.run(_started(DecodeFetcher, pool, registry_url, **kwargs), start_timeout)

    def fetch(
        self,
        engine_id: str,
        room: int,
        dst_pages: PageIds,
        *,
        ticket: RoomTicket | None = None,
        timeout: float | None = None,
    ) -> Handle[FetchResult]:
        """Start `DecodeFetcher.fetch` on pdkv's loop; returns a handle at once.

        `dst_pages` is copied here, so the caller may reuse its list or array.
        """
        pages = dst_pages.clone() if isinstance(dst_pages, torch.Tensor) else np.array(dst_pages, copy=True)
        coro = self.fetcher.fetch(engine_id, room, pages, ticket=ticket, timeout=timeout)
        return Handle(self._bg.submit(coro))

    def close(self, timeout: float = 30.0) -> None:
        """End fetches in flight (they raise `ClosedError`), close, stop the thread."""
        try:
            self._bg.run(self.fetcher.aclose(), timeout)
        finally:
            self._bg.stop()


class SyncExporter:
    """A `PrefillExporter` driven from a synchronous model thread."""

    def __init__(
        self,
        pool: KVBuffers,
        engine_id: str,
        cp_rank: int,
        cp_size: int,
        registry_url: str,
        start_timeout: float = 30.0,
        **kwargs: Any,
    ) -> None:
        self._bg = BackgroundLoop(f"pdkv-{engine_id}-cp{cp_rank}")
        self.timeouts: Timeouts = kwargs.get("timeouts", Timeouts())
        self.exporter: PrefillExporter = self._bg.run(
            _started(PrefillExporter, pool, engine_id, cp_rank, cp_size, registry_url, **kwargs), start_timeout
        )

    def publish_room(self, room: int, src_pages: np.ndarray, consumers: int = 1) -> Handle[None]:
        """Pin `src_pages` for `room`; a handle says whether it was accepted."""
        pages = np.array(src_pages, copy=True)
        return Handle(self._bg.submit(_call(self.exporter.publish_room, room, pages, consumers)))

    def mark_ready(self, room: int, upto_layer: int) -> None:
        """Owned layers below `upto_layer` of `room` are written (on a GPU: queued on the
        caller's current stream, where the event is recorded)."""
        written = self._written_here()
        self._bg.call(lambda: self.exporter.mark_ready(room, upto_layer, written))

    def publish_chunked(self, room: int, total_pages: int, consumers: int = 1) -> Handle[None]:
        """`room` will arrive in chunks (a chunked prefill), `total_pages` in all."""
        return Handle(self._bg.submit(_call(self.exporter.publish_chunked, room, total_pages, consumers)))

    def add_chunk(self, room: int, pages: np.ndarray, aux: bytes | None = None) -> Handle[None]:
        """The next chunk of `room`, written in every owned layer (on a GPU, as for
        `mark_ready`), with the request's `aux` bytes if it is the last. The handle says
        whether it was accepted (on a GPU: queued)."""
        chunk, written = np.array(pages, copy=True), self._written_here()
        return Handle(self._bg.submit(_call(self.exporter.add_chunk, room, chunk, written, aux)))

    def _written_here(self) -> torch.cuda.Event | None:
        """On a GPU, an event after what the caller's stream has queued; None on the host."""
        device = self.exporter.pool.device
        if device.type != "cuda":
            return None
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(device))
        return written

    def abort_room(self, room: int) -> None:
        self._bg.call(lambda: self.exporter.abort_room(room))

    def pin(self, room: int, timeout: float | None = None) -> Handle[OwnerPin | None]:
        """This rank's part of `room`'s ticket, once its layers are readable (a handle)."""
        wait = self.timeouts.request if timeout is None else timeout
        return Handle(self._bg.submit(self.exporter.pin(room, wait)))

    def close(self, timeout: float = 30.0) -> None:
        try:
            self._bg.run(self.exporter.aclose(), timeout)
        finally:
            self._bg.stop()


async def _started(cls: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`cls(*args, **kwargs)`, made and started on the loop's thread."""
    obj = cls(*args, **kwargs)
    await obj.start()
    return obj


async def _call(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the loop's thread; its error reaches the caller through the handle."""
    return fn(*args)
