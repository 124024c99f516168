"""A demo decode worker: allocates pages, fetches a room's KV, verifies every byte, frees.

POST /v1/decode               DecodeRequest -> DecodeReply
POST /v1/rooms/{room}/abort   cancel that room's fetch (releases it on every owner)
GET  /v1/stats                pages in use, fetches, failures (JSON)
GET  /health                  liveness
GET  /ready                   200 once its UCX transport is up (503 before): what a supervisor waits on

python -m transfer.app.decode_worker --registry http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import OrderedDict

import torch
from aiohttp import web

from pdkv import PRESETS, DSAKVPool
from pdkv.errors import ConflictError, PdkvError, TransferError, UnknownRoomError
from transfer.app.api import DecodeReply, DecodeRequest
from transfer.app.options import HelpFormatter
from transfer.app.service import (
    add_pool_flags,
    add_service_flags,
    announce,
    run_service,
    secret_from_env,
    wait_for_signal,
)
from transfer.app.synthetic import RequestContent, fragmented_allocator, prefix_seed, request_seed
from transfer.control import HttpService, health, make_app, path_int, read_body, reply
from transfer.deadline import Deadline
from transfer.decode import DecodeFetcher
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

_REMEMBER_ABORTED = 1 << 14


class CorruptKVError(TransferError):
    """Fetched bytes differ from what the prefill wrote."""


class DecodeWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.layout = PRESETS[args.preset](size=args.pool_tokens, device=args.device)
        self.pool = DSAKVPool(self.layout)
        self.allocator = fragmented_allocator(self.layout.num_pages, args.seed)
        self.fetcher = DecodeFetcher(
            self.pool,
            args.registry,
            consumer_id=args.consumer_id,
            secret=secret_from_env(args.secret_env),
            ucx_workers=args.ucx_workers,
            timeouts=Timeouts(fetch=args.fetch_timeout),
        )
        self.inflight: dict[int, asyncio.Task[DecodeReply]] = {}
        # The router's abort and its decode request travel on separate connections, so an
        # abort may overtake the request it cancels; remembering it refuses the late request.
        self.aborted: OrderedDict[int, None] = OrderedDict()
        self.stats = {"fetches": 0, "failures": 0, "verified_bytes": 0}

    async def decode(self, req: DecodeRequest) -> DecodeReply:
        pages = self.allocator.alloc(-(-req.num_tokens // self.layout.page_size))
        try:
            deadline = None if req.budget_ms is None else Deadline.from_wire(req.budget_ms)
            started = time.monotonic()
            result = await self.fetcher.fetch(req.engine_id, req.room, pages, deadline=deadline, ticket=req.ticket)
            content = RequestContent(
                request_seed(req.engine_id, req.room),
                req.num_tokens,
                prefix_seed(req.prefix_id),
                self._prefix_tokens(req),
            )
            bad = await asyncio.to_thread(content.mismatched_layers, self.pool, torch.from_numpy(pages))
            if bad:
                raise CorruptKVError(f"room {req.room}: layers {bad[:8]} differ from what prefill wrote")
            verified = (
                req.num_tokens * (self.layout.kv_token_bytes + self.layout.index_token_bytes) * self.layout.layer_num
            )
            return DecodeReply(
                room=req.room,
                nbytes=result.nbytes,
                descriptors=result.descriptors,
                fetch_seconds=result.seconds,
                verified_bytes=verified,
                reads=sum(o.reads for o in result.owners),
                read_seconds=result.read_seconds,
                decoder=self.fetcher.consumer_id,
                control_messages=result.control_messages,
                fetch_started=started,
            )
        finally:
            self.allocator.free(pages)

    def _prefix_tokens(self, req: DecodeRequest) -> int:
        if req.prefix_id < 0:
            return 0
        ps = self.layout.page_size
        return min(req.prefix_tokens, req.num_tokens) // ps * ps

    async def _handle(self, request: web.Request) -> web.Response:
        req = await read_body(request, DecodeRequest)
        if req.room in self.inflight:
            raise ConflictError(f"room {req.room} is already being fetched here")
        if req.room in self.aborted:
            self.stats["failures"] += 1
            raise UnknownRoomError(f"room {req.room} was aborted before its fetch arrived")
        task = asyncio.create_task(self.decode(req))
        self.inflight[req.room] = task
        try:
            out = await task
            self.stats["fetches"] += 1
            self.stats["verified_bytes"] += out.verified_bytes
            return reply(out)
        except asyncio.CancelledError:
            self.stats["failures"] += 1
            if task.cancelled():  # aborted through /abort, not our own handler cancelled
                raise UnknownRoomError(f"room {req.room} was aborted") from None
            raise
        except PdkvError:
            self.stats["failures"] += 1
            raise
        finally:
            self.inflight.pop(req.room, None)

    async def _abort(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        task = self.inflight.get(room)
        if task is not None:
            task.cancel()
        else:
            self.aborted[room] = None
            if len(self.aborted) > _REMEMBER_ABORTED:
                self.aborted.popitem(last=False)
        return web.Response(status=200)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **self.stats,
                "pages_in_use": self.allocator.used_count,
                "peers": self.fetcher.transport.peer_count if self.fetcher.transport else 0,
            }
        )

    async def _ready(self, request: web.Request) -> web.Response:
        if self.fetcher.transport is None:  # a decode registers nothing: its transport is what it needs
            return web.json_response({"status": "not ready", "why": "the UCX transport is not up"}, status=503)
        return web.json_response({"status": "ready", "why": "UCX up"})

    async def run(self) -> None:
        app = make_app(secret_from_env(self.args.secret_env), consumer=self.args.consumer_id)
        app.router.add_post("/v1/decode", self._handle)
        app.router.add_post("/v1/rooms/{room}/abort", self._abort)
        app.router.add_get("/v1/stats", self._stats)
        app.router.add_get("/health", health)
        app.router.add_get("/ready", self._ready)
        http = HttpService(app, self.args.host, self.args.port, timeouts=self.fetcher.timeouts)
        async with self.fetcher:
            announce(self.args.ready_file, await http.start())
            try:
                await wait_for_signal()
            finally:
                for t in self.inflight.values():
                    t.cancel()
                await asyncio.gather(*self.inflight.values(), return_exceptions=True)
                await http.aclose()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description="a demo pdkv decode worker")
    ap.add_argument("--registry", required=True)
    ap.add_argument("--consumer-id", default=None)
    add_pool_flags(ap, 128 * 1024)
    ap.add_argument(
        "--ucx-workers",
        type=int,
        default=0,
        help="threads posting UCX READs; 0: one a core, up to 8 (4 on a GPU)",
    )
    ap.add_argument("--fetch-timeout", type=float, default=Timeouts().fetch)
    ap.add_argument("--seed", type=int, default=1)
    add_service_flags(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_service(parse_args(argv), DecodeWorker)


if __name__ == "__main__":
    main()
