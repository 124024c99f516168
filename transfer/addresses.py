"""Addresses a service binds and advertises, kept apart (STYLE 22).

A service that other hosts reach binds one address (where it listens: one of this host's
addresses, or the wildcard) and advertises another (what it registers, for peers to
connect to). The advertised address must be one those peers can route to: never loopback
or the wildcard in a registry that other hosts read. A registry on loopback is read only
from this host, so a purely local deployment may advertise loopback.

IPv6 addresses travel bare here (``::1``, ``fd00::2``) and are bracketed in URLs.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlsplit

from pdkv.errors import PdkvError

logger = logging.getLogger(__name__)


class AddressError(PdkvError, ValueError):
    """An address a service would advertise or bind that its peers could not use."""


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None


def url_host(host: str) -> str:
    """`host` as a URL's authority takes it: an IPv6 address in brackets."""
    ip = _ip(host)
    return f"[{host.strip('[]')}]" if ip is not None and ip.version == 6 else host


def http_url(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{port}"


def is_wildcard(host: str) -> bool:
    ip = _ip(host)
    return ip is not None and ip.is_unspecified


def is_local_only(host: str) -> bool:
    """Loopback (127/8, ::1, `localhost`) or the wildcard: no other host can connect to it."""
    if host.strip("[]").lower() == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and (ip.is_loopback or ip.is_unspecified)


def _hosts(url: str) -> list[str]:
    """The hosts a URL names (`etcd://a:2379,b:2379/p` names two), bare."""
    netloc = urlsplit(url if "://" in url else f"//{url}").netloc.rpartition("@")[2]
    hosts = []
    for member in filter(None, netloc.split(",")):
        if member.startswith("["):
            hosts.append(member[1 : member.find("]")])
        else:
            hosts.append(member.rsplit(":", 1)[0] if member.count(":") == 1 else member)
    return hosts


def _resolves_local(host: str) -> bool:
    if _ip(host) is not None or host.lower() == "localhost":
        return is_local_only(host)
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(is_local_only(str(info[4][0])) for info in infos)


def registry_is_local(registry_url: str) -> bool:
    """Whether the registry at `registry_url` is on loopback (every member, for etcd), so read
    from this host only. A name is resolved; one that does not resolve counts as remote."""
    hosts = _hosts(registry_url)
    return bool(hosts) and all(_resolves_local(h) for h in hosts)


def route_source(peer: str) -> str | None:
    """The address of this host that the kernel would send from to reach `peer` (a URL or a
    host; no packet leaves: a UDP socket is only connected); None if there is no route."""
    hosts = _hosts(peer)
    host = hosts[0] if hosts else ""
    if not host:
        return None
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def is_own_address(host: str) -> bool:
    """Whether this host can listen on `host` (one of its addresses, or the wildcard)."""
    ip = _ip(host)
    if ip is None:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), 0))
        return True
    except OSError:
        return False


def advertised_for(bind: str, advertise: str | None, registry_url: str) -> str:
    """What a service bound at `bind` advertises in the registry at `registry_url`.

    `advertise` if given, else `bind`; a wildcard bind advertises the address that routes to
    the registry (loopback for a registry on loopback). Loopback or the wildcard in a registry
    that other hosts read is refused with `AddressError`."""
    chosen = advertise or bind
    local = registry_is_local(registry_url)
    if is_wildcard(chosen) and not advertise:
        wildcard_v6 = _ip(chosen) is not None and _ip(chosen).version == 6  # type: ignore[union-attr]
        chosen = ("::1" if wildcard_v6 else "127.0.0.1") if local else (route_source(registry_url) or chosen)
    if is_local_only(chosen) and not local:
        raise AddressError(
            f"would advertise {chosen} to the registry at {registry_url}, which other hosts read: "
            "they cannot connect to it. Give the address they reach this host at "
            "(PrefillExporter(advertise=...), PDKV_SGLANG_HOST or SGLANG_HOST_IP under SGLang)"
        )
    return chosen.strip("[]")


def bind_for(advertise: str) -> str:
    """Where to listen for a service advertised at `advertise`: there if it is one of this
    host's addresses, else (an address that NAT or a proxy forwards here) the wildcard of
    its family."""
    if is_own_address(advertise):
        return advertise
    ip = _ip(advertise)
    wildcard = "::" if ip is not None and ip.version == 6 else "0.0.0.0"
    logger.info("%s is not an address of this host: listening on %s", advertise, wildcard)
    return wildcard
