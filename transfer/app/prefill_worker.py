"""One CP rank of a demo prefill engine: no weights, real pools, real collectives.

The ranks of an engine run in lockstep, like the ranks of one model: rank 0 takes
requests over HTTP and, each step, every rank learns them through collectives on the
engine's gloo group, allocates the same pages (identical allocators), and writes its
owned layers layer by layer from a deterministic function of (engine, room, token),
marking each layer ready for decodes as it goes. A request with a shared prefix first
reads the prefix's KV of every layer through the pool's owner broadcast (non-owned
layers arrive from their owner) and checks it byte for byte: the in-prefill read path
under real load. Pages return to the allocators only once every rank freed the room.

    python -m transfer.app.prefill_worker --engine-id E --cp-rank R --cp-size N \\
        --dist-init file:///tmp/E.init --registry http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from aiohttp import web

from pdkv import PRESETS, LayerSplitDSAKVPool, OwnerBroadcaster, ShardPlan
from pdkv.broadcast import CollectiveHandle
from pdkv.errors import ClosedError, DeadlineExceeded, PdkvError, UnknownRoomError
from transfer.app.api import PrefillReply, PrefillRequest
from transfer.app.options import HelpFormatter
from transfer.app.service import (
    add_pool_flags,
    add_service_flags,
    announce,
    run_service,
    secret_from_env,
    wait_for_signal,
)
from transfer.app.supervisor import BROADCAST_CTAS
from transfer.app.synthetic import (
    RequestContent,
    fragmented_allocator,
    prefix_seed,
    request_seed,
    summable,
    token_locations,
)
from transfer.control import HttpService, health, make_app, path_int, read_body, reply
from transfer.deadline import Deadline
from transfer.logctx import request_context
from transfer.metadata import OwnerPin, RoomTicket
from transfer.prefill.exporter import INCARNATION_HEX, PrefillExporter
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

_STEP_IDLE_S = 0.05  # rank 0 joins a step at least this often: it carries frees and stop
_MAX_BATCH = 8
# What the ranks of a step learn of each request, packed by name into an int64 row (a
# field added to PrefillRequest without a place here does not reach the other ranks).
_STEP_FIELDS = ("room", "num_tokens", "prefix_id", "prefix_tokens", "consumers", "ticket")


class PrefixMismatch(PdkvError):
    """A shared prefix read back through the owner broadcast differs from what was written."""


@dataclass
class _Pending:
    request: PrefillRequest
    done: asyncio.Future[PrefillReply] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PrefillEngineRank:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank, self.world = args.cp_rank, args.cp_size
        self.layout = PRESETS[args.preset](size=args.pool_tokens, device=rank_device(args.device, args.cp_rank))
        self.timeouts = Timeouts(pin=args.pin, lease=args.lease, ticket_progress_interval=args.owner_progress)
        self.queue: list[_Pending] = []
        self.stop_requested = False
        self.finished_local: list[int] = []
        self.votes: dict[int, set[int]] = {}
        self.room_pages: dict[int, np.ndarray] = {}
        self.prefixes: dict[int, tuple[np.ndarray, int]] = {}

    # ---- collectives on the engine's control group ---------------------------------------
    async def _gather(self, t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(self.world)]
        await CollectiveHandle([dist.all_gather(out, t, async_op=True)], "step all_gather")
        return torch.stack(out)

    async def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        await CollectiveHandle([dist.broadcast(t, src=0, async_op=True)], "step broadcast")
        return t

    # ---- the step loop -------------------------------------------------------------------
    async def step(self) -> bool:
        finished, self.finished_local = self.finished_local, []
        batch = self.queue[:_MAX_BATCH] if self.rank == 0 else []
        del self.queue[: len(batch)]
        hdr = await self._gather(torch.tensor([len(finished), len(batch), int(self.stop_requested)]))
        if int(hdr[:, 0].max()):
            pad = torch.full((int(hdr[:, 0].max()),), -1, dtype=torch.int64)
            pad[: len(finished)] = torch.tensor(finished, dtype=torch.int64)
            self._count_votes(await self._gather(pad))
        n_new = int(hdr[0, 1])
        if n_new:
            reqs = torch.zeros((n_new, len(_STEP_FIELDS)), dtype=torch.int64)
            if self.rank == 0:
                reqs[:] = torch.tensor([[getattr(p.request, f) for f in _STEP_FIELDS] for p in batch])
            for row in (await self._bcast(reqs)).tolist():
                await self._run_one(PrefillRequest(**dict(zip(_STEP_FIELDS, row))), batch)
        return not bool(hdr[:, 2].any())

    def _count_votes(self, ids: torch.Tensor) -> None:
        for rank, row in enumerate(ids.tolist()):
            for room in row:
                if room >= 0:
                    self.votes.setdefault(room, set()).add(rank)
        for room in sorted(r for r, v in self.votes.items() if len(v) == self.world):
            del self.votes[room]
            self.allocator.free(self.room_pages.pop(room))

    async def _run_one(self, req: PrefillRequest, batch: list[_Pending]) -> None:
        with request_context(engine=self.args.engine_id, rank=self.rank, room=req.room):
            await self._run_one_bound(req, batch)

    async def _run_one_bound(self, req: PrefillRequest, batch: list[_Pending]) -> None:
        waiter = next((p for p in batch if p.request.room == req.room), None)
        t0 = time.perf_counter()
        try:
            pages = await self.prefill(req)
            outcome: PrefillReply | PdkvError = PrefillReply(
                room=req.room, pages=len(pages), seconds=time.perf_counter() - t0
            )
        except PdkvError as exc:
            outcome = exc
            self.exporter.abort_room(req.room)
        except Exception as exc:  # every rank fails alike here, so the ranks stay in step
            logger.exception("room %d failed", req.room)
            outcome = PdkvError(f"room {req.room}: prefill failed: {exc}")
            self.exporter.abort_room(req.room)
        ticket = await self._ticket(req.room, pages if isinstance(outcome, PrefillReply) and req.ticket else None)
        if isinstance(outcome, PrefillReply):
            outcome = msgspec.structs.replace(outcome, ticket=ticket)
        if waiter is not None and not waiter.done.done():
            if isinstance(outcome, PdkvError):
                waiter.done.set_exception(outcome)
            else:
                waiter.done.set_result(outcome)

    async def _ticket(self, room: int, pages: np.ndarray | None) -> RoomTicket | None:
        """Every rank's pin of `room` gathered into the ticket rank 0 replies with (a
        collective: every rank calls it for every request); None if any rank has none."""
        pin = None if pages is None else await self.exporter.pin(room, self.timeouts.request)
        row = [0, 0, 0] if pin is None else [pin.slot, pin.nonce, int(pin.incarnation, 16)]
        rows = (await self._gather(torch.tensor(row, dtype=torch.int64))).tolist()
        if pages is None or any(nonce == 0 for _, nonce, _ in rows):
            return None
        pins = [
            OwnerPin(cp_rank=rank, incarnation=f"{inc:0{INCARNATION_HEX}x}", slot=slot, nonce=nonce)
            for rank, (slot, nonce, inc) in enumerate(rows)
        ]
        return RoomTicket(engine_id=self.args.engine_id, room=room, src_pages=pages.tolist(), pins=pins)

    # ---- one request ------------------------------------------------------------------------
    async def prefill(self, req: PrefillRequest) -> np.ndarray:
        ps = self.layout.page_size
        prefix_pages, prefix_tokens = await self._prefix(req)
        pages = self.allocator.alloc(-(-req.num_tokens // ps))  # same outcome on every rank
        self.room_pages[req.room] = pages
        try:
            # The room's end, not its frees: a reader with a prefix frees the pages below it first.
            # A room whose ticket the reply carries holds no claim for the arbiter: the ticket takes that claim.
            end = lambda *_: self.finished_local.append(req.room)  # noqa: E731
            self.exporter.publish_room(req.room, pages, req.consumers, on_end=end, hold=not req.ticket)
        except PdkvError as exc:  # e.g. aborted before it ran: write anyway, keep in step
            logger.info("room %d not exported: %s", req.room, exc)
            self.finished_local.append(req.room)
        content = RequestContent(
            request_seed(self.args.engine_id, req.room), req.num_tokens, prefix_seed(req.prefix_id), prefix_tokens
        )
        await self._write_layers(req.room, content, torch.from_numpy(pages), prefix_pages, prefix_tokens)
        return pages

    async def _prefix(self, req: PrefillRequest) -> tuple[torch.Tensor | None, int]:
        if req.prefix_id < 0 or req.prefix_tokens == 0:
            return None, 0
        tokens = min(req.prefix_tokens, req.num_tokens) // self.layout.page_size * self.layout.page_size
        if tokens == 0:
            return None, 0
        cached = self.prefixes.get(req.prefix_id)
        if cached is None or cached[1] < tokens:
            if cached is not None:
                self.allocator.free(cached[0])
            pages = self.allocator.alloc(-(-max(tokens, 1) // self.layout.page_size))
            content = RequestContent(prefix_seed(req.prefix_id), tokens)
            await self._write_layers(None, content, torch.from_numpy(pages), None, 0)
            self.prefixes[req.prefix_id] = cached = (pages, tokens)
        return torch.from_numpy(cached[0]), tokens

    async def _write_layers(
        self,
        room: int | None,
        content: RequestContent,
        pages: torch.Tensor,
        prefix_pages: torch.Tensor | None,
        prefix_tokens: int,
    ) -> None:
        pool, layout = self.pool, self.layout
        loc = token_locations(layout, pages, content.num_tokens)
        in_place = summable(pool)  # host memory, whole words: written in place
        for layer in range(layout.start_layer, layout.end_layer):
            if prefix_pages is not None and prefix_tokens:
                await self._check_prefix(layer, prefix_pages, prefix_tokens, content)
                if layer + 1 < layout.end_layer:
                    pool.prefetch(layer + 1, prefix_pages)  # lands while this layer is written
            if pool.is_owned(layer):
                self._write_layer(layer, content, pages, loc, in_place)
                if room is not None:
                    self.exporter.mark_ready(room, layer + 1)
            else:
                pool.invalidate_layer(layer)
            await asyncio.sleep(self.args.layer_delay)  # also lets the control plane run

    def _write_layer(
        self, layer: int, content: RequestContent, pages: torch.Tensor, loc: torch.Tensor, in_place: bool
    ) -> None:
        """The stand-in's compute of an owned layer: its KV, stored."""
        pool = self.pool
        if in_place:  # page by page, no token rows: the stand-in must not hide the transfer it feeds
            pool.invalidate_layer(layer)  # what the write methods do before the bytes change
            content.write_layer(pool, layer, pages.numpy())
            return
        data = content.layer(self.layout, layer, scratch=True)  # written at once
        pool.set_kv_buffer(layer, loc, data.kv_rows(self.layout))
        pool.set_index_k_and_scale(layer, loc, data.index_k, data.index_scale)

    async def _check_prefix(self, layer: int, pages: torch.Tensor, tokens: int, content: RequestContent) -> None:
        """Read the prefix of `layer` as attention would: from the owner, by broadcast."""
        await self.pool.wait_layer(layer, pages)  # only the prefix's pages travel
        prefix = RequestContent(content.prefix_seed, tokens)
        if not prefix.latent_matches(self.layout, self.pool.get_key_buffer(layer), layer, pages.numpy()):
            raise PrefixMismatch(f"layer {layer}: shared prefix read through the owner broadcast differs")

    # ---- rank 0's request intake ---------------------------------------------------------------
    async def _intake(self, request: web.Request) -> web.Response:
        pending = _Pending(await read_body(request, PrefillRequest))
        budget = pending.request.budget_ms
        deadline = Deadline.after(self.timeouts.prefill) if budget is None else Deadline.from_wire(budget)
        self.queue.append(pending)
        try:
            return reply(await asyncio.wait_for(asyncio.shield(pending.done), deadline.left()))
        except asyncio.TimeoutError as exc:
            raise DeadlineExceeded(f"room {pending.request.room} not prefilled by its deadline") from exc

    async def _abort(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        for p in [p for p in self.queue if p.request.room == room]:
            self.queue.remove(p)
            p.done.set_exception(UnknownRoomError(f"room {room} aborted before it ran"))
        return web.Response(status=200)

    # ---- process ----------------------------------------------------------------------------
    async def run(self) -> None:
        a = self.args
        timeout = datetime.timedelta(seconds=a.group_timeout)
        dist.init_process_group("gloo", init_method=a.dist_init, rank=self.rank, world_size=self.world, timeout=timeout)
        plan = ShardPlan(self.rank, self.world, self.layout.layer_num, self.layout.start_layer)
        backend = a.broadcast_backend or broadcast_backend(self.layout.device, self.world)
        broadcaster = OwnerBroadcaster(
            device=self.layout.device, timeout=timeout, backend=backend, max_ctas=a.broadcast_ctas
        )
        self.pool = LayerSplitDSAKVPool(self.layout, plan, broadcaster)
        self.allocator = fragmented_allocator(self.layout.num_pages, a.seed)
        secret = secret_from_env(a.secret_env)
        self.exporter = PrefillExporter(
            self.pool,
            a.engine_id,
            self.rank,
            self.world,
            a.registry,
            host=a.host,
            timeouts=self.timeouts,
            secret=secret,
            hold_claims=a.held_claims,
        )
        await self.exporter.start()
        intake = None
        if self.rank == 0:
            app = make_app(secret, engine=a.engine_id)
            app.router.add_post("/v1/prefill", self._intake)
            app.router.add_post("/v1/rooms/{room}/abort", self._abort)
            app.router.add_get("/health", health)
            app.router.add_get("/ready", self._ready)
            intake = HttpService(app, a.host, a.port, timeouts=self.timeouts)
            await intake.start()
        announce(
            self.args.ready_file,
            json.dumps({"control": self.exporter.control_url, "intake": intake.url if intake else ""}),
        )
        stopper = asyncio.create_task(self._stop_on_signal())
        try:
            while await self.step():
                if self.rank == 0 and not self.queue and not self.finished_local:
                    await asyncio.sleep(_STEP_IDLE_S)
        finally:
            stopper.cancel()
            for p in self.queue:
                p.done.set_exception(ClosedError("prefill engine is shutting down"))
            await self.exporter.aclose()
            if intake is not None:
                await intake.aclose()
            dist.destroy_process_group()

    async def _ready(self, request: web.Request) -> web.Response:
        """The intake is ready as its rank's exporter is (registered, UCX up)."""
        ready, why = self.exporter.readiness()
        body = {"status": "ready" if ready else "not ready", "why": why}
        return web.json_response(body, status=200 if ready else 503)

    async def _stop_on_signal(self) -> None:
        await wait_for_signal()
        self.stop_requested = True


def rank_device(device: str, rank: int) -> str:
    """`cuda` means one GPU per CP rank where there are several (NCCL wants one rank per
    device); ranks share the GPU where there is one."""
    if device != "cuda" or not torch.cuda.is_available():
        return device
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def broadcast_backend(device: str | torch.device, world: int) -> str:
    """NCCL where every CP rank has a GPU of its own; gloo on the host, and where ranks share
    a GPU (NCCL refuses two ranks on one device: the main job on one GPU failed its first
    shared-prefix read with an NCCL usage error)."""
    if torch.device(device).type == "cuda" and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description="one CP rank of a demo pdkv prefill engine")
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--cp-rank", type=int, required=True)
    ap.add_argument("--cp-size", type=int, required=True)
    ap.add_argument("--dist-init", required=True, help="torch.distributed init method (file:// or tcp://)")
    ap.add_argument("--registry", required=True, help="bootstrap registry URL")
    add_pool_flags(ap, 96 * 1024)
    ap.add_argument("--pin", type=float, default=Timeouts().pin, help="seconds pages stay pinned unreleased")
    ap.add_argument("--lease", type=float, default=Timeouts().lease, help="registry lease (renewed every third)")
    ap.add_argument(
        "--owner-progress",
        type=float,
        default=None,
        help="seconds between drives of the UCX worker while a room is read (default: by transport, see Timeouts)",
    )
    ap.add_argument("--layer-delay", type=float, default=0.0, help="stand-in compute time per layer (s)")
    ap.add_argument("--group-timeout", type=float, default=60.0)
    ap.add_argument(
        "--broadcast-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="owner broadcast backend (default: nccl with a GPU per rank, else gloo)",
    )
    ap.add_argument(
        "--broadcast-ctas",
        type=int,
        default=BROADCAST_CTAS,
        help="SMs the NCCL owner broadcast may take beside the model's compute (0: NCCL's choice; see README)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-held-claims",
        dest="held_claims",
        action="store_false",
        help="hold no claim of whole rooms for the arbiter to hand out: every claim is relayed",
    )
    add_service_flags(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_service(parse_args(argv), PrefillEngineRank)


if __name__ == "__main__":
    main()
