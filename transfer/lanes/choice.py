"""Which lanes a decode reads owners by, and what carries its signals.

`lane` names the choice: "auto" reads owners on this host's GPUs through the same-host GPU
lane (CUDA IPC and one gather kernel) and the rest over UCX; "ucx" and "cuda_ipc" force one
(the latter fails the lookup of an engine it cannot reach so). Whatever the lanes, the
signals (pin words, release notifications) go over UCX.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, NamedTuple

from pdkv.errors import TransferError
from transfer.engine_kv import KVBuffers
from transfer.lanes.base import Lane, Signals
from transfer.lanes.runs import mem_type
from transfer.lanes.ucx.lane import UcxLane
from transfer.lanes.ucx.nixl import default_workers
from transfer.lanes.ucx.signals import UcxSignals
from transfer.lanes.ucx.transport import UcxTransport
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

LANES = ("auto", "ucx", "cuda_ipc")  # a decode's lane choice


class LaneChoice(NamedTuple):
    """A decode's lanes, in the order they are tried for an owner, and its signals."""

    lanes: list[Lane[Any]]
    signals: Signals
    strict: bool  # an owner no lane reaches fails its lookup (else the last lane reads every owner)


def check_lane(lane: str, pool: KVBuffers) -> None:
    """Refuse a `lane` that is not one of `LANES`, or that `pool` cannot be read by."""
    if lane not in LANES:
        raise ValueError(f"lane must be one of {LANES}, not {lane!r}")
    if lane == "cuda_ipc" and pool.device.type != "cuda":
        raise ValueError("the cuda_ipc lane needs a decode pool on a GPU")


def lanes_for(
    pool: KVBuffers,
    lane: str,
    name: str,
    *,
    timeouts: Timeouts,
    workers: int | None = None,
    merge_runs: bool = True,
    time_kernels: bool = False,
    secret: str | None = None,
) -> LaneChoice:
    """The lanes to try for each owner, in order (the last must reach every owner unless
    `lane` forces one), and the signals, for a decode reading into `pool` (its buffers
    registered here). They share one UCX transport, named after `name`: closing either the
    UCX lane or the signals closes it.

    `workers`: threads that post UCX READs (None: `default_workers`, one a core up to 8, 4
    for a GPU pool); an owner's READ is cut into pieces when workers outnumber owners.
    `merge_runs`: the UCX lane posts runs of pages consecutive on both sides as one
    descriptor. `time_kernels`: the GPU lane times each gather kernel on the GPU (else
    from its launch to the bytes in place). `secret`: the owners' (their GPU memory's
    descriptors are handed out under it).
    """
    check_lane(lane, pool)
    mem = mem_type(pool.device)
    transport = UcxTransport(
        f"{name}.{uuid.uuid4().hex[:8]}",
        workers=workers or default_workers(mem),
        mem_type=mem,
        timeouts=timeouts,
        notifies=True,  # ticket releases
    )
    transport.register(pool.registered_buffers())
    lanes: list[Lane[Any]] = []
    if pool.device.type == "cuda" and lane != "ucx":
        from transfer.lanes.cuda_ipc.lane import CudaIpcLane  # needs CUDA: only where a GPU is

        try:
            gpu = CudaIpcLane(pool.device, time_kernels=time_kernels, secret=secret, fd_timeout=timeouts.connect)
        except TransferError as exc:  # no driver bindings (the `gpu` extra), say
            if lane == "cuda_ipc":
                raise
            logger.warning("no same-host GPU lane, every owner over UCX: %s", exc)
        else:
            lanes.append(gpu)
    if lane != "cuda_ipc":
        lanes.append(UcxLane(transport, merge_runs=merge_runs))
    return LaneChoice(lanes, UcxSignals(transport), strict=lane == "cuda_ipc")
