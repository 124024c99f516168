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
`bootstrap_room`; an engine is a prefill DP rank (`dp<N>`), its CP ranks the owners.
What is not supported is refused with a `PdkvError` through `failure_exception()`:
a decode prefix (`decode_prefix_len` > 0), host destinations, and auxiliary buffers in
device memory.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
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

from pdkv.errors import LayoutError, PdkvError, RoomAbortedError, TransferError
from transfer.bootstrap import RegistryServer
from transfer.engine_kv import EngineKV, buffer_infos
from transfer.metadata import RoomStatus
from transfer.sglang.topology import Topology, secret, sglang_timeouts, topology
from transfer.sync import BackgroundLoop, FetchStatus, Handle, SyncExporter, SyncFetcher

__all__ = ["PdkvKVManager", "PdkvKVSender", "PdkvKVReceiver", "PdkvKVBootstrapServer", "engine_kv_from_args"]

logger = logging.getLogger(__name__)


def engine_kv_from_args(args: KVArgs, layer_num: int, device: Any) -> EngineKV:
    """The latent KV and the DSA indexer state that `args` lists, as pdkv's pool face."""
    n = len(args.kv_data_ptrs)
    layers = list(args.kv_layer_ids[:n]) if getattr(args, "kv_layer_ids", None) else None
    if layers is None:
        layers = list(range(args.prefill_start_layer, args.prefill_start_layer + n))
    latent = buffer_infos(layers, args.kv_data_ptrs[:n], args.kv_data_lens[:n], args.kv_item_lens[:n])
    kinds = [StateType(t) for t in (getattr(args, "state_types", None) or [])]
    if StateType.DSA not in kinds:
        raise LayoutError("pdkv moves SGLang's DSA pools: these KVArgs carry no DSA indexer state")
    i = kinds.index(StateType.DSA)
    index = buffer_infos(
        args.state_layer_ids[i], args.state_data_ptrs[i], args.state_data_lens[i], args.state_item_lens[i]
    )
    return EngineKV(latent, index, page_size=int(args.page_size), layer_num=layer_num, device=device)


class AuxRows:
    """SGLang's per-request auxiliary buffers (first output token, logprobs, ...): one row
    per request slot in each buffer, in host memory. A room carries its rows as one blob."""

    def __init__(self, ptrs: list[int], lens: list[int], items: list[int]) -> None:
        self.buffers = list(zip(map(int, ptrs), map(int, lens), map(int, items)))
        self.row_bytes = sum(item for _, _, item in self.buffers)
        if self.buffers and torch.cuda.is_available():  # rows are copied with the CPU: no GPU pointers
            from transfer.cuda_ipc import CudaDriver

            driver = CudaDriver.get()
            if any(driver.is_device_memory(ptr) for ptr, _, _ in self.buffers):
                raise LayoutError("pdkv moves SGLang's aux rows from host memory; these aux buffers are on a GPU")

    def _at(self, index: int) -> list[tuple[int, int]]:
        spots = [(ptr + index * item, item) for ptr, n, item in self.buffers]
        if index < 0 or any(index * item + item > n for _, n, item in self.buffers):
            raise LayoutError(f"aux row {index} outside the auxiliary buffers")
        return spots

    def read(self, index: int) -> bytes:
        return b"".join(ctypes.string_at(addr, n) for addr, n in self._at(index))

    def write(self, index: int, blob: bytes) -> None:
        if len(blob) != self.row_bytes:
            raise LayoutError(f"an aux row of {len(blob)} bytes where this engine's rows take {self.row_bytes}")
        offset = 0
        for addr, n in self._at(index):
            ctypes.memmove(addr, blob[offset : offset + n], n)
            offset += n


def _mode(disaggregation_mode: Any) -> str:
    """ "prefill" or "decode" from SGLang's `DisaggregationMode` (or its value)."""
    return str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()


