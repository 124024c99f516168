"""The arbiter's relay: a decode's claim on every owner (`ClaimAll`), asked of the engine's
lowest CP rank, relayed from there to the engine's other ranks.

The arbiter grants its own claim first (that decides a race: every claimant asks it first),
then asks each other rank for the same claim (the same token) at once, on the channels its
own client keeps open to them (`ControlClient.call`), and answers the decode with every rank's answer: the decode
makes one round trip instead of two steps. The other ranks' control URLs come from the
registry (the decode names only ranks and incarnations, so a request cannot make the
arbiter send anything anywhere else); the lookup is cached and asked again when a decode
names an incarnation the cache does not hold. A higher rank tells its arbiter here of the
claims it holds for it (`hold`, `transfer.prefill.held`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

import msgspec

from pdkv.errors import PdkvError, PeerLostError
from transfer.control import ControlClient
from transfer.deadline import Deadline
from transfer.metadata import (
    ClaimAll,
    ClaimAllReply,
    ClaimRequest,
    HeldClaim,
    HeldReply,
    OwnerClaim,
    OwnerRef,
    ReturnHeld,
    error_reply,
)
from transfer.metrics import observe_claim_relay
from transfer.registry import RegistryClient
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=msgspec.Struct)


class Peers:
    """The other ranks of this rank's engine, as the arbiter relays claims to them."""

    def __init__(
        self,
        registry: RegistryClient,
        engine_id: str,
        cp_rank: int,
        fingerprint: str,
        timeouts: Timeouts,
        secret: str | None = None,
    ) -> None:
        self._registry, self._engine_id, self._cp_rank, self._fp = registry, engine_id, cp_rank, fingerprint
        self._client = ControlClient(timeouts, secret)
        self._known: dict[int, tuple[str, str]] = {}  # cp rank -> (incarnation, control URL)
        self._lookup: asyncio.Lock = asyncio.Lock()

    async def relay(self, ask: ClaimRequest, others: list[OwnerRef], deadline: Deadline) -> list[OwnerClaim]:
        """`ask` on each of `others` at once: each one's state, or the error that refused it,
        all within `deadline` (a rank not answering by then answers `DeadlineExceeded`)."""
        started = time.perf_counter()
        try:
            urls = await self._urls(others, deadline)
        except PdkvError as exc:  # the registry is away: every rank answers why (the decode asks them itself)
            answers = [OwnerClaim(cp_rank=o.cp_rank, error=error_reply(exc)) for o in others]
        else:
            answers = list(await asyncio.gather(*(self._one(ask, o, urls.get(o.cp_rank), deadline) for o in others)))
        ok = all(a.error is None for a in answers)
        observe_claim_relay(self._engine_id, time.perf_counter() - started, ok)
        return answers

    async def _one(self, ask: ClaimRequest, owner: OwnerRef, url: str | None, deadline: Deadline) -> OwnerClaim:
        try:
            if url is None:
                why = f"cp rank {owner.cp_rank} incarnation {owner.incarnation} is not registered"
                raise PeerLostError(f"{self._engine_id}: {why}", owner.incarnation)
            call = ClaimAll(ask=ask, others=[], budget_ms=max(1, deadline.to_wire()))
            answer = await self._call(url, call, ClaimAllReply, deadline)
            return OwnerClaim(cp_rank=owner.cp_rank, state=answer.arbiter)
        except PdkvError as exc:
            logger.debug("room %d: relaying a claim to cp rank %d: %s", ask.room, owner.cp_rank, exc)
            return OwnerClaim(cp_rank=owner.cp_rank, error=error_reply(exc))

    async def hold(self, held: HeldClaim, deadline: Deadline) -> HeldReply | None:
        """Tell the engine's arbiter (its lowest rank) of `held`: its answer, None where none
        came (the claim then stays held until a relayed claim or a ticket takes it over, or
        the room's pin expires)."""
        try:
            url = await self._arbiter_url(deadline)
            if url is None:
                return None
            reply = await self._call(url, held, HeldReply, deadline)
        except PdkvError as exc:
            logger.debug("room %d: telling the arbiter of a held claim: %s", held.state.room, exc)
            self._known.clear()  # looked up again next time: the arbiter may have moved
            return None
        return reply

    async def return_held(self, room: int, returned: list[HeldClaim], deadline: Deadline) -> None:
        """As the arbiter, whose `room` ended: give each held claim of `returned` back to its
        rank, which ends it unread where nothing took it over (else its pin expires there)."""
        refs = [OwnerRef(cp_rank=h.cp_rank, incarnation=h.incarnation) for h in returned]
        try:
            urls = await self._urls(refs, deadline)
        except PdkvError as exc:
            logger.debug("room %d: returning held claims: %s", room, exc)
            return

        async def one(held: HeldClaim) -> None:
            url = urls.get(held.cp_rank)
            if url is None:
                return  # that incarnation is gone, and its rooms with it
            try:
                await self._call(url, ReturnHeld(room=room, claim=held.claim), HeldReply, deadline)
            except PdkvError as exc:
                logger.debug("room %d: returning cp rank %d's held claim: %s", room, held.cp_rank, exc)

        await asyncio.gather(*(one(h) for h in returned))

    async def _call(self, url: str, body: msgspec.Struct, reply: type[R], deadline: Deadline) -> R:
        """One call on the claim channel of the rank at control URL `url`, within `deadline`."""
        fp = self._fp
        return await self._client.call(
            f"{url}/v1/claims", body, reply, fingerprint=fp, expect_fingerprint=fp, timeout=deadline.left()
        )

    async def _arbiter_url(self, deadline: Deadline) -> str | None:
        """The control URL of rank 0, the arbiter decodes ask (None: not registered)."""
        if 0 not in self._known:
            async with self._lookup:
                if 0 not in self._known:
                    await self._look_up(deadline)
        known = self._known.get(0)
        return None if known is None else known[1]

    async def _urls(self, others: list[OwnerRef], deadline: Deadline) -> dict[int, str]:
        """The control URL of each of `others` that is registered as that incarnation; the
        registry is asked again (once) where the cache does not hold one."""

        def found() -> dict[int, str]:
            held = ((o.cp_rank, self._known.get(o.cp_rank)) for o in others)
            names = {o.cp_rank: o.incarnation for o in others}
            return {r: k[1] for r, k in held if k is not None and k[0] == names[r]}

        urls = found()
        if len(urls) == len(others):
            return urls
        async with self._lookup:
            urls = found()  # another request may have looked it up meanwhile
            if len(urls) == len(others):
                return urls
            # Half the budget at most: with the registry away, the decode still has time to
            # claim the ranks itself.
            await self._look_up(deadline.within(deadline.remaining() / 2))
            return found()

    async def _look_up(self, deadline: Deadline) -> None:
        engine = await self._registry.lookup(self._engine_id, deadline)
        self._known = {r.cp_rank: (r.incarnation, r.control_url) for r in engine.ranks if r.cp_rank != self._cp_rank}

    async def aclose(self) -> None:
        await self._client.aclose()
