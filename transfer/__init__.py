"""transfer: what crosses the wire between prefill and decode workers (the library).

The names a user imports are here (`from transfer import PrefillExporter, DecodeFetcher`);
each is loaded on first use, so importing one module of the package (the SGLang plugin,
say, which every SGLang process loads) does not load NIXL, torch or aiohttp with it.

    prefill:  PrefillExporter (async), SyncExporter (a synchronous scheduler's)
    decode:   DecodeFetcher, RoomLease, FetchResult, StreamFetch (async); SyncFetcher, Handle,
              HandleStatus
    tickets:  RoomTicket (a finished room, handed from prefill to decode), OwnerPin
    bounds:   Timeouts, Deadline
    registry: RegistryServer (the bootstrap registry), registry_client

Modules, one per role: `metadata` (wire types), `prefill/` (a rank's exporter, its rooms
and its pin words), `readiness` (readiness pushed to decodes), `decode/` (the fetcher and
its protocols), `lanes/` (what moves bytes: UCX through NIXL, the same-host GPU lane),
`registry/`, `control` and `http_guard` (the control plane over HTTP),
`sync` (the synchronous faces), `sglang/` (the SGLang backend), `metrics`, `logctx`,
`deadline`, `timeouts`. The application that runs them lives in `transfer.app`, which
nothing here imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transfer.deadline import Deadline
    from transfer.decode import DecodeFetcher, RoomLease, StreamFetch
    from transfer.metadata import OwnerPin, RoomTicket
    from transfer.prefill import PrefillExporter
    from transfer.registry import registry_client
    from transfer.registry.server import RegistryServer
    from transfer.results import FetchResult
    from transfer.sync import Handle, HandleStatus, SyncExporter, SyncFetcher
    from transfer.timeouts import Timeouts

_HOMES = {
    "Deadline": "transfer.deadline",
    "DecodeFetcher": "transfer.decode",
    "RoomLease": "transfer.decode",
    "StreamFetch": "transfer.decode",
    "FetchResult": "transfer.results",
    "OwnerPin": "transfer.metadata",
    "RoomTicket": "transfer.metadata",
    "PrefillExporter": "transfer.prefill",
    "RegistryServer": "transfer.registry.server",
    "registry_client": "transfer.registry",
    "HandleStatus": "transfer.sync",
    "Handle": "transfer.sync",
    "SyncExporter": "transfer.sync",
    "SyncFetcher": "transfer.sync",
    "Timeouts": "transfer.timeouts",
}

__all__ = [
    "Deadline",
    "DecodeFetcher",
    "FetchResult",
    "Handle",
    "HandleStatus",
    "OwnerPin",
    "PrefillExporter",
    "RegistryServer",
    "RoomLease",
    "RoomTicket",
    "StreamFetch",
    "SyncExporter",
    "SyncFetcher",
    "Timeouts",
    "registry_client",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