class PdkvKVManager(BaseKVManager):
    """One scheduler rank's pdkv side: an exporter on a prefill, fetchers on a decode."""

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.kv_args, self.server_args = args, server_args
        self.disaggregation_mode = disaggregation_mode
        self.is_prefill = _mode(disaggregation_mode) == "prefill"
        self.topology: Topology = topology(args, self.is_prefill, server_args)
        self.timeouts = sglang_timeouts()
        self.kv = engine_kv_from_args(args, self.topology.layer_num, self.topology.device)
        self.aux = AuxRows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
        self.engine_id = f"dp{int(getattr(args, 'system_dp_rank', 0) or 0)}"
        self.secret = secret()
        self._lock = threading.Lock()
        self._finished: dict[int, RoomStatus] = {}  # prefill: rooms done, until their sender looks
        self._fetchers: dict[str, concurrent.futures.Future[SyncFetcher]] = {}  # decode: by bootstrap addr
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdkv-sglang-start")
        self.exporter: SyncExporter | None = None
        if self.is_prefill:
            t = self.topology
            self.exporter = SyncExporter(
                self.kv,
                self.engine_id,
                t.cp_rank,
                t.cp_size,
                t.registry_url,
                on_free=self._room_finished,
                secret=self.secret,
                timeouts=self.timeouts,
            )

    def register_to_bootstrap(self) -> None:
        """Nothing to do: the exporter registered with the bootstrap server as it started,
        and keeps renewing."""

    # ---- prefill -----------------------------------------------------------------------------
    def _room_finished(self, room: int, pages: np.ndarray) -> None:
        assert self.exporter is not None  # runs on pdkv's thread, once the room is off the table
        status = self.exporter.exporter.rooms.state(room).status
        with self._lock:
            self._finished[room] = status

    def take_finished(self, room: int) -> RoomStatus | None:
        """How `room` ended (once), or None while it is live."""
        with self._lock:
            return self._finished.pop(room, None)

    # ---- decode ------------------------------------------------------------------------------
    def fetcher(self, bootstrap_addr: str) -> concurrent.futures.Future[SyncFetcher]:
        """The fetcher for the prefill behind `bootstrap_addr`, started off the scheduler."""
        with self._lock:
            started = self._fetchers.get(bootstrap_addr)
            if started is None:
                url = bootstrap_addr if "://" in bootstrap_addr else f"http://{bootstrap_addr}"
                started = self._starter.submit(SyncFetcher, self.kv, url, secret=self.secret, timeouts=self.timeouts)
                self._fetchers[bootstrap_addr] = started
            return started

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        for started in self._fetchers.values():
            if started.done() and started.exception() is None:
                started.result().close()
        self._starter.shutdown(wait=False)

    supports_role_switch = True

    def teardown(self) -> None:
        self.close()


class _Outcome:
    """A poll state with the failure behind it, and the time the transfer ran."""

    def __init__(self) -> None:
        self.state = KVPoll.Bootstrapping
        self.error: BaseException | None = None
        self.started: float | None = None
        self.ended: float | None = None

    def fail(self, error: BaseException) -> int:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.error, self.ended = KVPoll.Failed, error, time.monotonic()
            logger.info("pdkv transfer failed: %s", error)
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
    """A prefill request's room: published at `init`, a chunk a `send`, done once read."""

    def __init__(
        self, mgr: PdkvKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False
    ) -> None:
        self.kv_mgr, self.room = mgr, int(bootstrap_room)
        self._outcome = _Outcome()
        self._total = self._sent = 0
        self._aux_index: int | None = None
        self._last = False
        self._held: np.ndarray = np.zeros(0, dtype=np.int64)
        self._handles: list[Handle[None]] = []

    @property
    def _exporter(self) -> SyncExporter:
        assert self.kv_mgr.exporter is not None, "a sender needs a prefill manager"
        return self.kv_mgr.exporter

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._total, self._aux_index = int(num_kv_indices), aux_index
        self._handles.append(self._exporter.publish_chunked(self.room, self._total))
        self._outcome.state = KVPoll.WaitingForInput  # a pull needs no decode handshake

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        self._last = last_chunk  # the aux row is final only with the last chunk
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None, num_kv_tokens: int | None = None) -> None:
        try:
            self._send(np.asarray(kv_indices, dtype=np.int64).reshape(-1), state_indices)
        except PdkvError as exc:
            self._outcome.fail(exc)

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
        self._handles.append(self._exporter.add_chunk(self.room, chunk, aux=aux))
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
        for handle in self._handles:
            if handle.poll() is FetchStatus.FAILED:
                return self._outcome.fail(handle.exception() or TransferError("refused"))
        ended = self.kv_mgr.take_finished(self.room)
        if ended is RoomStatus.RELEASED:
            return self._outcome.succeed()
        if ended is not None:
            why = "aborted by its decode, or its pin expired," if ended is RoomStatus.ABORTED else ended.value
            return self._outcome.fail(RoomAbortedError(f"room {self.room} ended {why} before it was read"))
        return self._outcome.state

    def failure_exception(self) -> None:
        self._outcome.raise_failure(f"room {self.room}")

    def abort(self) -> None:
        """Free the room now; its decode hears of it on its readiness stream and stops reading."""
        self._exporter.abort_room(self.room)
        self._outcome.fail(RoomAbortedError(f"room {self.room} aborted by its prefill"))

    def get_transfer_metric(self) -> KVTransferMetric:
        layout = self.kv_mgr.kv.layout
        per_page = len(self.kv_mgr.kv.owned) * (layout.kv_page_bytes + layout.index_page_bytes)
        return KVTransferMetric(transfer_latency_s=self._outcome.latency(), transfer_total_bytes=self._sent * per_page)


