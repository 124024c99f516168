"""pdkv's SGLang plugin: pdkv is selected when asked for, and an SGLang process in which
pdkv's hook is not in effect refuses to start rather than run another backend.

The start tests run, in a fresh process, SGLang's own `load_plugins()` (pdkv's
`register()`, then `HookRegistry.apply_hooks()`), then build what a process builds at
start as SGLang builds it: the class from `get_kv_class(TransferBackend.MOONCAKE, ...)`,
called with the arguments of `DecodePreallocQueue._init_kv_manager` (the manager) or of
`start_disagg_service` (the bootstrap server).

Two SGLang modules cannot be imported on this CPU machine; stand-ins registered in the
child's `sys.modules` take their place, and nothing else is replaced:

* `sglang.srt.configs.model_config`: `disaggregation.utils` imports two DSA helpers from it
  (called only by its metadata buffers), and it imports transformers, not installed here.
* `sglang.srt.disaggregation.mooncake`: its common base imports SGLang's kernels (tvm_ffi).
  The stand-in's manager and bootstrap server subclass SGLang's real base classes, as
  Mooncake's do: it is the deployment with Mooncake installed, where the failure was silent.

The hook fails to apply as it did when seen: importing `disaggregation.utils` raises an
ImportError while HookRegistry resolves the target (here because model_config's stand-in
comes only after `load_plugins()`, as if utils' imports were resolvable only later), which
`pkgutil.resolve_name` reports as "module 'sglang.srt.disaggregation' has no attribute
'utils'"; HookRegistry logs it and carries on.
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.plugins  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

ROOT = Path(__file__).resolve().parent.parent
SEEN_FAILURE = "AttributeError: module 'sglang.srt.disaggregation' has no attribute 'utils'"


def test_the_plugin_selects_pdkv_only_when_asked(monkeypatch):
    """SGLang's plugin hook: with PDKV_SGLANG=1 every backend but SGLang's fake one (its
    warm-up) resolves to pdkv. SGLang's enums live in a module that cannot be imported
    here: stand-ins with their values take their place (`select` reads the values only)."""
    import enum
    from importlib.metadata import entry_points

    from transfer.sglang import conn as pdkv_conn
    from transfer.sglang import plugin

    Backend = enum.Enum("TransferBackend", {"MOONCAKE": "mooncake", "FAKE": "fake"})
    Kind = enum.Enum("KVClassType", {"KVARGS": "kvargs", "MANAGER": "manager", "SENDER": "sender"})

    def original(backend, kind):
        return ("sglang's", backend, kind)

    monkeypatch.delenv("PDKV_SGLANG", raising=False)
    assert plugin.select(original, Backend.MOONCAKE, Kind.MANAGER)[0] == "sglang's"
    monkeypatch.setenv("PDKV_SGLANG", "1")
    assert plugin.select(original, Backend.MOONCAKE, Kind.MANAGER) is pdkv_conn.PdkvKVManager
    assert plugin.select(original, Backend.MOONCAKE, Kind.SENDER) is pdkv_conn.PdkvKVSender
    assert plugin.select(original, Backend.MOONCAKE, "receiver") is pdkv_conn.PdkvKVReceiver
    assert plugin.select(original, Backend.MOONCAKE, "bootstrap_server") is pdkv_conn.PdkvKVBootstrapServer
    assert plugin.select(original, Backend.FAKE, Kind.SENDER)[0] == "sglang's"  # warm-up requests stay fake
    assert plugin.select(original, Backend.MOONCAKE, Kind.KVARGS)[0] == "sglang's"  # one KVArgs for all
    installed = [ep.value for ep in entry_points(group="sglang.srt.plugins")]
    assert "transfer.sglang.plugin:register" in installed  # SGLang finds it when pdkv is installed


# ---- in the child process -------------------------------------------------------------------


def _stand_in_model_config() -> None:
    def unavailable(*args: object, **kwargs: object) -> None:
        raise NotImplementedError("model_config's stand-in (transformers is not installed here)")

    module = types.ModuleType("sglang.srt.configs.model_config")
    module.get_dsa_mtp_topk_width = module.is_deepseek_dsa = unavailable
    sys.modules[module.__name__] = module


def _stand_in_mooncake() -> None:
    from sglang.srt.disaggregation.base import conn as base

    class MooncakeKVManager(base.BaseKVManager):
        def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
            self.kv_args = args

        def register_to_bootstrap(self):
            pass

    class MooncakeKVBootstrapServer(base.BaseKVBootstrapServer):
        def __init__(self, host, port):
            self.host, self.port = host, port

    module = types.ModuleType("sglang.srt.disaggregation.mooncake")
    kinds = (MooncakeKVManager, MooncakeKVBootstrapServer)
    kinds += (type("MooncakeKVSender", (), {}), type("MooncakeKVReceiver", (), {}))
    for cls in kinds:
        cls.__module__, cls.__qualname__ = module.__name__, cls.__name__
        setattr(module, cls.__name__, cls)
    sys.modules[module.__name__] = module


def _start(hook_applies: bool, build: list[str]) -> None:
    """An SGLang process's start, up to the classes in `build`; reports what it built on stdout."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from tests.test_sglang import LAYERS, _env, _kv_args
    from transfer.sglang.plugin import TARGET

    if hook_applies:
        _stand_in_model_config()
    load_plugins()
    _stand_in_model_config()
    _stand_in_mooncake()
    from sglang.srt.disaggregation.base.conn import BaseKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    backend, built = TransferBackend("mooncake"), []
    for kind in build:
        cls = get_kv_class(backend, KVClassType(kind))
        if kind == "bootstrap_server":
            made = cls(host="127.0.0.1", port=0)  # start_disagg_service's call
        else:
            _env("", 0, 1)
            args, keep = _kv_args(range(LAYERS), fill=False)
            made = cls(args, DisaggregationMode.DECODE, None, True)  # DecodePreallocQueue._init_kv_manager's
        built.append(f"{cls.__module__}.{cls.__qualname__}")
        if hasattr(made, "close"):
            made.close()
    guarded = "__new__" in BaseKVManager.__dict__
    sys.stdout.write(json.dumps({"built": built, "applied": TARGET in HookRegistry._patched, "guarded": guarded}))


