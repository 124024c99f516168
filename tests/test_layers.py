"""The layering the project promises: pdkv never imports transfer, and the transfer library
never imports its application (`transfer.app`). Checked in a fresh interpreter."""

import pkgutil
import subprocess
import sys

import pdkv
import transfer

_CHECK = """
import importlib, sys
for module in {modules!r}:
    importlib.import_module(module)
print(",".join(sorted(m for m in sys.modules if m == {forbidden!r} or m.startswith({forbidden!r} + "."))))
"""


def _modules(package) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def _imported(modules: list[str], forbidden: str) -> str:
    code = _CHECK.format(modules=modules, forbidden=forbidden)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_pdkv_never_imports_transfer():
    assert _imported(_modules(pdkv), "transfer") == ""


def _have_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def test_the_library_never_imports_its_application():
    library = [m for m in _modules(transfer) if not m.startswith("transfer.app")]
    if not _have_sglang():  # the SGLang adapter imports sglang (an optional extra)
        library = [m for m in library if not m.startswith("transfer.sglang")]
    assert "transfer.decode" in library and _imported(library, "transfer.app") == ""


def test_the_lanes_know_nothing_of_the_protocols_that_use_them():
    """Lanes move bytes; the decode's protocols and the prefill sit above them, never below."""
    lanes = [m for m in _modules(transfer) if m.startswith("transfer.lanes")]
    assert "transfer.lanes.base" in lanes
    assert _imported(lanes, "transfer.decode") == ""
    assert _imported(lanes, "transfer.prefill") == ""


def test_transfers_public_names_resolve_and_load_only_when_used():
    code = (
        "import sys, transfer; assert 'nixl' not in sys.modules and 'transfer.prefill' not in sys.modules; "
        "[getattr(transfer, n) for n in transfer.__all__]; print(len(transfer.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) >= 10