class PdkvKVReceiver(BaseKVReceiver):
    """A decode request: reads its room from every CP owner into its own pages."""

    def __init__(self, mgr: PdkvKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self._outcome = _Outcome()
        self._fetcher: concurrent.futures.Future[SyncFetcher] | None = None
        self._engine = "dp0"
        self._fetch: Handle[Any] | None = None
        self._aux_index: int | None = None
        self._nbytes: int | None = None
        self._aborted: PdkvError | None = None

    def init(self, prefill_dp_rank: int) -> None:
        self._engine = f"dp{int(prefill_dp_rank or 0)}"
        self._fetcher = self.kv_mgr.fetcher(self.bootstrap_addr)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = "device",
        **_: Any,
    ) -> None:
        if self._aborted is not None:
            return
        try:
            if decode_prefix_len:
                raise TransferError("pdkv does not serve a decode prefix yet (decode_prefix_len > 0)")
            if str(getattr(destination, "value", destination)) != "device":
                raise TransferError("pdkv fills device (pool) pages only, not host destinations")
            if self._fetcher is None or not self._fetcher.done():
                raise TransferError("send_metadata before the receiver was bootstrapped (poll it first)")
            self._aux_index = aux_index
            self._outcome.started = time.monotonic()
            pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
            self._fetch = self._fetcher.result().fetch(self._engine, self.room, pages)
            self._outcome.state = KVPoll.Transferring
        except PdkvError as exc:
            self._outcome.fail(exc)

    def poll(self) -> int:
        state = self._outcome.state
        if state in (KVPoll.Success, KVPoll.Failed):
            return state
        if self._aborted is not None:
            if self._fetch is not None and self._fetch.poll() is FetchStatus.PENDING:
                return KVPoll.Transferring  # its READs and kernels are still ending
            return self._outcome.fail(self._aborted)
        if self._fetcher is None:
            return KVPoll.Bootstrapping
        if self._fetch is None:
            if not self._fetcher.done():
                return KVPoll.Bootstrapping
            if self._fetcher.exception() is not None:
                return self._outcome.fail(self._fetcher.exception())  # type: ignore[arg-type]
            self._outcome.state = KVPoll.WaitingForInput
            return self._outcome.state
        status = self._fetch.poll()
        if status is FetchStatus.PENDING:
            return KVPoll.Transferring
        if status is FetchStatus.FAILED:
            return self._outcome.fail(self._fetch.exception() or TransferError("fetch failed"))
        return self._finish()

    def _finish(self) -> int:
        assert self._fetch is not None
        result = self._fetch.result()
        self._nbytes = result.nbytes
        try:
            if self._aux_index is not None:
                if result.aux is None:
                    raise TransferError(f"room {self.room} came without its aux row")
                self.kv_mgr.aux.write(self._aux_index, result.aux)
        except PdkvError as exc:
            return self._outcome.fail(exc)
        return self._outcome.succeed()

    def failure_exception(self) -> None:
        self._outcome.raise_failure(f"room {self.room}")

    def abort(self) -> None:
        """Stop the fetch and free the room on its prefill. `poll()` says Failed only once
        every READ and kernel of the fetch has ended: SGLang reuses the pages at once then."""
        if self._aborted is not None or self._outcome.state in (KVPoll.Success, KVPoll.Failed):
            return
        self._aborted = RoomAbortedError(f"room {self.room} aborted by its decode")
        if self._fetch is not None:
            self._fetch.cancel()  # it gives up its claims on the owners it asked
            self._fetch.on_done(self._abandon_if_unread)
        elif self._fetcher is not None:
            self._fetcher.add_done_callback(lambda _: self._abandon())

    def _abandon_if_unread(self, fetch: Handle[Any]) -> None:
        if fetch.poll() is FetchStatus.FAILED:
            self._abandon()

    def _abandon(self) -> None:
        """Every owner frees the room now, also those the fetch never reached (on pdkv's
        thread, or the starter's: nothing here blocks)."""
        started = self._fetcher
        if started is None or not started.done() or started.exception() is not None:
            return
        try:
            started.result().abandon(self._engine, self.room)
        except PdkvError as exc:  # closed meanwhile: the room's pin expires instead
            logger.info("room %d: the prefill could not be told of the abort: %s", self.room, exc)

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self._outcome.latency(), transfer_total_bytes=self._nbytes)


class PdkvKVBootstrapServer(BaseKVBootstrapServer):
    """pdkv's registry at SGLang's bootstrap address, on a thread of its own."""

    def __init__(self, host: str, port: int) -> None:
        self._loop = BackgroundLoop("pdkv-sglang-bootstrap")
        self._server = RegistryServer(host=host, port=port, timeouts=sglang_timeouts(), secret=secret())
        self.url = self._loop.run(self._server.start(), 30)
        logger.info("pdkv bootstrap server (registry) at %s", self.url)

    def close(self) -> None:
        self._loop.run(self._server.aclose(), 30)
        self._loop.stop()
