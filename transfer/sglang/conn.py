"""SGLang's transfer-backend classes for pdkv (sglang 0.5.23, `disaggregation/base/conn.py`).

SGLang's backends push: a prefill's sender WRITEs into the pages its decode named. pdkv
pulls, so the same interface runs the other way round, with no message from the decode
to the prefill:

    prefill, per request                          decode, per request
    sender.init(pages, aux_index)  publish_chunked  receiver.init(prefill_dp_rank)  look the engine up
    sender.send(page_indices)      add_chunk        receiver.send_metadata(pages)   fetch into them
    sender.poll(): Success once the decode has      receiver.poll(): Success once every
    read and released the room                      byte (and the aux row) is in

Every call returns at once: pdkv's asyncio side runs on threads of its own
(`transfer.sync`). The bootstrap server is pdkv's registry. A room is the request's
`bootstrap_room`; an engine is a prefill DP rank (`dp<N>`), its CP ranks the owners; a
draft model's (MTP) layers travel as the engine `dp<N>-draft` (`transfer.sglang.kvargs`).
What is not supported is refused with a `PdkvError` through `failure_exception()`:
host destinations, and auxiliary buffers in device memory (docs/sglang.md says why). A
decode's prefix (`decode_prefix_len`) is served by reading only the room's pages past it.

This module is the path SGLang and users import the four classes from; each lives in a
module of its role: `manager`, `sender`, `receiver`, `bootstrap` (and `outcome`, the poll
state both sides keep).
"""

from transfer.sglang.bootstrap import PdkvKVBootstrapServer
from transfer.sglang.kvargs import engine_kv_from_args
from transfer.sglang.manager import PdkvKVManager
from transfer.sglang.receiver import PdkvKVReceiver
from transfer.sglang.sender import PdkvKVSender

__all__ = ["PdkvKVManager", "PdkvKVSender", "PdkvKVReceiver", "PdkvKVBootstrapServer", "engine_kv_from_args"]
