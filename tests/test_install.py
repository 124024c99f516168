"""The documented install (docs/sglang.md, "Installing"): `pip install /path/to/pdkv` into an
existing SGLang environment, run as written in a fresh venv, gives a process in which pdkv's
plugin is found and in charge, with the environment's torch untouched.

The SGLang environment is CI's own (scripts/setup_env.sh sglang: torch's CPU build, sglang
0.5.23 and the light packages its imports need, installed --no-deps): its distributions are
hard-linked into the fresh venv as an installed environment, rather than installed again,
which took 3.5 minutes here and tests torch's install, not pdkv's. pip then sees them as
installed, as in a real SGLang environment, and resolves pdkv's own requirements against them
from the configured package index (pdkv's, NIXL, msgspec, aiohttp and the rest). Hard links,
not symbolic ones: an uninstall in the fresh venv removes its own names, never this venv's files.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sysconfig
import venv
from importlib import metadata
from pathlib import Path

import pytest

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(sysconfig.get_paths()["purelib"])


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _sglang_environment() -> list[metadata.Distribution]:
    """CI's SGLang environment: torch, what scripts/sglang-cpu.txt lists, and those of SGLang's
    declared requirements that are installed here, each with the installed ones of its own (a
    real SGLang environment has them all; here some are missing, as the --no-deps install left them)."""
    wanted = ["torch", "sglang"] + [_name(line) for line in (ROOT / "scripts/sglang-cpu.txt").read_text().splitlines()]
    seen: dict[str, metadata.Distribution] = {}
    while wanted:
        name = wanted.pop()
        if not name or name.startswith("#") or name in seen or name == "pdkv":
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        wanted += [_name(r) for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


def _link(dist: metadata.Distribution, site: Path) -> None:
    for file in dist.files or []:
        source = Path(str(dist.locate_file(file))).resolve()
        if not source.is_relative_to(SITE) or not source.is_file():
            continue  # scripts in bin/ and the like: not needed to import it
        target = site / source.relative_to(SITE)
        _link_file(source, target)
        if source.suffix == ".py":  # with its bytecode, where written here since: not compiled again
            cached = Path(importlib.util.cache_from_source(str(source)))
            if cached.is_file():
                _link_file(cached, Path(importlib.util.cache_from_source(str(target))))


def _link_file(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except FileExistsError:
        pass
    except OSError:  # another file system: a copy
        shutil.copy2(source, target)


@pytest.fixture(scope="module")
def sglang_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding CI's SGLang environment, as installed packages."""
    root = tmp_path_factory.mktemp("sglang-env")
    venv.EnvBuilder(with_pip=True).create(root)
    site = Path(
        subprocess.run(
            [root / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for dist in _sglang_environment():
        _link(dist, site)
    return root


def _run(env: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        args,
        cwd=cwd,
        env={**clean, "PATH": f"{env / 'bin'}:{clean['PATH']}"},
        capture_output=True,
        text=True,
        timeout=540,
    )


# What a process of that environment sees: SGLang's own plugin loader run with pdkv asked for.
PROBE = """
import json, os, sys
os.environ["PDKV_SGLANG"] = "1"
from importlib.metadata import distribution, entry_points
import torch
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.disaggregation.base.conn import BaseKVManager
load_plugins()
import pdkv, transfer.sglang.plugin as plugin
plugin.check_runtime()
class Other(BaseKVManager):
    def __init__(self, *a): pass
try:
    Other()
    refused = None
except plugin.PdkvNotInChargeError as exc:
    refused = type(exc).__name__
meta = distribution("pdkv").metadata
print(json.dumps({
    "torch": torch.__version__,
    "pdkv_from": pdkv.__file__,
    "plugins": [ep.value for ep in entry_points(group="sglang.srt.plugins")],
    "hooked": any(h is plugin.select for _, h, _ in HookRegistry._hooks.get(plugin.TARGET, [])),
    "refused": refused,
    "license": meta["License-Expression"],
    "license_files": meta.get_all("License-File"),
    "requires_python": meta["Requires-Python"],
    "extras": meta.get_all("Provides-Extra"),
    "classifiers": len(meta.get_all("Classifier") or []),
}))
"""


def test_documented_install_into_an_sglang_environment(sglang_env, tmp_path):
    # The checkout as a clone has it: an in-tree build leaves build/ behind, whose stale files
    # would reach the next wheel.
    checkout = tmp_path / "pdkv"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__"))
    installed = _run(sglang_env, "pip", "install", "-q", str(checkout), cwd=tmp_path)  # docs/sglang.md, as written
    assert installed.returncode == 0, installed.stdout + installed.stderr
    probe = _run(sglang_env, "python", "-c", PROBE, cwd=tmp_path)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["torch"] == metadata.version("torch")  # the environment's torch, not replaced
    assert Path(seen["pdkv_from"]).is_relative_to(sglang_env)  # the installed copy, not the checkout
    assert "transfer.sglang.plugin:register" in seen["plugins"]
    assert seen["hooked"] and seen["refused"] == "PdkvNotInChargeError"
    assert seen["license"] == "Apache-2.0" and seen["license_files"] == ["LICENSE"]
    assert seen["requires_python"] == ">=3.10" and {"sglang", "cu12", "cu13"} <= set(seen["extras"])
    assert seen["classifiers"] > 0
