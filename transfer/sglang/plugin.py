"""The SGLang plugin that makes pdkv SGLang's transfer backend, with no change to SGLang.

SGLang 0.5.23 picks a backend from a closed enum (`TransferBackend`) in
`disaggregation.utils.get_kv_class`, and accepts only Mooncake with
`--enable-dsa-cache-layer-split`. This plugin (entry point `sglang.srt.plugins: pdkv`,
installed with pdkv) wraps `get_kv_class`: with `PDKV_SGLANG=1` in the environment, every
backend but SGLang's own fake one (its warm-up requests) resolves to pdkv's classes, so a
deployment keeps `--disaggregation-transfer-backend mooncake` on its command line and
needs no Mooncake. The upstream change would be a `PDKV = "pdkv"` member of
`TransferBackend` and one more branch in `get_kv_class`.

SGLang's `HookRegistry.apply_hooks` logs a hook it cannot apply and carries on (as
`load_plugins` does with a plugin that raises), and `get_kv_class` then hands out
Mooncake's classes without a word. So, with `PDKV_SGLANG=1`, `register` also guards the
construction of every KV manager and bootstrap server (SGLang's base classes), which
does not depend on the hook: one that is not pdkv's refuses, with
`PdkvNotInChargeError` naming why the hook is not in effect.

pdkv's own manager and bootstrap server refuse to start on an SGLang release outside
`SGLANG_TESTED` (`UnsupportedSGLangError`: its backend interface changes between releases)
and on NIXL or CUDA bindings built for another CUDA than torch (`BuildMismatchError`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from pdkv.errors import PdkvError
from transfer.sglang.runtime import SGLANG_TESTED, UnsupportedSGLangError, check_runtime

__all__ = [
    "SGLANG_TESTED",
    "PdkvNotInChargeError",
    "UnsupportedSGLangError",
    "check_runtime",
    "register",
    "require_in_charge",
    "select",
]

TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
_TARGET_MODULE = TARGET.rsplit(".", 1)[0]
# SGLang's fake backend serves its warm-up requests; `select` leaves it alone, so may the guard.
_FAKE_BACKEND = "sglang.srt.disaggregation.fake"

logger = logging.getLogger(__name__)


class PdkvNotInChargeError(PdkvError, RuntimeError):
    """pdkv was asked for (`PDKV_SGLANG`), yet SGLang is building another backend's class.

    An `Exception` is enough: SGLang builds its KV manager inside the scheduler process's
    start, whose `except Exception` logs the traceback and takes the server down, and its
    bootstrap server while the launcher builds the tokenizer manager, which catches nothing."""


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


class _ApplyFailure(logging.Filter):
    """Keeps the error HookRegistry logs when it cannot apply pdkv's hook: it is not
    raised anywhere, and the refusal should name it. Lets every record through."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args == (TARGET,) and record.exc_info and record.exc_info[1] is not None:
            self.error = record.exc_info[1]
        return True


_apply_failure = _ApplyFailure()


def _is_pdkv(cls: type) -> bool:
    conn = sys.modules.get("transfer.sglang.conn")  # not imported: nothing here is pdkv's
    return conn is not None and issubclass(cls, (conn.PdkvKVManager, conn.PdkvKVBootstrapServer))


def _why_not_in_effect() -> str:
    """Why pdkv's hook on `get_kv_class` is not in effect in this process, as far as is known."""
    error = _apply_failure.error
    if error is not None:
        why = f"SGLang's HookRegistry failed to apply it: {type(error).__name__}: {error}"
        if isinstance(error, AttributeError):  # pkgutil.resolve_name drops the ImportError behind it
            why += f"; pkgutil says so when importing {_TARGET_MODULE} raised ImportError: import it to see why"
        return why
    from sglang.srt.plugins.hook_registry import HookRegistry

    if TARGET in HookRegistry._patched:
        return "it is applied, yet another class came out: an unpatched reference, or another plugin's hook around it"
    if not any(hook is select for _, hook, _ in HookRegistry._hooks.get(TARGET, [])):
        return "it is not registered with HookRegistry (was HookRegistry reset?)"
    return "HookRegistry has not applied it in this process (load_plugins() did not run here)"


def require_in_charge(cls: type) -> None:
    """Refuse to build `cls`, a KV manager or bootstrap server, if pdkv was asked for and it is
    not pdkv's; pdkv's own, where this SGLang or the CUDA builds are not what pdkv serves."""
    if not enabled() or cls.__module__.startswith(_FAKE_BACKEND):
        return
    if _is_pdkv(cls):
        check_runtime()
        return
    raise PdkvNotInChargeError(
        f"PDKV_SGLANG={os.environ.get('PDKV_SGLANG')} asks for pdkv as SGLang's transfer backend, but this process "
        f"is building {cls.__module__}.{cls.__qualname__}: pdkv's hook on {TARGET} is not in effect "
        f"({_why_not_in_effect()}). Refusing to start rather than move KV through another backend; "
        "unset PDKV_SGLANG to run SGLang's own backend."
    )


def _guard(base: type) -> None:
    """Check every construction of `base`'s subclasses. `__new__`, not `__init__`: pdkv's and
    SGLang's backends do not all call their base's `__init__`, and none has a `__new__` of its own."""
    inherited: Callable[..., Any] = base.__new__  # object.__new__, or a base's own
    if getattr(inherited, "_pdkv_guard", False):
        return  # register() ran before in this process

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        require_in_charge(cls)
        # object.__new__ refuses the constructor's arguments once __new__ is overridden
        return inherited(cls) if inherited is object.__new__ else inherited(cls, *args, **kwargs)

    new._pdkv_guard = True  # type: ignore[attr-defined]
    base.__new__ = staticmethod(new)  # type: ignore[assignment]


def register() -> None:
    """The plugin's entry point: SGLang calls it early in every process, then applies the hooks."""
    if enabled():
        # First, and apart from HookRegistry: this must hold when the hook below never applies.
        from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer, BaseKVManager

        _guard(BaseKVManager)
        _guard(BaseKVBootstrapServer)
        logging.getLogger("sglang.srt.plugins.hook_registry").addFilter(_apply_failure)
        logger.debug("pdkv refuses any KV manager or bootstrap server but its own in this process")
        try:  # said now, in every process; raised again as pdkv's manager or bootstrap server starts
            check_runtime()
        except PdkvError as exc:
            logger.error("pdkv cannot serve this process: %s", exc)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, select, HookType.AROUND)
