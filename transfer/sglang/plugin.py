"""The SGLang plugin that makes pdkv SGLang's transfer backend, with no change to SGLang.

SGLang 0.5.23 picks a backend from a closed enum (`TransferBackend`) in
`disaggregation.utils.get_kv_class`, and accepts only Mooncake with
`--enable-dsa-cache-layer-split`. This plugin (entry point `sglang.srt.plugins: pdkv`,
installed with pdkv) wraps `get_kv_class`: with `PDKV_SGLANG=1` in the environment, every
backend but SGLang's own fake one (its warm-up requests) resolves to pdkv's classes, so a
deployment keeps `--disaggregation-transfer-backend mooncake` on its command line and
needs no Mooncake. The upstream change would be a `PDKV = "pdkv"` member of
`TransferBackend` and one more branch in `get_kv_class`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["register", "select"]

TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def enabled() -> bool:
    return os.environ.get("PDKV_SGLANG", "") not in ("", "0", "false", "no")


def select(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    """`get_kv_class` with pdkv in place of the chosen backend (an AROUND hook)."""
    kind = str(getattr(class_type, "value", class_type))
    backend = str(getattr(transfer_backend, "value", transfer_backend))
    if not enabled() or backend == "fake" or kind == "kvargs":
        return original(transfer_backend, class_type)
    from transfer.sglang import conn

    return {
        "manager": conn.PdkvKVManager,
        "sender": conn.PdkvKVSender,
        "receiver": conn.PdkvKVReceiver,
        "bootstrap_server": conn.PdkvKVBootstrapServer,
    }[kind]


def register() -> None:
    """The plugin's entry point: SGLang calls it early in every process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, select, HookType.AROUND)
