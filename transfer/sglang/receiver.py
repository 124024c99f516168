"""SGLang's KV receiver for pdkv: a decode request's room, claimed ahead and read into its pages."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll, KVTransferMetric

from pdkv.errors import IncompatibleLayoutError, LayoutError, PdkvError, RoomAbortedError, TransferError
from transfer.decode import RoomLease
from transfer.results import FetchResult
from transfer.sglang.manager import PdkvKVManager, PrefillInfo
from transfer.sglang.outcome import Outcome
from transfer.sync import Handle, HandleStatus, SyncFetcher

__all__ = ["PdkvKVReceiver"]

logger = logging.getLogger(__name__)


def _ignoring_future(fn: Callable[[], object]) -> Callable[[object], object]:
    """`fn` as a future's done-callback, which is handed the future (unused here)."""
    return lambda _: fn()


class _Part:
    """One fetch of a receiver's room from one engine (`engine`: its id with the part's
    suffix): the target's layers, or the draft's. The room is claimed ahead, as soon as the
    fetcher is up (`claim_ahead`): by `send_metadata` the claims are usually held, and the
    read costs no claim round trip. Once `stopped`, it claims nothing more."""

    def __init__(self, suffix: str, engine: str, fetcher: concurrent.futures.Future[SyncFetcher]) -> None:
        self.suffix, self.engine, self.fetcher = suffix, engine, fetcher
        self.claim: Handle[RoomLease] | None = None
        self.fetch: Handle[FetchResult] | None = None
        self.watch: Handle[None] | None = None  # the claim held, unread: its room's abort (`SyncFetcher.watch`)
        self.stopped = False
        self._lock = threading.Lock()  # the fetcher's starter thread and the scheduler's race to claim

    @property
    def started(self) -> SyncFetcher | None:
        done = self.fetcher.done() and self.fetcher.exception() is None
        return self.fetcher.result() if done else None

    def claim_ahead(self, room: int, readers: int) -> Handle[RoomLease] | None:
        """Start the claim once (the fetcher must be up, the part not stopped); the claim, or None."""
        with self._lock:
            fetcher = self.started
            if self.claim is None and fetcher is not None and not self.stopped:
                self.claim = fetcher.claim(self.engine, room, readers=readers)
            return self.claim

    def stop(self) -> Handle[RoomLease] | None:
        """Claim nothing more; the claim made already, if any."""
        with self._lock:
            self.stopped = True
            return self.claim


