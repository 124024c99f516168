"""Fakes for the decode's protocols (claims, tickets, leases): no NIXL, no HTTP, no processes.

As vLLM's `FakeNixlWrapper` and httpx's `MockTransport` do, the protocols run against
stand-ins for what they drive: a `FakeLane` copying numpy "memory" (each read can be held
on a gate, made to fail, and finishes its in-flight copy when cancelled), a `FakeClient`
routing control requests to `FakeOwner`s, a `FakeFeed` (no pushed states: every wait
falls back to a poll; its `aborted` raises when the test says), and a `FakeSignals` for pin
words and notifications. Everything records into one `Timeline`, whose order is the clock:
tests assert what happened before what, never how long anything took.

The tests: tests/test_protocol_claims.py, test_protocol_tickets.py, test_protocol_lease.py.
"""
