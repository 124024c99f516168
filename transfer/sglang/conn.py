"""SGLang's transfer-backend classes for pdkv (sglang 0.5.23, `disaggregation/base/conn.py`).

SGLang's backends push: a prefill's sender WRITEs into the pages its decode named. pdkv
pulls, so the same interface runs the other way round, with no message from the decode
to the prefill:

    prefill, per request                          decode, per request
    sender.init(pages, aux_index)  publish_chunked  receiver.init(prefill_dp_rank)  look the engine up
    sender.send(page_indices)      add_chunk        receiver.send_metadata(pages)   fetch into them
    sender.poll(): Success once the decode has      receiver.poll(): Success once every
    read and released the room                      byte (and the aux row) is in

Every call returns at once: pdkv's asyncio side runs on threads of its own
(`transfer.sync`). The bootstrap server is pdkv's registry. A room is the request's
`bootstrap_room`; an engine is a prefill DP rank (`dp<N>`), its CP ranks the owners; a
draft model's (MTP) layers travel as the engine `dp<N>-draft` (`transfer.sglang.kvargs`).
What is not supported is refused with a `PdkvError` through `failure_exception()`:
host destinations, and auxiliary buffers in device memory (docs/sglang.md says why). A
decode's prefix (`decode_prefix_len`) is served by reading only the room's pages past it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
    StateType,
)

from pdkv.errors import (
    IncompatibleLayoutError,
    InvalidPagesError,
    LayoutError,
    PdkvError,
    RoomAbortedError,
    TransferError,
)
from transfer.decode import RoomLease
from transfer.engine_kv import EngineKV
from transfer.lanes.ucx.nixl import use_ucx_devices
from transfer.logctx import failure_fields
from transfer.metadata import RankDescriptor, RoomStatus
from transfer.metrics import set_scope
from transfer.registry.server import RegistryServer
from transfer.results import FetchResult
from transfer.sglang.kvargs import DRAFT_SUFFIX, AuxRows, draft_kv_from_args, engine_kv_from_args
from transfer.sglang.runtime import check_runtime
from transfer.sglang.topology import (
    Settings,
    Topology,
    prefill_registry,
    secret,
    settings,
    sglang_timeouts,
    topology,
    ucx_devices,
)
from transfer.sync import BackgroundLoop, Handle, HandleStatus, SyncExporter, SyncFetcher

__all__ = ["PdkvKVManager", "PdkvKVSender", "PdkvKVReceiver", "PdkvKVBootstrapServer", "engine_kv_from_args"]

logger = logging.getLogger(__name__)


def _mode(disaggregation_mode: Any) -> str:
    """ "prefill" or "decode" from SGLang's `DisaggregationMode` (or its value)."""
    return str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()


def _ignoring_future(fn: Callable[[], object]) -> Callable[[object], object]:
    """`fn` as a future's done-callback, which is handed the future (unused here)."""
    return lambda _: fn()


