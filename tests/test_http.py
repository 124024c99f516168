"""The control plane's HTTP layer in one process: typed paths, error identity, refusals."""

import asyncio

import pytest
from aiohttp import web

from pdkv import ConflictError, PdkvError, RoomClaimedError, UnknownRoomError
from pdkv.errors import MetadataError
from tests.http_probe import closed_by_server, send_big
from transfer.control import (
    ControlClient,
    HttpService,
    _error_from_reply,
    make_app,
    path_int,
    query_int,
    read_body,
    status_of,
)
from transfer.metadata import ErrorReply, RoomState, RoomStatus, encode
from transfer.timeouts import Timeouts


class _Private(RoomClaimedError):
    """An error class that only this test module knows."""


async def _serve(**limits):
    app = make_app(None)

    async def room(request: web.Request) -> web.Response:
        r = path_int(request, "room")
        return web.json_response({"room": r, "after": query_int(request, "after", -1, lo=-1)})

    async def fail(request: web.Request) -> web.Response:
        raise {"conflict": ConflictError, "private": _Private, "plain": PdkvError}[request.match_info["what"]]("no")

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=encode(await read_body(request, RoomState)))

    app.router.add_get("/v1/rooms/{room}", room)
    app.router.add_get("/fail/{what}", fail)
    app.router.add_post("/echo", echo)
    svc = HttpService(app, **limits)
    await svc.start()
    return svc


@pytest.mark.parametrize("bad", ["abc", "1e3", "..%2Fx", "-1", "99999999999999999999", "0x10", "1.0", " 1"])
async def test_bad_path_integers_answer_400(bad):
    svc = await _serve()
    client = ControlClient(Timeouts())
    try:
        with pytest.raises(MetadataError, match="room"):
            await client.request("GET", f"{svc.url}/v1/rooms/{bad}")
        with pytest.raises(MetadataError, match="after"):
            await client.request("GET", f"{svc.url}/v1/rooms/3?after=x")
        assert await client.get_json(f"{svc.url}/v1/rooms/7?after=2") == {"room": 7, "after": 2}
    finally:
        await client.aclose()
        await svc.aclose()


async def test_errors_keep_their_class_and_status_follows_the_tree():
    svc = await _serve()
    client = ControlClient(Timeouts())
    try:
        with pytest.raises(ConflictError) as info:
            await client.request("GET", f"{svc.url}/fail/conflict")
        assert type(info.value) is ConflictError
        with pytest.raises(_Private):
            await client.request("GET", f"{svc.url}/fail/private")
    finally:
        await client.aclose()
        await svc.aclose()
    assert status_of(_Private("x")) == 409 and status_of(ConflictError("x")) == 409
    assert status_of(type("Sub", (UnknownRoomError,), {})("x")) == 404
    assert status_of(PdkvError("x")) == 500


def test_an_unknown_error_class_comes_back_as_its_nearest_known_ancestor():
    body = encode(ErrorReply(code="NoSuchErrorHere", message="m", lineage=["NoSuchBase", "ConflictError", "PdkvError"]))
    err = _error_from_reply(409, body, "http://x")
    assert type(err) is ConflictError and "m" in str(err)


async def test_oversized_bodies_are_refused_unread():
    svc = await _serve()
    try:
        assert await send_big(svc.url, "/echo", 200 << 20) == 413  # by Content-Length
        assert await send_big(svc.url, "/echo", 16 << 20, chunked=True) == 413  # as the limit passes
        client = ControlClient(Timeouts())
        state = RoomState(room=1, status=RoomStatus.READY, src_pages=[1, 2])
        try:  # and the service still answers
            assert await client.request("POST", f"{svc.url}/echo", RoomState, state) == state
        finally:
            await client.aclose()
    finally:
        await svc.aclose()


def _connect(svc: HttpService):
    host, port = svc.url.removeprefix("http://").split(":")
    return asyncio.open_connection(host, int(port))


async def test_a_connection_that_stalls_before_its_request_head_is_closed():
    svc = await _serve(timeouts=Timeouts(header=0.3))
    try:
        reader, writer = await _connect(svc)
        writer.write(b"GET /v1/rooms/1 HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
        assert await closed_by_server(reader, 5.0)
        writer.close()
        idle_reader, idle_writer = await _connect(svc)  # sends nothing at all
        assert await closed_by_server(idle_reader, 5.0)
        idle_writer.close()
    finally:
        await svc.aclose()


async def test_beyond_the_limit_a_new_connection_evicts_the_oldest_idle_one():
    svc = await _serve(max_connections=3)
    try:
        conns = [await _connect(svc) for _ in range(5)]
        assert [await closed_by_server(r, 0.5) for r, _ in conns] == [True, True, False, False, False]
        reader, writer = conns[4]
        writer.write(b"GET /v1/rooms/5 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
        for _, w in conns:
            w.close()
    finally:
        await svc.aclose()


async def test_a_channel_answers_at_once_or_after_a_wait_and_a_refusal_by_the_peer_keeps_it_open():
    """`serve_channel`: an answer made at once and one awaited come back to their own calls
    (the one that waits holds up no other); a refusal, `DeadlineExceeded` too (a peer's own,
    not the caller's timeout), comes back typed and leaves the channel open."""
    from pdkv.errors import DeadlineExceeded
    from transfer.control import serve_channel
    from transfer.metadata import decode

    async def later(state: RoomState) -> bytes:
        await asyncio.sleep(0.2)
        return encode(state)

    def answer(data: bytes) -> bytes | object:
        state = decode(data, RoomState)
        if state.room == 1:
            raise DeadlineExceeded("the call's budget was spent on its way")
        return later(state) if state.room == 2 else encode(state)

    app = make_app(None)
    channels: set[web.WebSocketResponse] = set()

    async def channel(request: web.Request) -> web.StreamResponse:
        return await serve_channel(request, answer, channels)

    app.router.add_get("/v1/claims", channel)
    svc = HttpService(app)
    url = f"{await svc.start()}/v1/claims"
    client = ControlClient(Timeouts())
    try:
        asks = [RoomState(room=r, status=RoomStatus.READY) for r in (2, 3)]
        slow, quick = (asyncio.ensure_future(client.call(url, a, RoomState, fingerprint="", timeout=5)) for a in asks)
        assert (await quick).room == 3 and not slow.done()  # answered at once, past the one that waits
        assert (await slow).room == 2
        kept = client._channels[url]
        with pytest.raises(DeadlineExceeded, match="spent on its way"):
            await client.call(url, RoomState(room=1, status=RoomStatus.READY), RoomState, fingerprint="", timeout=5)
        assert client._channels[url] is kept and not kept.closed  # the peer answered: the channel is sound
    finally:
        await client.aclose()
        await svc.aclose()
