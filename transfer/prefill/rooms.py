"""Rooms on a prefill rank: pinned source pages, layer readiness, claims, expiry.

A room is published for `consumers` claims. A consumer (one fetch, or one explicit lease)
first claims the room with a fresh random token; a claim is granted at most `consumers`
times, so a duplicate or late fetch of a single-consumer room is refused
(`RoomClaimedError`). The pages stay pinned until every granted-or-owed claim was
released, the room was aborted, or its pin deadline passed; whichever comes first frees
them through `on_free`, once.

A claim is the proof of a read: releasing it succeeds only while the room is still live
and the claim is one of its open claims, so a successful release proves that the pages
were pinned for this room from the claim to the release, i.e. during every READ made
under the claim. A release after the room was freed (aborted, expired, forgotten) or
with an unknown claim raises `ClaimLostError`: the reader must discard what it read.
Finished rooms are remembered (bounded) so a late fetch gets a clear answer.

Each publication of a room gets its own id (`publish` returns it). A caller that names it
acts on that publication only: a chunk, a readiness mark or an abort of a publication that
was refused (the room id was live or used already) or has ended never touches another
publication of the same room id, and a publication's `on_end` hears how it ended. An abort
may name its reason (the prefill's error): the room's decodes then fail naming it.

A room can also be read with a ticket (`transfer.metadata.RoomTicket`): with a pin table,
each live room holds a slot whose word is a random nonce while its pages are pinned; the
word is cleared before the pages are freed. A decode that READs the nonce after its data
READs has the same proof a release gives, without a request. Its release arrives as a UCX
notification (`release_ticket`) and counts as one of the room's consumers.

A rank other than its engine's arbiter holds one claim of each whole room it could grant
(`hold`, where its publication allows) for the arbiter to hand out (`transfer.prefill.held`):
a claimant the arbiter grants first then needs no relay. A claim reaches this rank only once
the arbiter granted it, and the arbiter hands held claims out only as a room's first claim,
so a claim this rank could not grant otherwise takes the held claim over, unless a reader has
used it. A give-up never does (it may come from anyone, for a claim this rank never saw), nor
a ticket (a room whose ticket will be issued is published not to hold): the arbiter gives back
a held claim it will not hand out (`drop_held`).

A decode that holds the room's first pages already (its prefix) reads only the pages past
them, and says so (`read_from`: its claim reads from page N). Once every reader still to
read has said where it starts, the pages below the lowest start are freed at once
(`on_free`, ahead of the release: the room's pin narrows); the room's end frees the rest.
A reader that has not said (no prefix, a lost notice, a ticket, a claim not granted yet)
keeps the pin whole; a claim released or given up reads nothing more. `on_free` may thus
run twice for a room, each page freed once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from pdkv.errors import (
    ClaimLostError,
    ConflictError,
    InvalidPagesError,
    PdkvError,
    RoomAbortedError,
    RoomClaimedError,
    UnknownRoomError,
)
from pdkv.pages import has_repeats, page_ids
from transfer.deadline import Deadline, wait_until
from transfer.logctx import failure_fields
from transfer.metadata import MAX_AUX_BYTES, ErrorReply, ReleaseReply, RoomState, RoomStatus, error_from, error_reply
from transfer.prefill.room import OnEnd as OnEnd  # where callers import it
from transfer.prefill.room import Room, RoomCounters

logger = logging.getLogger(__name__)

_REMEMBER_FINISHED = 1 << 16
HELD = ""  # the consumer of a claim held for the arbiter: whoever it hands it to, unknown here


class RoomTable:
    """The rooms one prefill rank serves. Methods run on the event loop's thread, but for
    `unpin_word` and `proves`, which any thread may call."""

    def __init__(
        self,
        layers: range,
        num_pages: int,
        pin_seconds: float,
        on_free: Callable[[int, np.ndarray], None] = lambda room, pages: None,
        pins: np.ndarray | None = None,
        on_change: Callable[[RoomState, set[str]], None] = lambda state, consumers: None,
        on_ended: Callable[[int], None] = lambda room: None,
        on_given_up: Callable[[int, str], None] = lambda room, token: None,
    ) -> None:
        """`pins`: the int64 pin table decodes READ (zeroed here); None: no tickets.
        `on_change(state, consumers)`: a room moved; `consumers` hold claims on it.
        `on_ended(room)`: a room ended, however. `on_given_up(room, token)`: claim `token`
        ended unread (given up, or its consumer gone)."""
        self.layers = layers
        self.num_pages = num_pages
        self.pin_seconds = pin_seconds
        self._on_free = on_free
        self._live: dict[int, Room] = {}
        self._finished: OrderedDict[int, RoomStatus] = OrderedDict()
        self._why: dict[int, ErrorReply] = {}  # finished rooms their prefill failed: the error
        self._pubs = itertools.count(1)
        self._tick = asyncio.Event()  # set and replaced on every change
        self.counters = RoomCounters()
        self._on_change = on_change
        self._on_ended = on_ended
        self._on_given_up = on_given_up
        self._pins = pins
        if pins is not None:
            pins[:] = 0
        self._free_slots = list(range(len(pins) - 1, -1, -1)) if pins is not None else []
        # Rooms a model thread revoked (`unpin_word`): the loop ends each as it next meets it.
        self._revoked: set[int] = set()

    # ---- the model side -------------------------------------------------------------------
    def publish(
        self, room: int, src_pages: np.ndarray, consumers: int = 1, on_end: OnEnd | None = None, hold: bool = False
    ) -> int:
        """Pin `src_pages` for `room`; returns this publication's id. `on_end(status,
        reason)` runs once as it ends. A room id live or used already is refused. `hold`:
        its engine holds claims for its arbiter: once whole, one of its claims may be held
        (`hold`), and it gets no ticket (`pin`), so that every rank refuses it alike."""
        self._end_revoked(room)
        if room in self._revoked:  # revoked before its publication came: it ends aborted unborn
            self._revoked.discard(room)
            self._remember(room, RoomStatus.ABORTED)
        if room in self._live or room in self._finished:
            ended = self._finished.get(room)
            why = "ended aborted (its decode or router gave it up)" if ended is RoomStatus.ABORTED else "published"
            raise ConflictError(f"room {room} was already {why} on this rank")
        pages = page_ids(src_pages, self.num_pages, f"room {room} source pages")
        pinned_until = Deadline.after(self.pin_seconds)
        r = Room(room, pages, consumers, pinned_until, self.layers.start, pub=next(self._pubs), on_end=on_end)
        r.holdable = hold
        self._live[room] = r
        if self._pins is not None and self._free_slots:  # else: no ticket for this room, claims still work
            r.slot, r.nonce = self._free_slots.pop(), secrets.randbits(63) or 1
            self._pins[r.slot] = r.nonce
        self.counters.published += 1
        self._notify()
        return r.pub

    def publish_chunked(self, room: int, total_pages: int, consumers: int = 1, on_end: OnEnd | None = None) -> int:
        """`room` will arrive in chunks of pages (`add_chunk`), `total_pages` in all; each
        chunk is ready in every owned layer when added (a chunked prefill's send)."""
        if not 0 < total_pages <= self.num_pages:
            raise InvalidPagesError(f"room {room}: {total_pages} pages (the pool has {self.num_pages})")
        pub = self.publish(room, np.zeros(0, dtype=np.int64), consumers, on_end)
        self._live[room].total_pages = total_pages
        return pub

    def _live_of(self, room: int, pub: int | None) -> Room | None:
        """The live publication `pub` of `room` (any, where None); None if it has ended.
        Raises `ConflictError` if another publication of the room id is live."""
        r = self._live.get(room)
        if r is not None and pub is not None and r.pub != pub:
            raise ConflictError(f"room {room}: this call names publication {pub}, refused or ended; another is live")
        return r

    def add_chunk(self, room: int, pages: np.ndarray, aux: bytes | None = None, pub: int | None = None) -> None:
        """The next chunk of a chunked `room` (of its publication `pub`, where given): `pages`,
        written in every owned layer; `aux`: the request's auxiliary bytes, with the last
        chunk. A refused chunk leaves the room as it was (the caller may abort it, naming why)."""
        r = self._live_of(room, pub)
        if r is None:
            return  # aborted or expired meanwhile: nothing waits for it
        r.src_pages, r.aux = self._joined(r, pages, aux), aux
        if len(r.src_pages) == r.total_pages:
            r.ready_upto = self.layers.stop
            r.pinned_until = Deadline.after(self.pin_seconds)
        self._narrow(r)  # a chunk below every reader's start is freed as it comes
        self._notify()
        if r.open_claims:
            self._on_change(self.state(room), set(r.open_claims.values()))

    def _joined(self, r: Room, pages: np.ndarray, aux: bytes | None) -> np.ndarray:
        """`r`'s pages with the chunk `pages` added, once checked."""
        if r.total_pages < 0:
            raise ConflictError(f"room {r.room} was not published by chunks")
        chunk = page_ids(pages, self.num_pages, f"room {r.room} chunk pages")
        joined = np.concatenate([r.src_pages, chunk])
        if len(joined) > r.total_pages or has_repeats(joined):
            raise InvalidPagesError(f"room {r.room}: a chunk beyond its {r.total_pages} pages, or a page twice")
        if aux is not None and (len(joined) != r.total_pages or len(aux) > MAX_AUX_BYTES):
            raise InvalidPagesError(f"room {r.room}: auxiliary bytes come with the last chunk, {MAX_AUX_BYTES} at most")
        return joined

    def mark_ready(self, room: int, upto: int, pub: int | None = None) -> None:
        """Layers [layers.start, upto) of `room` (of its publication `pub`, where given) are
        written; `upto` never moves back."""
        r = self._live_of(room, pub)
        if r is None:
            return  # aborted or expired meanwhile: nothing waits for it
        before = r.ready_upto
        r.ready_upto = max(r.ready_upto, min(upto, self.layers.stop))
        if r.ready_upto == self.layers.stop:
            r.pinned_until = Deadline.after(self.pin_seconds)
        self._notify()
        if r.ready_upto > before and r.open_claims:
            self._on_change(self.state(room), set(r.open_claims.values()))

    def abort(self, room: int, pub: int | None = None, reason: PdkvError | None = None) -> bool:
        """Free `room` now (its request was cancelled, or `reason` failed it). With `pub`,
        only that publication. False if it was not live: a room never published is then
        remembered aborted (a router's abort may come first), unless `pub` names one."""
        r = self._live.get(room)
        if r is None or (pub is not None and r.pub != pub):
            if r is None and pub is None and room not in self._finished:
                self._remember(room, RoomStatus.ABORTED)
                self._on_ended(room)  # claims held for it elsewhere go back
            return False
        self._finish(room, RoomStatus.ABORTED, reason)
        self.counters.aborted += 1
        return True

    # ---- the decode side ------------------------------------------------------------------
    def state(self, room: int) -> RoomState:
        r = self._live.get(room)
        if r is None:
            return RoomState(room=room, status=self._finished.get(room, RoomStatus.UNKNOWN), reason=self._why.get(room))
        status = RoomStatus.READY if r.ready_upto == self.layers.stop else RoomStatus.PENDING
        chunks = len(r.src_pages) if r.total_pages >= 0 else None
        aux = r.aux if status is RoomStatus.READY else None
        return RoomState(
            room=room,
            status=status,
            src_pages=r.src_pages.tolist(),
            ready_upto=r.ready_upto,
            ready_pages=chunks,
            aux=aux,
        )

    async def wait(self, room: int, after: int, timeout: float, after_pages: int = -1) -> RoomState:
        """The room's state once it has layers ready beyond `after` (or, by chunks, pages
        beyond `after_pages`), or at `timeout`."""
        await wait_until(lambda: self.moved(room, after, after_pages), lambda: self._tick, timeout)
        return self.state(room)

    def moved(self, room: int, after: int, after_pages: int = -1) -> bool:
        """Whether `wait` returns at once: the room has ended, or has layers ready beyond
        `after` (by chunks, pages beyond `after_pages`)."""
        r = self._live.get(room)
        if r is None:
            return room in self._finished
        if r.total_pages >= 0 and len(r.src_pages) > after_pages:
            return True
        return r.ready_upto > after or r.ready_upto == self.layers.stop

    def claim(self, room: int, token: str, consumer: str, readers: int = 1) -> RoomState:
        """Grant `token` one of the room's claims (idempotent for a token already granted).
        `readers`: the claimant's group reads the room that many times (each reader claims
        once), so the room grants at least that many claims: the first claim of a group
        raises it before any of the group's releases can free the room.

        A room not published yet answers UNKNOWN and grants nothing: ask again.
        """
        self._end_revoked(room)
        r = self._live.get(room)
        if r is None:
            status = self._finished.get(room, RoomStatus.UNKNOWN)
            if status is RoomStatus.UNKNOWN:
                return RoomState(room=room, status=status)
            if status is RoomStatus.ABORTED:
                raise self._aborted(room)
            raise UnknownRoomError(f"room {room} is {status.value} on this rank")
        if token not in r.open_claims and r.freed_upto > 0:  # only more readers could claim it now
            raise RoomClaimedError(
                f"room {room}: its first {r.freed_upto} pages were freed (every reader reads past them); "
                f"{consumer} may not claim it any more"
            )
        r.consumers = max(r.consumers, readers)
        if token not in r.open_claims:
            if r.granted >= r.consumers and not self._take_held(r):
                raise RoomClaimedError(
                    f"room {room}: all {r.consumers} consumer claim(s) taken; {consumer} may not read it again"
                )
            r.open_claims[token] = consumer
        return self.state(room)

    def pages_of(self, room: int) -> np.ndarray:
        """The live `room`'s source pages (empty if it is not live)."""
        r = self._live.get(room)
        return np.zeros(0, dtype=np.int64) if r is None else r.src_pages

    def granted(self, room: int) -> int:
        """The claims (and ticket) the live `room` granted so far; -1 if it is not live."""
        r = self._live.get(room)
        return -1 if r is None else r.granted

    def hold(self, room: int) -> str | None:
        """Hold one of the whole `room`'s claims for the arbiter to hand out: its token, or
        None where none is free (claimed, a ticket out), the room is not whole, was sent by
        chunks, has no pin slot or freed pages ahead, or holds one already."""
        self._end_revoked(room)
        r = self._live.get(room)
        if r is None or not r.holdable or r.held or r.ticket or r.slot < 0 or r.total_pages >= 0 or r.freed_upto:
            return None
        if r.ready_upto != self.layers.stop or r.granted >= r.consumers:
            return None
        r.held = r.held_token = secrets.token_hex(16)
        r.open_claims[r.held] = HELD  # no stream's loss gives it up
        return r.held

    def drop_held(self, room: int, token: str, ended: bool) -> bool:
        """The arbiter gives back the claim held under `token`. `ended`: the claim it stood for
        ended unread there (the room, or the claimant it was handed to: its answer lost, or it
        gave up or vanished), so it ends unread here too, as a give-up of it would, used or
        not; else (refused as it came: the arbiter granted another claimant first, unused
        then) its place is free again for that claimant's claim. False, and nothing done,
        unless it is still an open claim held for the arbiter (unused, where not `ended`)."""
        self._end_revoked(room)
        r = self._live.get(room)
        if r is None or not r.held_token or r.held_token != token or token not in r.open_claims:
            return False
        if ended:
            self.give_up(room, token)
        elif r.held == token:
            self._take_held(r)
        else:
            return False
        return True

    def _take_held(self, r: Room) -> bool:
        """Drop `r`'s held claim to free its place for another claim (or a ticket); False if
        it has none, or a reader has used it (the arbiter handed it out)."""
        if not r.held:
            return False
        del r.open_claims[r.held]
        r.held = ""
        return True

    def _used(self, r: Room, token: str) -> None:
        """A reader used `token`: if it is the held claim, the arbiter handed it out, and no
        other claim may take it over any more."""
        if token == r.held:
            r.held = ""

    def _aborted(self, room: int) -> RoomAbortedError:
        why = self._why.get(room)
        cause = f"its prefill failed it: {why.code}: {why.message}" if why is not None else "or its pin expired"
        error = RoomAbortedError(f"room {room} was aborted on this rank ({cause})")
        if why is not None:
            error.__cause__ = error_from(why, f"room {room}")
        return error

    def pin_of(self, room: int) -> tuple[int, int] | None:
        """The live room's pin (slot, nonce), or None (no slot, or not live)."""
        r = self._live.get(room)
        return None if r is None or r.slot < 0 else (r.slot, r.nonce)

    def unpin_word(self, room: int, pub: int | None = None) -> bool:
        """Revoke `room` (only publication `pub`, where given) from any thread, for a model
        thread that hands its pages back before pdkv's loop could end it: its pin word is
        cleared now, so that no read proves by it, and the loop ends the room as aborted the
        next time it meets it (a claim, a release, a ticket, its publication), before any
        answer that could prove a read. True if the word held the room's nonce. Another room
        that took the slot meanwhile keeps its nonce, unless the loop hands it over between
        this compare and the store: that room's reads then fail their proof, never pass it."""
        r = self._live.get(room)
        if r is not None and pub is not None and r.pub != pub:
            return False  # another publication's room: ours was refused
        self._revoked.add(room)
        if r is None or r.slot < 0 or self._pins is None:
            return False
        slot, nonce = r.slot, r.nonce
        if int(self._pins[slot]) != nonce:
            return False
        self._pins[slot] = 0
        return True

    def _end_revoked(self, room: int) -> None:
        """End `room` as aborted where a model thread revoked it (`unpin_word`)."""
        if self._revoked and room in self._revoked and room in self._live:
            self.abort(room)

    def proves(self, room: int) -> bool:
        """Whether the live `room`'s pin word holds its nonce: a read of it can still be proved."""
        r = self._live.get(room)
        return r is not None and r.slot >= 0 and self._pins is not None and int(self._pins[r.slot]) == r.nonce

    def check_claim(self, room: int, token: str) -> None:
        """Raise `ClaimLostError` unless `token` is an open claim of the live `room`."""
        self._end_revoked(room)
        r = self._live.get(room)
        if r is not None and token in r.open_claims:
            self._used(r, token)
            return
        if r is not None:
            why = "it is not an open claim of the room"
        else:
            status = self._finished.get(room, RoomStatus.UNKNOWN)
            if status is RoomStatus.ABORTED:
                raise self._aborted(room)
            why = f"the room is {status.value} here"
        raise ClaimLostError(
            f"room {room}: claim {token[:8]} does not pin its pages ({why}); "
            "bytes read under it may belong to another room"
        )

    def release(self, room: int, token: str) -> ReleaseReply:
        """Close claim `token`; the room is freed once its last claim is released."""
        self.check_claim(room, token)
        r = self._live[room]
        del r.open_claims[token]
        r.starts.pop(token, None)
        r.released += 1
        freed = r.released >= r.consumers
        if freed:
            self._finish(room, RoomStatus.RELEASED)
            self.counters.released += 1
        else:
            self._narrow(r)  # that reader reads no more
        return ReleaseReply(room=room, freed=freed, unreleased=r.consumers - r.released)

    def give_up(self, room: int, token: str) -> ReleaseReply:
        """A consumer will not read `room`: its claim `token` (or, if it never reached this
        rank, one of the claims still free) ends unread. A room that no consumer read ends
        aborted, and its prefill hears so; a room not published yet is refused when it is."""
        r = self._live.get(room)
        if r is None:
            if room not in self._finished:
                self._remember(room, RoomStatus.ABORTED)
                self._on_ended(room)  # claims held for it elsewhere go back
            return ReleaseReply(room=room, freed=False, unreleased=0)
        if token in r.open_claims:
            self._used(r, token)
            del r.open_claims[token]
            r.starts.pop(token, None)
            self._on_given_up(room, token)
        elif r.granted >= r.consumers:  # never the held claim: the arbiter may have handed it out
            raise ClaimLostError(f"room {room}: every claim is held by another consumer; nothing to give up")
        r.released += 1
        r.given_up += 1
        freed = r.released >= r.consumers
        if freed:
            aborted = r.given_up == r.released
            self._finish(room, RoomStatus.ABORTED if aborted else RoomStatus.RELEASED)
            if aborted:
                self.counters.aborted += 1
            else:
                self.counters.released += 1
        else:
            self._narrow(r)
        return ReleaseReply(room=room, freed=freed, unreleased=r.consumers - r.released)

    async def pin(self, room: int, timeout: float) -> tuple[int, int] | None:
        """Issue `room`'s ticket once every layer is ready: its (slot, nonce). The ticket
        holds one of the room's claims. None if the room has no pin slot, died, every claim
        is taken (a decode that began before the prefill ended claimed it), or it was
        published to hold a claim for the arbiter (read by claims, then)."""

        def whole_or_gone() -> bool:  # not `wait`: a chunked room moves with each chunk, whole or not
            r = self._live.get(room)
            return r is None or r.ready_upto == self.layers.stop

        await wait_until(whole_or_gone, lambda: self._tick, timeout)
        self._end_revoked(room)
        r = self._live.get(room)
        if r is None or r.holdable or r.slot < 0 or r.ready_upto < self.layers.stop or r.ticket:
            return None
        if r.granted >= r.consumers:
            return None
        r.ticket = "issued"
        return r.slot, r.nonce

    def release_ticket(self, room: int, slot: int, nonce: int) -> bool:
        """A ticket holder's release (once a room); False if the ticket no longer pins it."""
        self._end_revoked(room)
        r = self._live.get(room)
        if r is None or r.slot != slot or r.nonce != nonce or r.ticket != "issued":
            # Mostly a copy its holder sent again before it saw the first take: it frees nothing.
            logger.debug("room %d: a ticket release that pins nothing (late, repeated or forged)", room)
            return False
        r.ticket = "released"
        r.released += 1
        if r.released >= r.consumers:
            self._finish(room, RoomStatus.RELEASED)
            self.counters.released += 1
        else:
            self._narrow(r)
        return True

    def read_from(self, room: int, token: str, start: int) -> int:
        """Claim `token`'s reader reads `room` from page `start` on (the pages below are its
        decode's prefix); returns the pages this freed ahead of the room's end. Once every
        reader still to read has said so, the pages below the lowest start are freed.
        A start below one said before is refused (`InvalidPagesError`): the pages may be gone.

        Raises `ClaimLostError` unless `token` is an open claim of the live room (a notice
        for a room that ended, or another publication's), `InvalidPagesError` for a start
        beyond the room's pages: either frees nothing."""
        self.check_claim(room, token)
        r = self._live[room]
        pages = r.total_pages if r.total_pages >= 0 else len(r.src_pages)
        if not 0 <= start <= pages:
            raise InvalidPagesError(f"room {room}: a reader starting at page {start} of its {pages}")
        if start < r.starts.get(token, 0):
            raise InvalidPagesError(f"room {room}: claim {token[:8]} said it reads from page {r.starts[token]}")
        r.starts[token] = start
        before = r.freed_upto
        self._narrow(r)
        return r.freed_upto - before

    # ---- housekeeping ---------------------------------------------------------------------
    def expire(self, now: float) -> list[int]:
        """Free the rooms whose pin deadline is not after `now` (a monotonic clock reading)."""
        gone = [room for room, r in self._live.items() if r.pinned_until.at <= now]
        for room in gone:
            why = "room %d: pin deadline passed before release; freeing its pages"
            logger.warning(why, room, extra=failure_fields(room=room))
            self._finish(room, RoomStatus.ABORTED)
            self.counters.expired += 1
        return gone

    def give_up_consumer(self, consumer: str) -> list[int]:
        """`consumer` is gone (its readiness stream broke): each claim it holds ends unread,
        as its own `give_up` would end it. The rooms it held."""
        held = [(room, t) for room, r in self._live.items() for t, c in r.open_claims.items() if c == consumer]
        for room, token in held:
            why = "room %d: its reader %s is out of reach (its stream broke): its claim ends"
            logger.warning(why, room, consumer, extra=failure_fields(room=room, peer=consumer))
            self.give_up(room, token)
        return [room for room, _ in held]

    def claimed_by(self, consumer: str) -> list[RoomState]:
        """The states of the live rooms `consumer` holds a claim on."""
        return [self.state(room) for room, r in self._live.items() if consumer in r.open_claims.values()]

    @property
    def pinned_pages(self) -> int:
        return sum(r.src_pages.size - r.freed_upto for r in self._live.values())

    @property
    def being_read(self) -> bool:
        """A READ may come at any moment: a live room has a ticket out, or a claim open and
        something written to read (a claim taken early waits out the prefill unread)."""
        return any(r.ticket == "issued" or (r.open_claims and self._written(r)) for r in self._live.values())

    def _written(self, r: Room) -> bool:
        """Some of `r` may be read: a layer, or (sent by chunks) a chunk."""
        return r.ready_upto > self.layers.start or (r.total_pages >= 0 and r.src_pages.size > 0)

    @property
    def tickets_out(self) -> int:
        """Tickets issued for live rooms and not yet released."""
        return sum(r.ticket == "issued" for r in self._live.values())

    @property
    def live_rooms(self) -> int:
        return len(self._live)

    def _finish(self, room: int, status: RoomStatus, reason: PdkvError | None = None) -> None:
        r = self._live.pop(room)
        self._revoked.discard(room)  # remembered as finished from here
        why = error_reply(reason) if reason is not None else None
        claimants = set(r.open_claims.values())
        if r.slot >= 0:
            assert self._pins is not None
            self._pins[r.slot] = 0  # before the pages are freed: a ticket READ after this fails
            self._free_slots.append(r.slot)
        self._remember(room, status, why)
        self._on_free(room, r.src_pages[r.freed_upto :])  # those below were freed ahead (`_narrow`)
        if r.on_end is not None:
            r.on_end(status, why)
        self._on_ended(room)
        self._notify()
        if claimants:
            self._on_change(RoomState(room=room, status=status, reason=why), claimants)

    def _narrow(self, r: Room) -> None:
        """Free `r`'s pages that no reader still to read will read: those below the lowest
        start of its open claims, once every claim still to read has said where it starts."""
        upto = r.unread_below()
        if upto <= r.freed_upto:
            return
        ahead = r.src_pages[r.freed_upto : upto]
        r.freed_upto = upto
        self.counters.freed_ahead += len(ahead)
        logger.debug("room %d: %d pages below every reader's start freed ahead of its end", r.room, len(ahead))
        self._on_free(r.room, ahead)

    def _remember(self, room: int, status: RoomStatus, why: ErrorReply | None = None) -> None:
        self._finished[room] = status
        self._finished.move_to_end(room)
        if why is not None:
            self._why[room] = why
        while len(self._finished) > _REMEMBER_FINISHED:
            self._why.pop(self._finished.popitem(last=False)[0], None)

    def _notify(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()
