"""Owner broadcast over a dedicated CP process group, with an asyncio face.

A layer's owner sends its buffer to every other rank of the CP group; the others receive
into a scratch buffer. On the host the group is gloo. On CUDA it is an NCCL communicator
of its own (`pdkv.nccl`, driven through nccl4py's bindings: torch's process group cost more host time
a call than a 6 MiB layer takes on NVLink), whose high-priority stream is the side stream:
a broadcast starts after what the compute stream had queued when it was started (the
owner's writes), and `wait()` orders the compute stream after it, so a prefetch of layer
l+1 overlaps the compute of layer l. Where NCCL is not a library of its own, torch's NCCL
process group serves, its C++ methods called directly: the per-layer host time is on the
prefill's critical path.

`start()` returns at once with a `CollectiveHandle`. `handle.wait()` blocks (host) or
orders the current stream (CUDA); `await handle` completes when the broadcast has landed,
without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pdkv.errors import DeadlineExceeded, PdkvError, PeerLostError
from pdkv.nccl import NcclComm, nccl_library, unique_id

__all__ = ["OwnerBroadcaster", "CollectiveHandle", "nccl_group_options"]

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
    """One in-flight owner broadcast (of one or several tensors). Waiting twice is free."""

    def __init__(self, works: list[Any], what: str, on_gpu: bool = False) -> None:
        self._works = works
        self._what = what
        self._on_gpu = on_gpu  # NCCL: is_completed() is the GPU's answer; the future is not
        self._done = False

    def done(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        """Block until the data landed (host) or order the current stream after it (CUDA)."""
        if self._done:
            return
        try:
            for work in self._works:
                work.wait()
        except PdkvError:
            raise
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses
            raise _translate(exc, self._what) from exc
        self._done = True

    async def wait_async(self) -> None:
        """Complete when the broadcast has landed, yielding to the loop meanwhile."""
        if self._done:
            return
        if self._on_gpu:
            delay = _CUDA_POLL_S[0]
            while not self.done():
                await asyncio.sleep(delay)
                delay = min(delay * 2, _CUDA_POLL_S[1])
        else:  # gloo's futures complete on its thread once the data is here
            await asyncio.gather(*(_landed(w) for w in self._works))
        self.wait()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait_async().__await__()


async def _landed(work: Any) -> None:
    loop = asyncio.get_running_loop()
    landed: asyncio.Future[None] = loop.create_future()

    def land() -> None:
        if not landed.done():
            landed.set_result(None)

    work.get_future().add_done_callback(lambda _: loop.call_soon_threadsafe(land))
    await landed


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
        max_ctas: int | None = None,
    ) -> None:
        """`backend` defaults to NCCL on CUDA and gloo on the host. gloo also moves CUDA
        tensors, for CP ranks that share one GPU (NCCL wants one rank per device).

        `max_ctas` caps the SMs NCCL's kernels take (NCCL's `maxCTAs`; None or 0: NCCL's
        choice): a prefetch runs beside the model's compute, and every SM it holds is one
        the compute lacks.
        """
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.backend = backend or ("nccl" if cuda else "gloo")
        world = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        self._comm: NcclComm | None = None
        if self.backend == "nccl" and nccl_library() is not None:
            # gloo only hands the communicator's id around; NCCL carries the layers.
            self.group = dist.new_group(world, backend="gloo", timeout=timeout)
            self._comm = self._communicator(timeout.total_seconds(), max_ctas)
        else:
            options = nccl_group_options(max_ctas) if self.backend == "nccl" else None
            self.group = dist.new_group(world, backend=self.backend, timeout=timeout, pg_options=options)
        self.rank = dist.get_rank(self.group)
        self.size = len(world)
        self._nccl = cuda and self.backend == "nccl"
        self._options = [self._broadcast_options(src) for src in range(self.size)]  # built once: per-layer path
        logger.info(
            "owner broadcast group: %s%s, rank %d of %d, max CTAs %s",
            self.backend,
            " (its own communicator)" if self._comm is not None else "",
            self.rank,
            self.size,
            (max_ctas or "NCCL's choice") if self._nccl else "n/a",
        )

    def _communicator(self, timeout: float, max_ctas: int | None) -> NcclComm:
        ident = torch.zeros(128, dtype=torch.uint8)
        if dist.get_rank(self.group) == 0:
            ident.copy_(torch.frombuffer(bytearray(unique_id()), dtype=torch.uint8))
        dist.broadcast(ident, group_src=0, group=self.group)
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        return NcclComm(bytes(ident.numpy()), rank, size, self.device, timeout, max_ctas)

    def start(
        self, tensors: torch.Tensor | Sequence[torch.Tensor], src: int, what: str = "broadcast"
    ) -> CollectiveHandle:
        """Start broadcasting `tensors` from group rank `src`; return at once.

        On NCCL several tensors (a layer's latent and indexer) go as one group: one launch
        instead of one each.
        """
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if self._comm is not None:
            return CollectiveHandle([self._comm.broadcast(tensors, src, what)], what, on_gpu=True)
        opts = self._options[src]
        try:
            if self._nccl:
                return CollectiveHandle([self._nccl_broadcast(tensors, opts)], what, on_gpu=True)
            if any(t.is_cuda for t in tensors):  # gloo reads and writes device memory outside stream order
                torch.cuda.current_stream(self.device).synchronize()
            return CollectiveHandle([self.group.broadcast([t], opts) for t in tensors], what)
        except RuntimeError as exc:
            raise _translate(exc, what) from exc

    @staticmethod
    def _broadcast_options(src: int) -> dist.BroadcastOptions:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.asyncOp = src, 0, True
        return opts

    def _nccl_broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Any:
        if len(tensors) == 1:
            return self.group.broadcast(tensors, opts)
        self.group._start_coalescing(self.device)  # ncclGroupStart: no public API for a group yet
        try:
            for t in tensors:
                self.group.broadcast([t], opts)
        finally:
            work = self.group._end_coalescing(self.device)
        return work

    def close(self) -> None:
        if self._comm is not None:
            self._comm.close()
        dist.destroy_process_group(self.group)


def nccl_group_options(max_ctas: int | None) -> dist.ProcessGroupNCCL.Options:
    """A torch NCCL group set up as the owner broadcast's: a high-priority stream (its kernels
    get SMs ahead of queued compute, so prefetches hide better) and at most `max_ctas` SMs
    (None or 0: NCCL's choice)."""
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    if max_ctas:
        options.config.max_ctas = max_ctas
    return options
