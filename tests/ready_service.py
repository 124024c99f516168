"""A stand-in service for the launcher's readiness tests: it writes its ready file at once,
but answers `GET /ready` with 503 until the file named by PDKV_TEST_READY_FLAG exists.

python -m tests.ready_service --ready-file PATH [--die-with-parent]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

from aiohttp import web


async def _serve(ready_file: Path, flag: Path) -> None:
    async def ready(request: web.Request) -> web.Response:
        if flag.exists():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready", "why": "the flag is not set"}, status=503)

    app = web.Application()
    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    tmp = ready_file.with_suffix(".tmp")  # atomically, as a service announces itself
    tmp.write_text(f"http://127.0.0.1:{port}")
    tmp.replace(ready_file)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ready-file", type=Path, required=True)
    ap.add_argument("--die-with-parent", action="store_true")
    args = ap.parse_args()
    asyncio.run(_serve(args.ready_file, Path(os.environ["PDKV_TEST_READY_FLAG"])))


if __name__ == "__main__":
    main()
