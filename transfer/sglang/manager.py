"""SGLang's KV manager for pdkv: one scheduler rank's exporters (prefill) or fetchers (decode).

Also what SGLang's decode asks of a prefill before it routes a request (`PrefillInfo`), and
the prefill's DP size that routing depends on.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs

from pdkv.errors import LayoutError, PdkvError
from transfer.engine_kv import EngineKV
from transfer.lanes.ucx.nixl import use_ucx_devices
from transfer.metadata import RankDescriptor
from transfer.metrics import set_scope
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
from transfer.sync import Handle, SyncExporter, SyncFetcher

__all__ = ["PdkvKVManager", "PrefillInfo"]

logger = logging.getLogger(__name__)


def _mode(disaggregation_mode: Any) -> str:
    """ "prefill" or "decode" from SGLang's `DisaggregationMode` (or its value)."""
    return str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()


class PdkvKVManager(BaseKVManager):
    """One scheduler rank's pdkv side: exporters on a prefill, fetchers on a decode.

    `parts` are what a room consists of here, by engine-id suffix: "" (the target model's
    layers) and, where SGLang gave this rank a draft model's buffers, `DRAFT_SUFFIX`."""

    __module__ = "transfer.sglang.conn"  # named by its import path, as before the split (reprs, logs, checks)

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
