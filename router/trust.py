"""Which replica addresses the router may call: those the operator trusts, never an address a
replica reported about itself alone.

A pool's ``serving_addr`` reaches the router through the cache manager (Stats, Route) and is
whatever the registering replica said; any holder of a ``replica`` token can register one. The
router sends prompts, token ids and its own replica token to the replicas it calls, so it only
calls an address that is

- given with ``--replica HOST:PORT`` (exactly that string), or
- one of the addresses a ``--replica-dns HOST:PORT`` name resolved to at the last lookup (a
  Kubernetes headless Service lists its ready pods' IPs), or
- matched by ``--replica-allow``: CIDR networks match IP-literal hosts (``10.0.0.0/8``,
  ``fd00::/8``, a bare IP is a /32 or /128), host globs match names, case-insensitively
  (``*.model.ns.svc.cluster.local``, ``localhost``). A name never matches a network (what it
  resolves to is not checked), an IP literal never matches a glob.

Without ``--replica-allow`` the allowlist is loopback only (``DEFAULT_ALLOW``). Addresses are
parsed strictly (``HOST:PORT`` or ``[IPv6]:PORT``, a DNS name of letters, digits, ``-`` and
``.``): gRPC target forms (``dns://server/name``, ``ipv4:``, ``unix:``) are never trusted, as
they could pick another resolver or a socket path.

With TLS to the replicas, gRPC checks the certificate against the host dialled. An address that
came from a ``--replica-dns`` name is an IP literal; its certificate is checked against that
name (``tls_name``), which the operator chose, never against a name a replica reported.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import re
import socket
from collections.abc import Iterable, Sequence

from common.grpc_server import format_address

DEFAULT_ALLOW: tuple[str, ...] = ("127.0.0.0/8", "::1", "localhost")

# A DNS name: labels of letters, digits and '-', joined by single dots (no scheme, path, port).
_NAME = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*$")
# A host glob: the same characters plus the wildcards '*' and '?'.
_GLOB = re.compile(r"^[A-Za-z0-9*?-]+(\.[A-Za-z0-9*?-]+)*$")

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def split_addr(addr: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` / ``[IPv6]:PORT``; None when it is anything else. An IP
    host is returned in its canonical form, a name lower-cased."""
    host, sep, port_text = addr.rpartition(":")
    if not sep or not port_text.isdigit() or not port_text.isascii():
        return None
    port = int(port_text)
    if not 0 < port < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), port
        except ValueError:
            return None
    try:
        return str(ipaddress.IPv4Address(host)), port
    except ValueError:
        pass
    if not _NAME.match(host):
        return None
    try:  # legacy IPv4 spellings ("127.1", "0x7f000001") are not names, nor trusted as IPs
        socket.inet_aton(host)
    except OSError:
        return host.lower(), port
    return None


def _ip(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def parse_allow(entries: Iterable[str]) -> tuple[list[IpNetwork], list[str]]:
    """--replica-allow items -> (networks, host globs). Raises ValueError naming a bad item."""
    networks: list[IpNetwork] = []
    globs: list[str] = []
    for entry in entries:
        item = entry.strip()
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
            continue
        except ValueError:
            pass
        if "/" in item or not _GLOB.match(item) or ".." in item:
            raise ValueError(f"{entry!r} is neither a network (CIDR) nor a host name pattern")
        globs.append(item.lower())
    return networks, globs


def parse_dns(entry: str) -> tuple[str, int]:
    """A --replica-dns item: (name, port). Raises ValueError when it is not NAME:PORT."""
    parsed = split_addr(entry.strip())
    if parsed is None or _ip(parsed[0]) is not None:
        raise ValueError(f"{entry!r} is not a DNS name and port (HOST:PORT)")
    return parsed


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as HOST:PORT strings (raises OSError when it does not)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            seen[format_address(str(sockaddr[0]).partition("%")[0], port)] = None
    return list(seen)


class ReplicaTrust:
    """The operator's trust: static addresses, DNS names (their last resolved addresses), and an
    allowlist of networks and host globs (see the module docstring)."""

    def __init__(self, static: Iterable[str] = (), allow: Sequence[str] | None = None,
                 dns: Iterable[str] = ()) -> None:
        self.static = frozenset(static)
        self.allow = tuple(allow) if allow is not None else DEFAULT_ALLOW
        self.networks, self.globs = parse_allow(self.allow)
        self.dns_names: list[tuple[str, int]] = [parse_dns(entry) for entry in dns]
        # (name, port) -> the addresses it resolved to last; address -> its (first) name.
        self._resolved: dict[tuple[str, int], frozenset[str]] = {}
        self._name_of: dict[str, str] = {}

    def trusted(self, addr: str) -> bool:
        """Whether the router may call `addr` (and send it requests and its token)."""
        if addr in self.static or addr in self._name_of:
            return True
        parsed = split_addr(addr)
        if parsed is None:
            return False
        host = parsed[0]
        ip = _ip(host)
        if ip is not None:
            return any(ip in network for network in self.networks)
        return any(fnmatch.fnmatchcase(host, glob) for glob in self.globs)

    def set_resolved(self, name: str, port: int, addrs: Iterable[str]) -> None:
        """The addresses `name`:`port` resolves to now (replacing the previous lookup's)."""
        self._resolved[(name, port)] = frozenset(addrs)
        name_of: dict[str, str] = {}
        for (host, _), resolved in self._resolved.items():  # one address may be behind two names
            for addr in resolved:
                name_of.setdefault(addr, host)
        self._name_of = name_of

    def resolved(self) -> frozenset[str]:
        """Every address the DNS names resolved to at their last lookup."""
        return frozenset(self._name_of)

    def tls_name(self, addr: str) -> str | None:
        """The name to check `addr`'s TLS certificate against when it is not the host dialled:
        the --replica-dns name it came from (None: the address's own host)."""
        return self._name_of.get(addr)