class PdkvKVReceiver(BaseKVReceiver):
    """A decode request: reads its room from every CP owner into its own pages (and the
    draft's layers from the draft's engine, where this decode serves MTP).

    SGLang names the room's engine at `init`, which waits (`pending_reqs`) until its
    prefill is known: on a decode's first rooms to a prefill, a second or more, at SGLang's
    pace (`try_ensure_parallel_info`). Meanwhile the receiver starts the room by itself on
    the engine SGLang routes it to (dp<room % DP size>) as soon as pdkv knows the prefill,
    so that an abort from either side is heard then: the prefill's, by its claim; its own,
    by the give-up. It says Bootstrapping until `init` confirms the engine (a different one,
    named by the request, gives that start up and starts again there)."""

    __module__ = "transfer.sglang.conn"  # named by its import path, as before the split (reprs, logs, checks)

    def __init__(self, mgr: PdkvKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self._outcome = Outcome(lambda: {"room": self.room, "engine": self._engine})
        self._parts: list[_Part] = []
        self._engine = "dp0"
        self._inited = False  # SGLang named the engine (`init`), not only the room's routing
        self._aux_index: int | None = None
        self._nbytes: int | None = None
        self._aborted: BaseException | None = None  # the room is given up: Failed with this once its reads ended
        self._failed: BaseException | None = None  # the first part's failure (the others' is their cancel)

    def init(self, prefill_dp_rank: int) -> None:
        engine, self._inited = f"dp{int(prefill_dp_rank or 0)}", True
        if self._parts and engine == self._engine:
            return  # started by the room already, on this engine
        if self._parts and self._aborted is None:  # started on another: given up there, unread
            self._stop_parts()
        if self._aborted is not None and self._parts_given_up(engine):
            return  # aborted before: given up on this engine already (`_give_up_by_route`)
        self._start(engine)
        if self._aborted is not None:  # aborted before SGLang named this engine: given up there too
            self._stop_parts()

    def _start(self, engine: str) -> None:
        self._engine = engine
        mgr = self.kv_mgr
        self._parts = [_Part(part, engine + part, mgr.fetcher(self.bootstrap_addr, part)) for part in mgr.parts]
        for part in self._parts:
            part.fetcher.add_done_callback(_ignoring_future(functools.partial(self._claim_ahead, part)))

    def _routed_engine(self) -> str | None:
        """The engine SGLang routes the room to (dp<room % DP size>) once pdkv knows the
        prefill (`PdkvKVManager.prefill_info`, started if it was not), else None."""
        info = self.kv_mgr.prefill_info(self.bootstrap_addr)
        if not info.done() or info.exception() is not None:
            return None
        return f"dp{self.room % info.result().dp_size}"

    def _parts_given_up(self, engine: str) -> bool:
        """Whether an abort before `init` gave the room up on `engine` (`_give_up_by_route`)."""
        return self._routed_engine() == engine

    @property
    def _readers(self) -> int:
        return self.kv_mgr.topology.tp_size  # each decode TP rank reads the whole room

    def _claim_ahead(self, part: _Part) -> Handle[RoomLease] | None:
        if self._aborted is not None:
            return None
        try:
            return part.claim_ahead(self.room, self._readers)
        except PdkvError as exc:  # the fetcher closed meanwhile: send_metadata fails instead
            logger.info("room %d: no claim ahead: %s", self.room, exc)
            return None

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = "device",
        **_: Any,
    ) -> None:
        if self._aborted is not None or self._outcome.state in (KVPoll.Success, KVPoll.Failed):
            return  # ended: nothing more reaches any room or page
        if any(p.fetch is not None for p in self._parts):
            logger.warning("room %d: send_metadata again while its pages are read: ignored", self.room)
            return
        if not self._inited:
            self._end(TransferError("send_metadata before init (SGLang names the room's engine there)"))
            return
        try:
            skip = self._prefix_pages(int(decode_prefix_len or 0))
            if str(getattr(destination, "value", destination)) != "device":  # SGLang asks only if supported
                raise TransferError("pdkv fills device (pool) pages only, not host destinations")
            fetchers = [p.started for p in self._parts]
            if not fetchers or any(f is None for f in fetchers):
                raise TransferError("send_metadata before the receiver was bootstrapped (poll it first)")
            self._aux_index = aux_index
            self._outcome.started = time.monotonic()
            pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
            for part in self._parts:
                if part.watch is not None:
                    part.watch.cancel()  # the read hears an abort itself
            for part, fetcher in zip(self._parts, fetchers):
                assert fetcher is not None
                claim = self._claim_ahead(part)
                assert claim is not None  # the fetcher is up
                part.fetch = fetcher.read_claimed(claim, pages, skip=skip)
            self._outcome.state = KVPoll.Transferring
        except PdkvError as exc:
            self._end(exc)  # claims held ahead are given up: the prefill hears of it at once

    def _prefix_pages(self, tokens: int) -> int:
        """The room's pages the decode holds already (its radix cache's prefix): the prefill
        published the whole room (SGLang's sender asks for the prefix before the decode names
        it), and this decode reads only the pages past it into `kv_indices`; its read tells
        the owners so, and they free the prefix once every reader has (`RoomTable.read_from`)."""
        page = self.kv_mgr.kv.layout.page_size
        if tokens < 0 or tokens % page:
            raise LayoutError(f"room {self.room}: a decode prefix of {tokens} tokens is not whole {page}-token pages")
        return tokens // page

    def poll(self) -> int:
        state = self._outcome.state
        if state in (KVPoll.Success, KVPoll.Failed):
            return state
        fetches = [p.fetch for p in self._parts if p.fetch is not None]
        if self._aborted is not None:
            if any(f.poll() is HandleStatus.PENDING for f in fetches):
                return KVPoll.Transferring  # its READs and kernels are still ending
            return self._outcome.fail(self._aborted)
        if not self._parts and (engine := self._routed_engine()) is not None:
            self._start(engine)  # before SGLang's `init`: an abort from either side is heard from now on
        if not self._parts:
            return KVPoll.Bootstrapping
        if not fetches:
            return self._bootstrapped()
        failed = next((f for f in fetches if f.poll() is HandleStatus.FAILED), None)
        if failed is not None:  # one part failed: the others stop, and Failed waits for them
            self._failed = self._failed or failed.exception() or TransferError("fetch failed")
            for f in fetches:
                f.cancel()
            if any(f.poll() is HandleStatus.PENDING for f in fetches):
                return KVPoll.Transferring
            return self._outcome.fail(self._failed)
        if any(f.poll() is HandleStatus.PENDING for f in fetches):
            return KVPoll.Transferring
        return self._finish([f.result() for f in fetches])

    def _bootstrapped(self) -> int:
        """Before `send_metadata`: Bootstrapping until every part's fetcher has started and
        holds its claim on the room (which waits for the prefill to publish it). A part that
        cannot (its prefill's layout differs from ours, say: found at the lookup, before any
        claim) fails the room, and every part gives the room up, so its prefill hears of it."""
        waiting = False
        for part in self._parts:
            if not part.fetcher.done():
                waiting = True
                continue
            if (error := part.fetcher.exception()) is not None:
                return self._end(error)
            claim = part.claim or self._claim_ahead(part)
            status = HandleStatus.PENDING if claim is None else claim.poll()
            if claim is not None and status is HandleStatus.FAILED:  # nothing read: no wait
                return self._end(claim.exception() or TransferError("claim failed"))
            if claim is not None and status is HandleStatus.DONE and (aborted := self._watched(part, claim)):
                return self._end(aborted)  # the prefill aborted the room (or was lost) before it was read
            waiting = waiting or status is HandleStatus.PENDING
        if waiting or not self._inited:  # bootstrapped once the room is claimed: a read then asks nobody
            return KVPoll.Bootstrapping
        self._outcome.state = KVPoll.WaitingForInput
        return self._outcome.state

    def _watched(self, part: _Part, claim: Handle[RoomLease]) -> BaseException | None:
        """Watch a held claim's room until it is read (started once): its abort, or a lost owner."""
        fetcher = part.started
        if part.watch is None and fetcher is not None:
            try:
                part.watch = fetcher.watch(claim.result())
            except PdkvError as exc:  # the fetcher closed meanwhile
                return exc
        return None if part.watch is None else part.watch.exception()

    def _end(self, error: BaseException) -> int:
        """The room cannot be read: every part stops and gives it up, as `abort` does; Failed
        with `error` once their reads have ended."""
        if self._aborted is None and self._outcome.state not in (KVPoll.Success, KVPoll.Failed):
            self._aborted = error
            self._stop_parts()
        return self.poll()

    def _finish(self, results: list[FetchResult]) -> int:
        self._nbytes = sum(r.nbytes for r in results)
        try:
            if self._aux_index is not None:
                aux = results[0].aux  # the target's room carries it
                if aux is None:
                    raise TransferError(f"room {self.room} came without its aux row")
                self.kv_mgr.aux.write(self._aux_index, aux)
        except PdkvError as exc:
            return self._outcome.fail(exc)
        return self._outcome.succeed()

    def failure_exception(self) -> None:
        """Raise the failure. SGLang asks it also of a rank whose own read has not failed
        where another rank of its TP group has, and then frees the pages at once: this read
        stops, and the call returns only once its READs and kernels have ended (bounded by
        the fetcher's `transfer` timeout), so that no byte lands in pages SGLang reuses."""
        if self._outcome.state == KVPoll.Success:  # read and released already
            raise TransferError(f"room {self.room}: failed in its SGLang group (another rank's read failed)")
        if self._outcome.state != KVPoll.Failed:
            self.abort()
            end = time.monotonic() + self.kv_mgr.timeouts.transfer
            while self.poll() != KVPoll.Failed and time.monotonic() < end:
                time.sleep(0.0005)  # an error path: the scheduler waits for the reads to end
        self._outcome.raise_failure(f"room {self.room}")

    def abort(self) -> None:
        """Stop the fetches and free the room on its prefill. `poll()` says Failed only once
        every READ and kernel of them has ended: SGLang reuses the pages at once then. Before
        the room was started (its prefill not known yet), it is given up on the engine SGLang
        routes it to as soon as pdkv knows the prefill (`_give_up_by_route`)."""
        if self._aborted is not None or self._outcome.state in (KVPoll.Success, KVPoll.Failed):
            return
        self._aborted = RoomAbortedError(f"room {self.room} aborted by its decode")
        if not self._parts:
            self.kv_mgr.prefill_info(self.bootstrap_addr).add_done_callback(self._give_up_by_route)
        self._stop_parts()

    def _give_up_by_route(self, info: concurrent.futures.Future[PrefillInfo]) -> None:
        """The room aborted before it was started: every part's owners on the engine SGLang
        routes it to free it now, or refuse it when it is published (on pdkv's threads)."""
        if (error := info.exception()) is not None:
            logger.info("room %d: its prefill is not known, so not told of the abort: %s", self.room, error)
            return
        engine = f"dp{self.room % info.result().dp_size}"
        for suffix in self.kv_mgr.parts:
            part = _Part(suffix, engine + suffix, self.kv_mgr.fetcher(self.bootstrap_addr, suffix))
            part.stop()
            part.fetcher.add_done_callback(_ignoring_future(functools.partial(self._give_up_room, part)))

    def _stop_parts(self) -> None:
        for part in self._parts:
            claim = part.stop()
            if part.watch is not None:
                part.watch.cancel()
            if part.fetch is not None:
                part.fetch.cancel()  # it gives up its claims on the owners it asked
                part.fetch.on_done(functools.partial(self._give_up_if_unread, part))
            elif claim is not None:  # claimed ahead, nothing read: give the claim up
                claim.cancel()
                claim.on_done(functools.partial(self._give_up_claim, part))
            else:
                part.fetcher.add_done_callback(_ignoring_future(functools.partial(self._give_up_room, part)))

    def _give_up_claim(self, part: _Part, claim: Handle[RoomLease]) -> None:
        fetcher = part.started
        if fetcher is not None and claim.poll() is HandleStatus.DONE:
            fetcher.give_up(claim.result())
        if not isinstance(claim.exception(), IncompatibleLayoutError):  # that claim gave the room up itself
            self._give_up_room(part)  # owners the claim never reached free the room too

    def _give_up_if_unread(self, part: _Part, fetch: Handle[FetchResult]) -> None:
        if fetch.poll() is HandleStatus.FAILED:
            self._give_up_room(part)

    def _give_up_room(self, part: _Part) -> None:
        """Every owner frees the room now, also those the fetch never reached (on pdkv's
        thread, or the starter's: nothing here blocks)."""
        fetcher = part.started
        if fetcher is None:
            return
        try:
            fetcher.give_up_room(part.engine, self.room)
        except PdkvError as exc:  # closed meanwhile: the room's pin expires instead
            logger.info("room %d: the prefill could not be told of the abort: %s", self.room, exc)

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self._outcome.latency(), transfer_total_bytes=self._nbytes)