# ---- in the test process --------------------------------------------------------------------


def _run(hook_applies: bool, build: list[str], pdkv: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PDKV_SGLANG"}
    env["SGLANG_PLUGINS"] = "pdkv"  # SGLang's allow-list: no other installed plugin runs
    if pdkv:
        env["PDKV_SGLANG"] = "1"
    code = f"from tests.test_sglang_plugin import _start; _start({hook_applies!r}, {build!r})"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def _report(child: subprocess.CompletedProcess[str]) -> dict:
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_where_the_hook_applies_sglang_builds_pdkvs_classes():
    report = _report(_run(hook_applies=True, build=["bootstrap_server", "manager"], pdkv=True))
    assert report["applied"] and report["guarded"]
    assert report["built"] == [
        "transfer.sglang.conn.PdkvKVBootstrapServer",  # the guard lets pdkv's own classes through
        "transfer.sglang.conn.PdkvKVManager",
    ]


@pytest.mark.parametrize(
    "kind, sglang_class", [("manager", "MooncakeKVManager"), ("bootstrap_server", "MooncakeKVBootstrapServer")]
)
def test_a_process_where_the_hook_failed_to_apply_refuses_to_start(kind, sglang_class):
    """The scheduler's manager and the launcher's bootstrap server: each refuses, naming
    the class SGLang fell back to and the error HookRegistry only logged."""
    child = _run(hook_applies=False, build=[kind], pdkv=True)
    assert child.returncode != 0, child.stdout
    refusal = child.stderr.strip().splitlines()[-1]
    assert refusal.startswith("transfer.sglang.plugin.PdkvNotInChargeError: PDKV_SGLANG=1"), child.stderr[-4000:]
    assert f"sglang.srt.disaggregation.mooncake.{sglang_class}" in refusal
    assert f"HookRegistry failed to apply it: {SEEN_FAILURE}" in refusal


@pytest.mark.parametrize("hook_applies", [False, True])
def test_without_pdkv_sglang_nothing_changes(hook_applies):
    report = _report(_run(hook_applies=hook_applies, build=["bootstrap_server", "manager"], pdkv=False))
    assert not report["guarded"]  # SGLang's base classes are left as they are
    assert report["applied"] == hook_applies
    assert report["built"] == [
        "sglang.srt.disaggregation.mooncake.MooncakeKVBootstrapServer",
        "sglang.srt.disaggregation.mooncake.MooncakeKVManager",
    ]
