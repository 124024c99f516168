"""pdkv: what a prefill or decode worker holds.

The KV layout and its fingerprint, the CP layer shard plan, the DSA KV pools (full and
layer-split), and the owner-broadcast channel that serves in-prefill reads of layers a
rank does not own. This package never imports `transfer`.

Each name is loaded on first use, so that a process that needs only the errors (a registry,
a router) does not load torch with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdkv.broadcast import CollectiveHandle, OwnerBroadcaster
    from pdkv.errors import (
        AuthError,
        CapacityError,
        ClaimLostError,
        ClosedError,
        ConflictError,
        DeadlineExceeded,
        IncompatibleLayoutError,
        InvalidPagesError,
        LayoutError,
        MetadataError,
        NotReadyError,
        PageRangeError,
        PdkvError,
        PeerLostError,
        RoomAbortedError,
        RoomClaimedError,
        TransferError,
        UnknownEngineError,
        UnknownRoomError,
    )
    from pdkv.layer_split import LayerSplitDSAKVPool
    from pdkv.layout import PRESETS, BufferKind, KVLayout, dsa_v32, tiny
    from pdkv.pages import PageAllocator
    from pdkv.pool import BufferInfos, CpuKVCopy, DSAKVPool
    from pdkv.sharding import ShardPlan, get_layer_owner, get_layer_shard_range

_HOMES = {
    "AuthError": "pdkv.errors",
    "BufferInfos": "pdkv.pool",
    "BufferKind": "pdkv.layout",
    "CapacityError": "pdkv.errors",
    "ClaimLostError": "pdkv.errors",
    "ClosedError": "pdkv.errors",
    "CollectiveHandle": "pdkv.broadcast",
    "ConflictError": "pdkv.errors",
    "CpuKVCopy": "pdkv.pool",
    "DSAKVPool": "pdkv.pool",
    "DeadlineExceeded": "pdkv.errors",
    "IncompatibleLayoutError": "pdkv.errors",
    "InvalidPagesError": "pdkv.errors",
    "KVLayout": "pdkv.layout",
    "LayerSplitDSAKVPool": "pdkv.layer_split",
    "LayoutError": "pdkv.errors",
    "MetadataError": "pdkv.errors",
    "NotReadyError": "pdkv.errors",
    "OwnerBroadcaster": "pdkv.broadcast",
    "PRESETS": "pdkv.layout",
    "PageAllocator": "pdkv.pages",
    "PageRangeError": "pdkv.errors",
    "PdkvError": "pdkv.errors",
    "PeerLostError": "pdkv.errors",
    "RoomAbortedError": "pdkv.errors",
    "RoomClaimedError": "pdkv.errors",
    "ShardPlan": "pdkv.sharding",
    "TransferError": "pdkv.errors",
    "UnknownEngineError": "pdkv.errors",
    "UnknownRoomError": "pdkv.errors",
    "dsa_v32": "pdkv.layout",
    "get_layer_owner": "pdkv.sharding",
    "get_layer_shard_range": "pdkv.sharding",
    "tiny": "pdkv.layout",
}

__all__ = [
    "BufferKind",
    "AuthError",
    "CapacityError",
    "ClaimLostError",
    "ClosedError",
    "ConflictError",
    "InvalidPagesError",
    "RoomClaimedError",
    "CollectiveHandle",
    "BufferInfos",
    "CpuKVCopy",
    "DSAKVPool",
    "DeadlineExceeded",
    "IncompatibleLayoutError",
    "KVLayout",
    "LayerSplitDSAKVPool",
    "LayoutError",
    "MetadataError",
    "OwnerBroadcaster",
    "PRESETS",
    "PageAllocator",
    "PageRangeError",
    "PdkvError",
    "PeerLostError",
    "RoomAbortedError",
    "ShardPlan",
    "TransferError",
    "UnknownRoomError",
    "UnknownEngineError",
    "NotReadyError",
    "dsa_v32",
    "get_layer_owner",
    "get_layer_shard_range",
    "tiny",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pdkv' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
