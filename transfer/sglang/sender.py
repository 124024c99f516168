"""SGLang's KV sender for pdkv: a prefill request's room, published and added to chunk by chunk."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll, KVTransferMetric, StateType

from pdkv.deadline import Deadline
from pdkv.errors import ConflictError, InvalidPagesError, LayoutError, PdkvError, RoomAbortedError, TransferError
from transfer.metadata import RoomStatus
from transfer.sglang.manager import PdkvKVManager
from transfer.sglang.outcome import Outcome
from transfer.sync import Handle, HandleStatus

__all__ = ["PdkvKVSender"]

logger = logging.getLogger(__name__)


class PdkvKVSender(BaseKVSender):
    """A prefill request's room: published at `init`, a chunk a `send`, done once read
    (in every part this rank exports: the draft's layers too, on the last CP rank).

    Every call acts on this sender's own publications only: a sender whose publish was
    refused (its room id live or used already) fails, and nothing it does afterwards
    reaches the room that holds the id. A sender that fails for any reason aborts its
    rooms, naming the error, so its decode fails now rather than at the pin's expiry."""

    __module__ = "transfer.sglang.conn"  # named by its import path, as before the split (reprs, logs, checks)

    def __init__(
        self, mgr: PdkvKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False
    ) -> None:
        assert mgr.is_prefill, "a sender needs a prefill manager"
        self.kv_mgr, self.room = mgr, int(bootstrap_room)
        self._outcome = Outcome(lambda: {"room": self.room, "engine": mgr.engine_id, "cp_rank": mgr.topology.cp_rank})
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
                return self._fail(RoomAbortedError(f"room {self.room}{part} ended {why} before it was read"))
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
        """End this sender's rooms that are still live, and wait until they have: SGLang frees
        the request's pages once it sees Failed, and a room still pinned then would let a
        decode read (and prove) pages that another request is writing. Nothing raises here
        (SGLang's scheduler must hear Failed); an abort not confirmed within
        `Timeouts.request` is logged as an error, and the room is revoked on this thread
        (`_unpin`): no read of its pages can be proved from then on."""
        limit = Deadline.after(self.kv_mgr.timeouts.request)
        aborts: dict[str, Handle[None]] = {}
        for part, exporter in self.kv_mgr.exporters.items():
            publication = self._pubs.get(part)
            if publication is None or part in self._ended:
                continue
            try:
                aborts[part] = exporter.abort_room(self.room, publication, reason)
            except PdkvError as exc:  # pdkv's loop has stopped: nothing runs there any more
                logger.error("room %d%s: its abort could not be asked: %s", self.room, part, exc)
                self._unpin(part)
        for part, aborted in aborts.items():
            try:
                aborted.result(timeout=max(0.0, limit.remaining()))
            except ConflictError:
                pass  # its publication was refused: no room of this sender's to end
            except Exception as exc:  # not ended in time, or pdkv closing
                logger.error("room %d%s: its abort was not confirmed: %r", self.room, part, exc)
                self._unpin(part)

    def _unpin(self, part: str) -> None:
        """The room's part still live, its pages about to go back to SGLang: revoke it here
        (`RoomTable.unpin_word`): its pin word is cleared, so that no decode proves a read by
        it, and pdkv's loop ends it aborted before it answers any claim, release or ticket."""
        try:
            if self.kv_mgr.exporters[part].unpin_word(self.room, self._pubs.get(part)):
                logger.error("room %d%s: its pin word cleared on the scheduler's thread", self.room, part)
        except Exception:  # nothing raises into SGLang's scheduler
            logger.exception("room %d%s: its pin word could not be cleared", self.room, part)

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
