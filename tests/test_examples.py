"""The examples run as a user runs them: their own process, from the checkout's root."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs_and_checks_every_byte():
    proc = subprocess.run(
        [sys.executable, "examples/quickstart.py"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "room 1 by ticket: 15120 bytes, 0 control messages"  # a ticket asks nobody
    assert lines[1].startswith("room 2 by claims: 15120 bytes, ") and not lines[1].endswith(" 0 control messages")
    assert lines[2] == "ok: 25200 bytes of 2 rooms checked, each as the prefill wrote it"


def _quoted_in(block: list[str], source: list[str]) -> bool:
    """`block` appears in `source` as consecutive lines, indented alike."""
    for i, line in enumerate(source):
        indent = line[: len(line) - len(line.lstrip())]
        if line == indent + block[0] and [s.rstrip() for s in source[i : i + len(block)]] == [
            (indent + b).rstrip() for b in block
        ]:
            return True
    return False


def test_the_readme_quotes_the_quickstart_as_it_is():
    """The library section's code (but its last block, the sync face) is the example's own."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The library\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("\n```", 1)[0].splitlines() for b in section.split("```python\n")[1:]]
    source = (ROOT / "examples" / "quickstart.py").read_text().splitlines()
    assert len(blocks) >= 4 and "examples/quickstart.py" in section
    for block in blocks[:-1]:
        assert _quoted_in(block, source), "\n".join(block)
