"""Raw-socket HTTP probes for tests of what services refuse (bodies, slow clients)."""

from __future__ import annotations

import asyncio
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
