"""Raw-socket HTTP probes for tests of what services refuse (bodies, slow clients)."""

from __future__ import annotations

import asyncio
import resource
from urllib.parse import urlsplit

MiB = 1 << 20


async def _status(reader: asyncio.StreamReader, wait: float) -> int | None:
    try:
        line = await asyncio.wait_for(reader.readline(), wait)
    except (asyncio.TimeoutError, ConnectionError):
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def send_big(
    url: str, path: str, size: int, chunked: bool = False, wait: float = 10.0, method: str = "POST"
) -> int | None:
    """Send a body of `size` bytes (announced by Content-Length, or chunked), stopping as soon
    as the server answers or closes; the status it answered, or None if it only closed."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-msgpack\r\n{framing}\r\n\r\n".encode()
    )
    answer = asyncio.create_task(_status(reader, wait))
    chunk = b"\0" * MiB
    try:
        sent = 0
        while sent < size and not answer.done():
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk)
            await asyncio.wait_for(writer.drain(), wait)
            sent += len(chunk)
    except (ConnectionError, asyncio.TimeoutError):
        pass
    status = await answer
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass
    return status


async def closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    """True if the server closes the connection within `within` seconds."""
    try:
        return await asyncio.wait_for(reader.read(1 << 16), within) == b""
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        return True


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def raise_open_files_limit(want: int) -> int:
    """Raise this process's soft open-files limit towards `want` (up to the hard limit); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def hold_idle_connections(host: str, port: int, count: int) -> None:
    """Keep `count` connections open to host:port, sending nothing, each reopened as soon as the
    server closes it. Prints "ready" once every one of them has completed its handshake, then
    "opened N" each second (N: connections opened so far); runs until killed."""
    raise_open_files_limit(count + 256)
    opened = 0
    first = asyncio.Event()
    connected = 0

    async def hold() -> None:
        nonlocal opened, connected
        seen = False
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(0.01)  # out of ports or files for a moment: try again
                continue
            opened += 1
            if not seen:
                seen, connected = True, connected + 1
                if connected == count:
                    first.set()
            try:
                await reader.read(1)  # b"" once the server closes it
            except OSError:
                pass
            writer.close()

    holders = [asyncio.create_task(hold()) for _ in range(count)]
    await first.wait()
    print("ready", flush=True)
    while not any(h.done() for h in holders):
        await asyncio.sleep(1.0)
        print(f"opened {opened}", flush=True)


if __name__ == "__main__":  # python -m tests.http_probe HOST PORT COUNT: a client that hoards idle sockets
    import sys

    asyncio.run(hold_idle_connections(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
