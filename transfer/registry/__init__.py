"""The bootstrap registry as prefill ranks and decodes see it: HTTP (built-in) or etcd.

A registry URL picks the backend: `http://HOST:PORT` is pdkv's own registry
(`transfer.registry.server`), `etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/PREFIX]` an etcd
v3 cluster (its members listed),
the store NIXL and Dynamo keep this kind of metadata in. Both keep a rank's descriptor
under a lease (a rank that dies drops out by itself) and answer a lookup only once every
CP rank of the engine is in. On etcd a decode waits for the missing ranks by watching the
engine's keys instead of polling, and etcd's own users and passwords guard the keys.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from transfer.registry.base import RegistryClient, assemble, register_until
from transfer.registry.builtin import HttpRegistry
from transfer.registry.server import RegistryServer
from transfer.timeouts import Timeouts

__all__ = ["RegistryClient", "HttpRegistry", "RegistryServer", "assemble", "register_until", "registry_client"]


def registry_client(url: str, timeouts: Timeouts, secret: str | None = None) -> RegistryClient:
    """The client for `url`'s scheme (`http`, `https` or `etcd`)."""
    scheme = urlsplit(url).scheme
    if scheme in ("http", "https"):
        return HttpRegistry(url, timeouts, secret)
    if scheme == "etcd":
        try:
            from transfer.registry.etcd import EtcdRegistry
        except ImportError as exc:
            raise ImportError(f"registry URL {url!r} needs the etcd client: pip install 'pdkv[etcd]' ({exc})") from exc
        return EtcdRegistry.from_url(url, timeouts)
    raise ValueError(f"registry URL {url!r}: the scheme must be http, https or etcd")
