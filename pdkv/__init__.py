"""pdkv: what a prefill or decode worker holds.

The KV layout and its fingerprint, the CP layer shard plan, the DSA KV pools (full and
layer-split), and the owner-broadcast channel that serves in-prefill reads of layers a
rank does not own. This package never imports `transfer`.
"""

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
