"""Owner broadcast over a dedicated CP process group, with an asyncio face.

A layer's owner sends its buffer to every other rank of the CP group; the others receive
into a scratch buffer. On the host the group is gloo; on CUDA it is NCCL and the
collective runs on a side stream, ordered against the compute stream with events, so a
prefetch of layer l+1 overlaps the compute of layer l.

`start()` returns at once with a `CollectiveHandle`. `handle.wait()` blocks; `await handle`
completes when the broadcast has landed without blocking the event loop: the collective's
own future calls back into the loop, so there is neither a thread per broadcast nor a
spinning task.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pdkv.errors import DeadlineExceeded, PeerLostError

__all__ = ["OwnerBroadcaster", "CollectiveHandle"]

logger = logging.getLogger(__name__)

_CUDA_POLL_S = (0.00005, 0.002)  # first and longest sleep between CUDA event queries


def _translate(exc: BaseException, what: str) -> Exception:
    """torch.distributed's failures into the pdkv tree: the one place that sees them.

    A lost peer is `DistNetworkError` (or a gloo error naming the connection); a timeout
    has no class of its own in torch.distributed, gloo and NCCL say it only in the message.
    """
    text = str(exc)
    if not isinstance(exc, dist.DistNetworkError) and ("Timed out" in text or "timeout" in text.lower()):
        return DeadlineExceeded(f"{what}: {text}")
    return PeerLostError(f"{what}: {text}")


class CollectiveHandle:
    """One in-flight owner broadcast. Waiting twice is free."""

    def __init__(self, work: Any, event: torch.cuda.Event | None, what: str) -> None:
        self._work = work
        self._event = event
        self._what = what
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        if self._event is not None:
            return self._work.is_completed() and self._event.query()
        return self._work.is_completed()

    def wait(self) -> None:
        """Block until the data landed (host) or order the current stream after it (CUDA)."""
        if self._done:
            return
        try:
            self._work.wait()
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses
            raise _translate(exc, self._what) from exc
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        self._done = True

    async def wait_async(self) -> None:
        """Complete when the broadcast has landed, yielding to the loop meanwhile."""
        if self._done:
            return
        loop = asyncio.get_running_loop()
        landed: asyncio.Future[None] = loop.create_future()

        def _wake(_: object) -> None:
            loop.call_soon_threadsafe(lambda: landed.done() or landed.set_result(None))

        self._work.get_future().add_done_callback(_wake)
        await landed
        if self._event is not None:
            # NCCL's future completes once the work is enqueued; the event marks landing.
            delay = _CUDA_POLL_S[0]
            while not self._event.query():
                await asyncio.sleep(delay)
                delay = min(delay * 2, _CUDA_POLL_S[1])
        self.wait()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait_async().__await__()


class OwnerBroadcaster:
    """Broadcasts from a layer's owner over its own process group for one CP group.

    A group of its own keeps these collectives from interleaving with the model's
    other collectives on the default group.
    """

    def __init__(
        self,
        ranks: Sequence[int] | None = None,
        device: str = "cpu",
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        backend: str | None = None,
    ) -> None:
        """`backend` defaults to NCCL on CUDA and gloo on the host. gloo also moves CUDA
        tensors, for CP ranks that share one GPU (NCCL wants one rank per device)."""
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.backend = backend or ("nccl" if cuda else "gloo")
        world = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        self.group = dist.new_group(world, backend=self.backend, timeout=timeout)
        self.rank = dist.get_rank(self.group)
        self.size = len(world)
        self._stream = torch.cuda.Stream(self.device) if cuda and self.backend == "nccl" else None
        logger.info("owner broadcast group: %s, rank %d of %d", self.backend, self.rank, self.size)

    def start(self, tensor: torch.Tensor, src: int, what: str = "broadcast") -> CollectiveHandle:
        """Start broadcasting `tensor` from group rank `src`; return at once."""
        try:
            if self._stream is None:
                if tensor.is_cuda:  # gloo reads and writes device memory outside stream order
                    torch.cuda.current_stream(tensor.device).synchronize()
                work = dist.broadcast(tensor, group_src=src, group=self.group, async_op=True)
                return CollectiveHandle(work, None, what)
            # The side stream waits for whatever the compute stream queued before (the
            # owner's writes); the compute stream later waits for the event.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                work = dist.broadcast(tensor, group_src=src, group=self.group, async_op=True)
                work.wait()
                event = torch.cuda.Event()
                event.record(self._stream)
            tensor.record_stream(self._stream)
            return CollectiveHandle(work, event, what)
        except RuntimeError as exc:
            raise _translate(exc, what) from exc

    def close(self) -> None:
        dist.destroy_process_group(self.group)
