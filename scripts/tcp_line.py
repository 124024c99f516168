"""Plain TCP between stand-in hosts: what the link carries, to measure a READ over UCX's TCP against.

`receive` listens, takes `--streams` connections, reads them to their end and prints one JSON
line (bytes, seconds from the first byte to the last, GB/s); `send` opens as many
connections and writes 4 MiB buffers on each for `--seconds`. Both sockets ask for 4 MiB
buffers. `scripts/bench_hosts.py` runs the receiver on the decode host and the sender on the
prefill host, the direction a READ's bytes take.

    python scripts/tcp_line.py receive --port 5201 --streams 4
    python scripts/tcp_line.py send --host 198.18.0.2 --port 5201 --streams 4 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

BUFFER = 4 << 20


def receive(port: int, streams: int, timeout: float) -> dict[str, float]:
    """Bytes and GB/s over `streams` connections, from the first byte to the last."""
    with socket.create_server(("", port)) as server:
        server.settimeout(timeout)
        print(json.dumps({"listening": port}), flush=True)
        conns = [server.accept()[0] for _ in range(streams)]
    totals, firsts, lasts = [0] * streams, [0.0] * streams, [0.0] * streams

    def drain(i: int, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
        conn.settimeout(timeout)
        view = memoryview(bytearray(BUFFER))
        with conn:
            while n := conn.recv_into(view):
                if not totals[i]:
                    firsts[i] = time.perf_counter()
                totals[i] += n
        lasts[i] = time.perf_counter()

    threads = [threading.Thread(target=drain, args=(i, c)) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = max(lasts) - min(f for f in firsts if f)
    return {"bytes": sum(totals), "seconds": seconds, "gbps": sum(totals) / seconds / 1e9}


def send(host: str, port: int, streams: int, seconds: float) -> None:
    """Write to `streams` connections for `seconds`, then close them."""
    payload = memoryview(bytes(BUFFER))
    end = time.perf_counter() + seconds
    conns = []
    for _ in range(streams):
        conn = socket.create_connection((host, port), timeout=30)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        conns.append(conn)

    def fill(conn: socket.socket) -> None:
        with conn:
            while time.perf_counter() < end:
                conn.sendall(payload)

    threads = [threading.Thread(target=fill, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("receive", "send"))
    ap.add_argument("--host", default="127.0.0.1", help="send: the receiver's address")
    ap.add_argument("--port", type=int, default=5201)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0, help="send: how long to write")
    ap.add_argument("--timeout", type=float, default=60.0, help="receive: the longest wait for a connection or a byte")
    args = ap.parse_args()
    if args.mode == "receive":
        print(json.dumps(receive(args.port, args.streams, args.timeout)), flush=True)
    else:
        send(args.host, args.port, args.streams, args.seconds)
    sys.exit(0)


if __name__ == "__main__":
    main()
