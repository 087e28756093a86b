"""What one tenant's fields may reach on a shared engine: files, addresses, checkpoints.

Tenants share an engine pod, so every path or URL a spec names is checked here before the
engine opens it (docs/design/tenancy.md, "Tenancy and trust"):

- **data**: ``task.dataset`` resolves (symlinks followed) inside ``<data root>/<namespace>/``
  of one of the pool's data roots; anything else is "not allowed", worded the same whether
  the path exists or not, so the answer is no oracle for the pod's files. The file is then
  opened beneath that directory without following links (tenancy/data_files.py); an
  object-storage URL lies under the namespace's prefix (tenancy/object_store.py);
- **egress**: ``rewardUrl``'s host resolves to no loopback, link-local (cloud metadata
  included), unspecified or multicast address and none of the pod's own, however spelled
  (an IPv6 form with an IPv4 address inside is judged by that address too), unless the
  pool lists the host and port; the engine's own port on a local address is never a
  reward target;
- **checkpoints**: ``resumeFrom`` lies inside ``<checkpoint root>/<namespace>/<name>/``;
- **plug-ins**: ``task.reward`` and ``task.environment.name`` name a plug-in the pool
  grants the namespace (tenancy/plugin_access.py).

Everything here is pure but for name resolution, which is injected (tests pass a table).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from loraplex_engine.spec.errors import TaskError, UsageError
from loraplex_engine.tenancy.object_store import ObjectStore
from loraplex_engine.tenancy.plugin_access import PluginAccess

DATASET_FIELD = "spec.task.dataset"
REWARD_URL_FIELD = "spec.task.rewardUrl"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]  # (host, port) -> addresses

# Metadata services outside the link-local ranges (Alibaba Cloud, AWS over IPv6).
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("100.100.100.200", "fd00:ec2::254")
)
# 0.0.0.0/8: on Linux a connect to 0.x.x.x reaches the host itself.
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
# IPv6 forms that carry an IPv4 address in their last 32 bits: IPv4-compatible (::/96,
# deprecated but still routed by some stacks) and NAT64's well-known prefix (RFC 6052),
# which a NAT64 gateway turns back into that IPv4 address. ::ffff:0:0/96 (mapped), 6to4
# (2002::/16) and Teredo (2001::/32) have their own ipaddress properties.
LOW_32_EMBEDDING = (ipaddress.ip_network("::/96"), ipaddress.ip_network("64:ff9b::/96"))

log = logging.getLogger(__name__)


def _resolve_quietly(path: Path) -> Path | None:
    try:
        return path.resolve(strict=False)
    except (OSError, RuntimeError):  # a symlink loop, say: treated as outside every root
        return None


@dataclass(frozen=True)
class DataRoots:
    """The directories ``task.dataset`` may name files in.

    ``per_namespace`` (the engine service): a namespace's files live in
    ``<root>/<namespace>/``; a relative dataset is taken from there. Off (the local runner,
    one user): files anywhere under a root, a relative dataset is taken from the first.
    ``allow_hard_links``: a dataset file may have several hard links (tenancy/data_files.py;
    off by default: a hard link can name another tenant's file here)."""

    roots: tuple[Path, ...] = ()
    per_namespace: bool = True
    flag_hint: str = "serve --data-root DIR"
    allow_hard_links: bool = False

    def resolve(self, dataset: str, namespace: str) -> tuple[Path, Path]:
        """``(file, its allowed directory)`` for ``dataset`` of ``namespace``; otherwise a
        TaskError naming spec.task.dataset that says nothing about the file itself."""
        if not self.roots:
            raise TaskError(
                DATASET_FIELD,
                "jsonl datasets are not allowed on this engine: it has no data root "
                f"(the pool admin sets one: {self.flag_hint})",
            )
        wanted = Path(dataset)
        bases = self._bases(namespace)
        for base in bases:
            candidate = _resolve_quietly(wanted if wanted.is_absolute() else base / wanted)
            if candidate is not None and candidate.is_relative_to(base) and candidate != base:
                return candidate, base
        # Name the directories: the user's way out is a path under one (or, locally, a flag).
        named = ", ".join(f"{b}/" for b in bases)
        if self.per_namespace:
            where = f"<data root>/<namespace>/ ({named})"
        else:
            where = f"a data root ({named}; add one with {self.flag_hint})"
        raise TaskError(
            DATASET_FIELD, f"dataset {dataset!r} is not allowed: it must lie under {where}"
        )

    def _bases(self, namespace: str) -> list[Path]:
        bases = []
        for root in self.roots:
            base = _resolve_quietly(root / namespace if self.per_namespace else root)
            if base is not None:
                bases.append(base)
        return bases

    @staticmethod
    def inside(path: Path, base: Path) -> bool:
        """Whether ``path`` still resolves inside ``base`` (re-checked on every read: a
        file replaced by a symlink after admission must not lead out)."""
        resolved = _resolve_quietly(path)
        return resolved is not None and resolved.is_relative_to(base) and resolved != base


def embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 ``address`` stands for (mapped, compatible, NAT64, 6to4,
    Teredo): a packet to it can end up at them, so each is judged as well."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    found = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
    if any(address in net for net in LOW_32_EMBEDDING):
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return [a for a in found if a is not None]


def forbidden_reason(address: IPAddress, own: Iterable[IPAddress] = ()) -> str | None:
    """Why a reward may not be sent to ``address`` (None: it may): the address itself
    first (::1 is loopback, not IPv4-compatible 0.0.0.1), then any IPv4 inside it."""
    own = set(own)
    for spelling in (address, *embedded_ipv4(address)):
        reason = _own_reason(spelling, own)
        if reason is not None:
            return reason
    return None


def _own_reason(address: IPAddress, own: set[IPAddress]) -> str | None:
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local or address in METADATA_ADDRESSES:
        return "a link-local or metadata address"
    if address.is_unspecified or (
        isinstance(address, ipaddress.IPv4Address) and address in THIS_NETWORK
    ):
        return "an unspecified address"
    if address.is_multicast:
        return "a multicast address"
    if address in own:
        return "one of this engine's own addresses"
    return None


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class RewardTarget:
    """A checked reward URL: where to connect (``pinned_url``, by address, so a second DNS
    answer cannot differ from the checked one) and the names the server expects."""

    url: str
    pinned_url: str
    host_header: str
    sni_hostname: str


def _normal_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host


AllowedHost = tuple[str, int | None]  # (normal host, port; None: every port)


def parse_allowed_host(entry: str) -> AllowedHost:
    """``--allow-reward-host`` entry: ``HOST:PORT``, ``[IPV6]:PORT``, or the older bare
    ``HOST`` / ``IPV6`` (every port of it; kept for existing pools). UsageError if bad."""
    text = entry.strip()
    port_text: str | None = None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or rest[:1] not in ("", ":"):
            raise UsageError(f"--allow-reward-host {entry!r}: use HOST:PORT or [IPV6]:PORT")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:  # two or more: a bare IPv6 address
        host, port_text = text.split(":")
    else:
        host = text
    port = None
    if port_text is not None:
        if not (port_text.isascii() and port_text.isdigit() and 0 < int(port_text) < 65536):
            raise UsageError(f"--allow-reward-host {entry!r}: the port must be 1-65535")
        port = int(port_text)
    if not host.strip():
        raise UsageError(f"--allow-reward-host {entry!r}: no host")
    return _normal_host(host), port


@dataclass(frozen=True)
class RewardEgress:
    """Where an HTTP reward may be sent from this engine.

    ``allowed_hosts``: names or addresses, each with the one port allowed (None: every
    port), the pool admin allows whatever they resolve to (a loopback test server, say).
    ``own_addresses`` and ``own_port``: the engine's own; its port on a local address is
    refused even for an allowed host."""

    allowed_hosts: frozenset[AllowedHost] = frozenset()
    own_addresses: frozenset[IPAddress] = frozenset()
    own_port: int | None = None
    resolver: Resolver = field(default=system_resolver, compare=False)

    @classmethod
    def build(
        cls,
        allowed_hosts: Iterable[str] = (),
        own_addresses: Iterable[str] = (),
        own_port: int | None = None,
        resolver: Resolver = system_resolver,
    ) -> RewardEgress:
        allowed = frozenset(parse_allowed_host(h) for h in allowed_hosts if h.strip())
        for host, port in sorted(allowed, key=str):
            if port is None:  # the old form: an allowed loopback host opened every local port
                log.warning("--allow-reward-host %s allows every port; give %s:PORT", host, host)
        return cls(
            allowed,
            frozenset(ipaddress.ip_address(a.split("%")[0]) for a in own_addresses),
            own_port,
            resolver,
        )

    def check(self, url: str, *, resolve_required: bool = True) -> RewardTarget | None:
        """The target ``url`` may be sent to; TaskError (spec.task.rewardUrl) if not.

        ``resolve_required=False`` (admission): a host that does not resolve yet is let
        through (None), as there is nothing to reach; every request checks again."""
        parts = urlsplit(url)
        host = parts.hostname
        if parts.scheme not in ("http", "https") or not host:
            raise TaskError(REWARD_URL_FIELD, "must be an http:// or https:// URL with a host")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise TaskError(REWARD_URL_FIELD, "has an invalid port") from None
        try:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in self.resolver(host, port)]
        except (OSError, UnicodeError, ValueError):
            addresses = []
        if not addresses:
            if resolve_required:
                raise TaskError(REWARD_URL_FIELD, f"reward host {host!r} does not resolve")
            return None
        normal = _normal_host(host)
        listed = (normal, port) in self.allowed_hosts or (normal, None) in self.allowed_hosts
        for address in addresses:
            self._check_address(host, port, address, listed)
        return self._target(url, parts.netloc, host, port, addresses[0])

    def _check_address(self, host: str, port: int, address: IPAddress, listed: bool) -> None:
        local = forbidden_reason(address, self.own_addresses) is not None
        if local and port == self.own_port:
            raise TaskError(REWARD_URL_FIELD, f"reward host {host!r}: the engine's own port")
        reason = None if listed else forbidden_reason(address, self.own_addresses)
        if reason is not None:
            raise TaskError(
                REWARD_URL_FIELD,
                f"reward host {host!r} is not allowed: it resolves to {reason} "
                "(the pool admin may allow it: serve --allow-reward-host HOST:PORT)",
            )

    @staticmethod
    def _target(url: str, netloc: str, host: str, port: int, address: IPAddress) -> RewardTarget:
        parts = urlsplit(url)
        literal = f"[{address}]" if address.version == 6 else str(address)
        pinned = parts._replace(netloc=f"{literal}:{port}").geturl()
        host_header = netloc.rpartition("@")[2]  # userinfo never goes into Host
        return RewardTarget(url, pinned, host_header, host)


def checkpoint_inside(requested: str | Path, own_dir: Path) -> Path | None:
    """``requested`` resolved, if it lies inside ``own_dir`` (an experiment's checkpoint
    directory, ``<root>/<namespace>/<name>``), else None."""
    base = _resolve_quietly(own_dir)
    path = _resolve_quietly(Path(requested))
    if base is None or path is None or not path.is_relative_to(base) or path == base:
        return None
    return path


@dataclass(frozen=True)
class TrustPolicy:
    """What the pool admin allows tenants' specs to reach. The default allows no dataset
    file or object and sends rewards only to non-local addresses."""

    data: DataRoots = DataRoots()
    egress: RewardEgress | None = RewardEgress()  # None: unrestricted (local runner)
    objects: ObjectStore = field(default_factory=ObjectStore)  # none: objects refused
    # No allowlist: every namespace may name every installed plug-in.
    plugins: PluginAccess = field(default_factory=PluginAccess)

    @classmethod
    def local(cls, data_roots: Iterable[Path]) -> TrustPolicy:
        """The local runner's: one user, datasets under the given directories, any
        reward URL."""
        roots = DataRoots(tuple(data_roots), per_namespace=False, flag_hint="run --data-root DIR")
        return cls(data=roots, egress=None)
