"""Every timeout of the transfer layer, in one object with finite defaults.

No other module holds a timeout literal, nor reads a field off the class: every bound comes
from the `Timeouts` instance its caller passed down (a constructor's `timeouts`). A field
bounds one kind of wait; a request's end-to-end budget is a `transfer.deadline.Deadline`,
and each network await takes `deadline.left(cap)` with the field for that wait as the cap.
What stays elsewhere paces without ending a wait: poll intervals and backoff steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["CALLER_YIELD_SECONDS", "TCP_PROGRESS_INTERVAL", "Timeouts"]

# Not a bound but a yield: a synchronous caller (a scheduler polling from its own thread) sees
# an outcome only once it holds the interpreter lock, which pdkv's work after a read (its
# continuation, its releases' sends) would take first; that work waits this long.
CALLER_YIELD_SECONDS = 0.001

# Not a bound but a pace: an owner served over UCX's TCP drives its worker this often while a
# room of its is read (on the worker's own thread, so a tick wakes no event loop).
TCP_PROGRESS_INTERVAL = 0.0005


@dataclass(frozen=True)
class Timeouts:
    """Seconds. Each field bounds one kind of wait; all are finite."""

    connect: float = 5.0  # TCP connect to a registry or control endpoint
    request: float = 10.0  # one control request/response round trip
    lookup: float = 30.0  # waiting for an engine to be complete in the registry
    poll: float = 2.0  # one long-poll for room readiness (server-side hold)
    heartbeat: float = 2.0  # a readiness stream's frame when nothing moved; 3 missed: it is dead
    publish: float = 120.0  # a room appearing on an owner (its prefill may still be queued)
    admission: float = 120.0  # a request waiting for pool capacity at the router
    prefill: float = 120.0  # a prefill worker answering once its room is written
    transfer: float = 60.0  # one batched UCX READ
    fetch: float = 300.0  # a whole fetch, when the caller gives no deadline
    lease: float = 10.0  # a registry entry lives this long without renewal
    pin: float = 120.0  # source pages stay pinned this long without release
    progress_interval: float = 0.01  # how often an exporter drives its UCX worker
    # ... while a room of its is being read (`RoomTable.being_read`). Over TCP a READ waits
    # for the owner's progress (UCX emulates a GET), so None means TCP_PROGRESS_INTERVAL where
    # UCX may serve the owner over TCP and `progress_interval` elsewhere: on one host and over
    # RDMA a READ needs no owner, and faster driving only costs a core.
    ticket_progress_interval: float | None = None
    header: float = 10.0  # a service: from connect to a complete request head
    idle: float = 30.0  # a service: from a reply to the next request head (above aiohttp clients' 15 s keep-alive)
    body: float = 30.0  # a service: receiving a request's body
    # One posted part of a READ (at most 32 MiB) making no end: its peer is taken as lost. TCP
    # keepalive does not probe a connection with data unacknowledged, so a part posted after a
    # cut link would otherwise wait for the READ's own deadline.
    read_stall: float = 10.0
    start: float = 30.0  # starting or closing a service or a synchronous face's thread
    # A release sent by notification whose owner's pin word still holds the room's nonce is
    # sent again this often for `release_resend_slow` seconds, then every `release_resend_slow`
    # seconds until the pin would have expired (`pin`): a lost one then costs ~0.1 s, not the pin.
    release_resend: float = 0.1
    release_resend_slow: float = 1.0
    shutdown: float = 2.0  # a service closing: handlers still running get this long (a long-poll must not hold it)
    # After a notification (a ticket's release) its sender's worker is driven this long, so that
    # it leaves: a connection still wiring up needs several rounds of both sides' progress.
    notify: float = 2.0
    drain: float = 0.1  # a transport closing: notifications just sent get at most this long to leave
    attempt: float = 1.0  # the least one member of a replicated registry gets to answer before the next is asked
    retry_pause: float = 0.25  # the longest pause between attempts while a registry is away (its return seen)

    @property
    def renew_interval(self) -> float:
        return self.lease / 3

    def reading_progress_interval(self, over_tcp: bool) -> float:
        """How often an owner drives UCX while a room of its is read (`ticket_progress_interval`
        resolved: `over_tcp`, UCX may serve the owner's READs over TCP)."""
        if self.ticket_progress_interval is not None:
            return self.ticket_progress_interval
        return min(TCP_PROGRESS_INTERVAL, self.progress_interval) if over_tcp else self.progress_interval

    def replace(self, **changes: Any) -> Timeouts:
        return dataclasses.replace(self, **changes)