class PdkvKVManager(BaseKVManager):
    """One scheduler rank's pdkv side: exporters on a prefill, fetchers on a decode.

    `parts` are what a room consists of here, by engine-id suffix: "" (the target model's
    layers) and, where SGLang gave this rank a draft model's buffers, `DRAFT_SUFFIX`."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        check_runtime()  # this SGLang release and the CUDA builds, before anything starts
        self.kv_args, self.server_args = args, server_args
        self.disaggregation_mode = disaggregation_mode
        self.is_prefill = _mode(disaggregation_mode) == "prefill"
        self.topology: Topology = topology(args, self.is_prefill, server_args)
        self.settings: Settings = settings()
        if not self.is_prefill and self.settings.lane == "cuda_ipc" and self.topology.device.type != "cuda":
            raise LayoutError("PDKV_SGLANG_LANE=cuda_ipc needs the decode's KV on a GPU")
        self.timeouts = sglang_timeouts()
        use_ucx_devices(ucx_devices(args, server_args))  # --disaggregation-ib-device, for UCX
        self.kv = engine_kv_from_args(args, self.topology.layer_num, self.topology.device)
        self.parts: dict[str, EngineKV] = {"": self.kv}
        draft = draft_kv_from_args(args, self.topology.device)
        if draft is not None:
            self.parts[DRAFT_SUFFIX] = draft
        self.aux = AuxRows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        self.engine_id = f"dp{int(getattr(args, 'system_dp_rank', 0) or 0)}"
        model = getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", None) or ""
        # SGLang's own series' labels on pdkv's (multiprocess metrics): a dashboard joins them.
        set_scope(str(model), self.topology.tp_rank, int(getattr(args, "system_dp_rank", 0) or 0))
        self.secret = secret()
        self._lock = threading.Lock()
        self._fetchers: dict[tuple[str, str], concurrent.futures.Future[SyncFetcher]] = {}  # decode
        self.dp_size = _prefill_dp_size(server_args) if self.is_prefill else 1
        # decode: what SGLang's prealloc queue routes by (`try_ensure_parallel_info`), by bootstrap address
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._infos: dict[str, concurrent.futures.Future[PrefillInfo]] = {}  # by bootstrap address
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdkv-sglang-start")
        self.exporters: dict[str, SyncExporter] = {}  # none on a prefill's TP ranks but the first
        if self.is_prefill and self.topology.exports:
            for part, kv in self.parts.items():
                self.exporters[part] = self._export(part, kv)
        t = self.topology
        logger.info(  # the operator's check that pdkv, not the built-in backend, serves here
            "pdkv is SGLang's KV transfer backend here: %s, engine %s, owner %d of %d, TP rank %d of %d, layers %s%s",
            "prefill" if self.is_prefill else "decode",
            self.engine_id,
            t.cp_rank,
            t.cp_size,
            t.tp_rank,
            t.tp_size,
            self.kv.owned,
            f", advertised at {t.advertise}" if self.exporters else "",
        )
        ready, why = self.readiness()  # also for a probe of the operator's (docs/deployment.md)
        logger.log(logging.INFO if ready else logging.WARNING, "pdkv readiness: %s", why)

    def _export(self, part: str, kv: EngineKV) -> SyncExporter:
        """An exporter of one part: the target's CP rank, or the draft as an engine of one rank."""
        t = self.topology
        rank, size = (t.cp_rank, t.cp_size) if part == "" else (0, 1)
        timeouts, every = self.timeouts, self.settings.owner_progress
        if every is not None:  # SGLang's rooms are read by claims: the idle interval counts too
            timeouts = timeouts.replace(progress_interval=every, ticket_progress_interval=every)
        return SyncExporter(
            kv,
            self.engine_id + part,
            rank,
            size,
            t.registry_url,
            host=t.bind,
            advertise=t.advertise,
            secret=self.secret,
            timeouts=timeouts,
            group_size=self.dp_size,
        )

    @property
    def exporter(self) -> SyncExporter | None:
        """The target model's exporter (prefill only)."""
        return self.exporters.get("")

    def register_to_bootstrap(self) -> None:
        """Nothing to do: the exporters registered with the bootstrap server as they
        started, and keep renewing."""

    def readiness(self) -> tuple[bool, str]:
        """(ready, why) of pdkv in this process, callable from any thread: on a prefill, each
        exporter registered (lease renewed) with its UCX transport up (`PrefillExporter.
        readiness`, its `/ready`); on a decode, no fetcher that failed to start. SGLang asks a
        backend no readiness: a probe or a health hook may call this (docs/deployment.md)."""
        for part, exporter in self.exporters.items():
            ready, why = exporter.exporter.readiness()
            if not ready:
                return False, f"exporter {self.engine_id}{part}: {why}"
        with self._lock:
            started = list(self._fetchers.items())
        for (addr, part), future in started:
            if future.done() and future.exception() is not None:
                return False, f"fetcher of {addr}{part} failed to start: {future.exception()}"
        return True, "ready"

    # ---- decode ------------------------------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill behind `bootstrap_addr` is known (its DP size, which SGLang's
        decode routes a room by: engine dp<room % size>). Never blocks: the first call starts
        `prefill_info` and says False until it has answered (SGLang asks again each second,
        and gives its requests up after 15 tries); one that failed is started anew."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        info = self.prefill_info(bootstrap_addr)
        if not info.done():
            return False
        if (error := info.exception()) is not None:
            with self._lock:
                if self._infos.get(bootstrap_addr) is info:
                    del self._infos[bootstrap_addr]  # asked again at SGLang's next try
            logger.warning("pdkv: the prefill at %s is not known yet: %s", bootstrap_addr, error)
            return False
        self.prefill_info_table[bootstrap_addr] = info.result()
        return True

    def prefill_info(self, bootstrap_addr: str) -> concurrent.futures.Future[PrefillInfo]:
        """The prefill behind `bootstrap_addr` as SGLang routes to it, looked up once: its
        fetcher started, then its engine dp0 described, each step on pdkv's threads as soon as
        the one before has ended. Not at SGLang's next ask (a second later): a receiver made
        before the prefill was known starts its room from it (`PdkvKVReceiver.poll`), so an
        abort from either side reaches the other side then, not a second or more later."""
        with self._lock:
            info = self._infos.get(bootstrap_addr)
            if info is not None:
                return info
            info = self._infos[bootstrap_addr] = concurrent.futures.Future()
        self.fetcher(bootstrap_addr).add_done_callback(functools.partial(self._describe, info))
        return info

    @staticmethod
    def _describe(
        info: concurrent.futures.Future[PrefillInfo], started: concurrent.futures.Future[SyncFetcher]
    ) -> None:
        if (error := started.exception()) is not None:
            info.set_exception(error)
            return
        try:
            described = started.result().describe("dp0")
        except PdkvError as exc:  # the fetcher closed meanwhile
            info.set_exception(exc)
            return

        def answered(handle: Handle[dict[int, RankDescriptor]]) -> None:
            if (error := handle.exception()) is not None:
                info.set_exception(error)
                return
            ranks = handle.result()
            info.set_result(PrefillInfo(dp_size=ranks[min(ranks)].group_size))

        described.on_done(answered)

    def fetcher(self, bootstrap_addr: str, part: str = "") -> concurrent.futures.Future[SyncFetcher]:
        """The fetcher of `part` for the prefill behind `bootstrap_addr`, started off the scheduler."""
        with self._lock:
            started = self._fetchers.get((bootstrap_addr, part))
            if started is None:
                url = prefill_registry(self.topology.registry_url, bootstrap_addr)
                kv = self.parts[part]
                started = self._starter.submit(
                    SyncFetcher,
                    kv,
                    url,
                    secret=self.secret,
                    timeouts=self.timeouts,
                    ucx_workers=self.settings.ucx_workers,
                    lane=self.settings.lane,
                )
                self._fetchers[(bootstrap_addr, part)] = started
            return started

    def close(self) -> None:
        for exporter in self.exporters.values():
            exporter.close()
        for started in self._fetchers.values():
            if started.done() and started.exception() is None:
                started.result().close()
        self._starter.shutdown(wait=False)

    supports_role_switch = True

    def teardown(self) -> None:
        self.close()


@dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode asks of a prefill before it routes a request to one of its DP
    ranks (the fields of SGLang's `PrefillServerInfo` it reads)."""

    dp_size: int
    follow_bootstrap_room: bool = True  # a prefill of several DP ranks is refused otherwise


def _prefill_dp_size(server_args: Any) -> int:
    """The prefill's DP size (its engines dp0..dp<n-1>), from SGLang's settings; a room is on
    dp<room % n> only where SGLang routes by the room, so any other routing is refused."""
    size = int(os.environ.get("PDKV_SGLANG_DP_SIZE") or getattr(server_args, "dp_size", None) or 1)
    method = getattr(server_args, "load_balance_method", None)
    if size > 1 and method not in (None, "follow_bootstrap_room"):
        raise LayoutError(
            f"pdkv serves a prefill of {size} DP ranks routed by the room (--load-balance-method "
            f"follow_bootstrap_room), not {method!r}: its decodes find a room's engine from the room"
        )
    return size


class _Outcome:
    """A poll state with the failure behind it, and the time the transfer ran."""

    def __init__(self, about: Callable[[], dict[str, object]] = dict) -> None:
        """`about`: the request's room, engine and CP rank as known when it fails, for its log line."""
        self.state = KVPoll.Bootstrapping
        self.error: BaseException | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self._about = about

    def fail(self, error: BaseException) -> int:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.error, self.ended = KVPoll.Failed, error, time.monotonic()
            fields = failure_fields(error, **self._about())  # separate record fields, for structured logs
            logger.warning("pdkv transfer of room %s failed: %s", fields["room"], error, extra=fields)
        return self.state

    def succeed(self) -> int:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.ended = KVPoll.Success, time.monotonic()
        return self.state

    def raise_failure(self, what: str) -> None:
        raise self.error if self.error is not None else TransferError(f"{what}: no failure recorded")

    def latency(self) -> float | None:
        return None if self.started is None or self.ended is None else self.ended - self.started


class PdkvKVSender(BaseKVSender):
    """A prefill request's room: published at `init`, a chunk a `send`, done once read
    (in every part this rank exports: the draft's layers too, on the last CP rank).

    Every call acts on this sender's own publications only: a sender whose publish was
    refused (its room id live or used already) fails, and nothing it does afterwards
    reaches the room that holds the id. A sender that fails for any reason aborts its
    rooms, naming the error, so its decode fails now rather than at the pin's expiry."""

    def __init__(
        self, mgr: PdkvKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False
    ) -> None:
        assert mgr.is_prefill, "a sender needs a prefill manager"
        self.kv_mgr, self.room = mgr, int(bootstrap_room)
        self._outcome = _Outcome(lambda: {"room": self.room, "engine": mgr.engine_id, "cp_rank": mgr.topology.cp_rank})
        self._total = self._sent = 0
        self._aux_index: int | None = None
        self._last = False
        self._held: np.ndarray = np.zeros(0, dtype=np.int64)
        self._pubs: dict[str, Handle[int]] = {}  # part -> its publication
        self._handles: list[Handle[None]] = []
        self._ended: dict[str, RoomStatus] = {}  # part -> how its room ended (set on pdkv's thread)
        self._inited = False
        # SGLang's bootstrap queue calls `init` once the sender waits for input: a pull needs
        # no handshake with the decode, so it waits at once.
        self._outcome.state = KVPoll.WaitingForInput

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._total, self._aux_index, self._inited = int(num_kv_indices), aux_index, True
        pool_pages = self.kv_mgr.kv.layout.num_pages
        if not 0 < self._total <= pool_pages:  # refused here, not at the last send
            self._fail(InvalidPagesError(f"room {self.room}: {self._total} pages (the pool has {pool_pages})"))
            return
        for part, exporter in self.kv_mgr.exporters.items():
            on_end = functools.partial(self._on_end, part)
            self._pubs[part] = exporter.publish_chunked(self.room, self._total, on_end=on_end)

    def _on_end(self, part: str, status: RoomStatus, reason: object) -> None:
        self._ended[part] = status

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        self._last = last_chunk  # the aux row is final only with the last chunk
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None, num_kv_tokens: int | None = None) -> None:
        if self._outcome.state in (KVPoll.Success, KVPoll.Failed):
            return  # ended: nothing more reaches any room (poll says how it ended)
        try:
            self._send(np.asarray(kv_indices, dtype=np.int64).reshape(-1), state_indices)
        except PdkvError as exc:
            self._fail(exc)

    def _send(self, pages: np.ndarray, state_indices: list[Any] | None) -> None:
        if self._outcome.started is None:
            self._outcome.started = time.monotonic()
        pages = np.concatenate([self._held, pages])
        self._sent += len(pages) - len(self._held)
        if self._last:
            self._check_indexer_pages(state_indices)
            aux = self.kv_mgr.aux.read(self._aux_index) if self._aux_index is not None else None
            chunk, self._held = pages, pages[:0]
        else:  # the room must not complete before its aux row is final: hold its last page back
            complete = self._sent >= self._total
            chunk, self._held = (pages[:-1], pages[-1:]) if complete and len(pages) else (pages, pages[:0])
            aux = None
        for part, exporter in self.kv_mgr.exporters.items():  # the aux row travels with the target's room
            part_aux = aux if part == "" else None
            add = exporter.add_chunk(self.room, chunk, part_aux, self._pubs[part], abort_if_refused=True)
            self._handles.append(add)
        self._outcome.state = KVPoll.Transferring

    def _check_indexer_pages(self, state_indices: list[Any] | None) -> None:
        """SGLang names the DSA indexer's pages with the last chunk; pdkv's pools keep them
        in the KV's pages (read with each chunk), so they must be exactly those."""
        kinds = [StateType(t) for t in (getattr(self.kv_mgr.kv_args, "state_types", None) or [])]
        if not state_indices or StateType.DSA not in kinds:
            return
        named = state_indices[kinds.index(StateType.DSA)]
        if named is not None and len(np.asarray(named)) not in (0, self._total):
            raise LayoutError(f"room {self.room}: {len(np.asarray(named))} indexer pages for {self._total} KV pages")

    def poll(self) -> int:
        if self._outcome.state in (KVPoll.Success, KVPoll.Failed):
            return self._outcome.state
        handles: list[Handle[Any]] = [*self._pubs.values(), *self._handles]
        for handle in handles:
            if handle.poll() is HandleStatus.FAILED:
                return self._fail(handle.exception() or TransferError("refused"))
        for part, ended in list(self._ended.items()):
            if ended is not RoomStatus.RELEASED:
                why = "aborted by its decode, or its pin expired," if ended is RoomStatus.ABORTED else ended.value
                return self._outcome.fail(RoomAbortedError(f"room {self.room}{part} ended {why} before it was read"))
        if self._inited and len(self._ended) == len(self.kv_mgr.exporters):
            # Every part read; on a TP rank that exports nothing, at once (TP rank 0's
            # sender carries the room, and SGLang takes the lowest state of its TP group).
            return self._outcome.succeed()
        return self._outcome.state

    def _fail(self, error: BaseException) -> int:
        """Failed with `error`; this sender's rooms end now, their decodes told why."""
        reason = error if isinstance(error, PdkvError) else TransferError(str(error))
        self._abort_rooms(reason)
        return self._outcome.fail(error)

    def _abort_rooms(self, reason: PdkvError | None) -> None:
        for part, exporter in self.kv_mgr.exporters.items():
            publication = self._pubs.get(part)
            if publication is not None and part not in self._ended:
                exporter.abort_room(self.room, publication, reason)

    def failure_exception(self) -> None:
        """Raise the failure. SGLang asks it also of a rank whose own transfer has not failed
        where another rank of its group has (its poll states are all-reduced), and then
        frees the request's pages: this rank's rooms end now too, rather than stay readable."""
        elsewhere = TransferError(f"room {self.room}: failed in its SGLang group (another rank's transfer failed)")
        if self._outcome.state == KVPoll.Success:  # read already: nothing of it stays pinned
            raise elsewhere
        if self._outcome.state != KVPoll.Failed:
            self._fail(elsewhere)
        self._outcome.raise_failure(f"room {self.room}")

    def abort(self) -> None:
        """Free the room now; its decode hears of it on its readiness stream and stops reading."""
        self._abort_rooms(None)
        self._outcome.fail(RoomAbortedError(f"room {self.room} aborted by its prefill"))

    def get_transfer_metric(self) -> KVTransferMetric:
        per_page = sum(
            len(kv.owned) * (kv.layout.kv_page_bytes + kv.layout.index_page_bytes)
            for part, kv in self.kv_mgr.parts.items()
            if part in self.kv_mgr.exporters
        )
        return KVTransferMetric(transfer_latency_s=self._outcome.latency(), transfer_total_bytes=self._sent * per_page)


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

    def __init__(self, mgr: PdkvKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self._outcome = _Outcome(lambda: {"room": self.room, "engine": self._engine})
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


class PdkvKVBootstrapServer(BaseKVBootstrapServer):
    """pdkv's registry at SGLang's bootstrap address, on a thread of its own."""

    def __init__(self, host: str, port: int) -> None:
        self._loop = BackgroundLoop("pdkv-sglang-bootstrap")
        self._timeouts = sglang_timeouts()
        # Its prefill's ranks register once their model has loaded, and SGLang gives a decode its
        # bootstrap timeout to find them: an engine unknown until then is waited for, not a typo.
        grace = self._timeouts.lookup
        self._server = RegistryServer(host=host, port=port, timeouts=self._timeouts, secret=secret(), grace=grace)
        self.url = self._loop.run(self._server.start(), self._timeouts.start)
        logger.info("pdkv bootstrap server (registry) at %s", self.url)

    def close(self) -> None:
        self._loop.run(self._server.aclose(), self._timeouts.start)
        self._loop.stop(self._timeouts.start)
