"""The decode's side of claims relayed by the arbiter (`ClaimProtocol.claim_all`), over the
fakes of tests/fakes/: which ranks it claims itself, and what it gives up after a refusal."""

from __future__ import annotations

from typing import Any

import pytest

from pdkv.errors import PeerLostError, RoomAbortedError
from tests.fakes.control import Request
from tests.fakes.memory import ROOM, SPANS
from tests.fakes.world import world
from transfer.decode.claims import Claim
from transfer.metadata import RoomStatus


async def test_the_arbiter_relays_and_the_decode_claims_only_what_it_could_not() -> None:
    """Rank 1's room is not published at the relay (UNKNOWN) and rank 2 is not reached from
    the arbiter: the decode claims those two itself, once each; rank 0 is asked once."""
    w = await world()
    w.fake[1].unknown = 1
    handle, tries = w.fake[2].handle, [0]

    async def unreached_once(op: str, body: Any, query: dict[str, list[str]]) -> Any:
        tries[0] += 1
        if op == "claim" and tries[0] == 1:
            raise PeerLostError("cp rank 2: connection refused", "cp2")
        return await handle(op, body, query)

    w.fake[2].handle = unreached_once  # type: ignore[method-assign]
    claim = Claim(ROOM)
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    assert w.client.requests[0] == Request("claim", 0)
    assert [len(w.client.of(cp, "claim")) for cp in SPANS] == [1, 2, 2]
    assert claim.granted == claim.asked == set(SPANS)
    assert all(claim.states[cp].status is RoomStatus.READY for cp in SPANS)
    assert claim.messages == 1 + 2 + 2  # the call, its two relays, two direct claims


async def test_a_rank_refusing_the_relayed_claim_fails_it_and_every_rank_is_given_up() -> None:
    w = await world()
    handle = w.fake[2].handle

    async def aborted(op: str, body: Any, query: dict[str, list[str]]) -> Any:
        if op == "claim":
            raise RoomAbortedError("room 42 was aborted on this rank")
        return await handle(op, body, query)

    w.fake[2].handle = aborted  # type: ignore[method-assign]
    claim = Claim(ROOM)
    protocol = w.claims()
    with pytest.raises(RoomAbortedError, match="aborted"):
        await protocol.claim_all(w.owners, claim, w.job().deadline)
    assert claim.asked == set(SPANS) and claim.granted == {0, 1}
    await protocol.give_up_all(w.owners, claim)
    assert [len(w.client.of(cp, "give_up")) for cp in SPANS] == [1, 1, 1]
