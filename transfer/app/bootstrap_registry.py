"""The registry as a process: `python -m transfer.app.bootstrap_registry --port 8998`."""

from __future__ import annotations

import argparse
import asyncio

from transfer.app.options import HelpFormatter
from transfer.app.service import add_service_flags, announce, secret_from_env, setup_process, wait_for_signal
from transfer.registry.server import RegistryServer
from transfer.timeouts import Timeouts


async def _serve(args: argparse.Namespace) -> None:
    server = RegistryServer(args.host, args.port, Timeouts(lease=args.lease), secret_from_env(args.secret_env))
    await server.start()
    announce(args.ready_file, server.url)
    try:
        await wait_for_signal()
    finally:
        await server.aclose()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description="pdkv bootstrap registry")
    ap.add_argument("--lease", type=float, default=Timeouts().lease)
    add_service_flags(ap)
    args = ap.parse_args(argv)
    setup_process(args)
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
