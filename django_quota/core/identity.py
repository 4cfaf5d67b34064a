"""Subjects to identities: client IP normalisation, length-prefixed framing and the HMAC
pseudonym that is the only form of an identity that reaches Redis, logs or metrics
(``docs/subjects.md``)."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import ipaddress
import struct
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from django_quota.core.errors import QuotaError
from django_quota.core.outcome import SELECTOR_IDENTITY_INVALID, SELECTOR_IDENTITY_MISSING
from django_quota.core.policy import IPNetwork, Selector


class Bounds:
    """The longest values an identity takes (longer ones are invalid), and how many
    normalised client entries are remembered (:func:`_normalized_entry`)."""

    MAX_API_KEY_BYTES: Final = 256
    MAX_VALUE_BYTES: Final = 1024
    MAX_FORWARDED_FOR_BYTES: Final = 4096
    MAX_NORMALIZED: Final = 4096


class InvalidValue:
    """The type of :data:`INVALID_VALUE`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "INVALID_VALUE"


#: A subject value an edge could not read (bytes that are not UTF-8, an object a resolver
#: returned): always ``selector_identity_invalid``, whatever the dimension.
INVALID_VALUE = InvalidValue()


class IdentityError(QuotaError):
    """A subject lacks a dimension the selector needs, or has an invalid one.

    ``reason`` is ``selector_identity_missing`` or ``selector_identity_invalid``;
    ``dimension`` names the dimension (never its value).
    """

    def __init__(self, reason: str, dimension: str) -> None:
        super().__init__(f"{reason}: {dimension}")
        self.reason = reason
        self.dimension = dimension


@dataclass(frozen=True, slots=True)
class Identity:
    """A subject's identity for one selector.

    ``pseudonym`` is ``v<version>.`` + base64url of 16 HMAC-SHA256 bytes over the framed
    non-route components (``None`` for a route-only selector); ``route`` stays readable;
    ``hash_tag`` is what goes between ``{}`` in Redis keys; ``dimensions`` lists the
    concrete dimensions used (``auto`` resolved).
    """

    dimensions: tuple[str, ...]
    pseudonym: str | None
    route: str | None
    hash_tag: str

    @property
    def label(self) -> str:
        """A printable, non-reversible description: ``route=<r> id=<pseudonym>``."""
        parts = []
        if self.route is not None:
            parts.append(f"route={self.route}")
        if self.pseudonym is not None:
            parts.append(f"id={self.pseudonym}")
        return " ".join(parts)


def derive_hmac_key(hmac_key: str | bytes | None, secret_key: str | bytes) -> bytes:
    """The HMAC key: ``hmac_key``, else HMAC-SHA256(SECRET_KEY, b"django_quota.identity.v1")."""
    if hmac_key is not None:
        return hmac_key.encode() if isinstance(hmac_key, str) else bytes(hmac_key)
    secret = secret_key.encode() if isinstance(secret_key, str) else bytes(secret_key)
    return hmac.new(secret, b"django_quota.identity.v1", hashlib.sha256).digest()


def frame(components: Iterable[tuple[str, str]]) -> bytes:
    """Frame (dimension, value) pairs as big-endian u32 length + UTF-8 bytes, each in turn.

    The dimension name is framed with the value, so user ``42`` and API key ``42`` differ,
    and length prefixes keep ``("ab", "c")`` apart from ``("a", "bc")``.
    """
    out = bytearray()
    for name, value in components:
        for part in (name.encode(), value.encode("utf-8", "surrogatepass")):
            out += struct.pack(">I", len(part))
            out += part
    return bytes(out)


def pseudonymise(framed: bytes, key: bytes, version: int) -> str:
    """``v<version>.`` + unpadded base64url of the first 16 bytes of HMAC-SHA256(key, framed)."""
    digest = hmac.new(key, framed, hashlib.sha256).digest()[:16]
    return f"v{version}." + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def normalize_ip(value: str, ipv6_prefix: int) -> str:
    """Normalise one bare address: IPv4 as is, IPv4-mapped IPv6 as IPv4, other IPv6 as its
    ``/ipv6_prefix`` network (``2001:db8::/64``; the address itself for 128).

    Idempotent: a network this function returned (``2001:db8::/64`` for a prefix of 64)
    normalises to itself, so an address the HTTP layer already normalised may pass through
    the core again. Raises :class:`ValueError` for anything else that is not a bare
    address (zone ids, ports, other networks).
    """
    if "/" in value:
        network = ipaddress.IPv6Network(value)
        base = network.network_address
        if (
            network.prefixlen != ipv6_prefix
            or ipv6_prefix >= 128
            or base.scope_id is not None
            or base.ipv4_mapped is not None
        ):
            raise ValueError("not a normalised client network")
        return str(network)
    address = ipaddress.ip_address(value)
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id is not None:
            raise ValueError("zone ids are not client addresses")
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        if ipv6_prefix >= 128:
            return str(address)
        return str(ipaddress.IPv6Network(f"{address}/{ipv6_prefix}", strict=False))
    return str(address)


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= 65535


def _strip_entry(entry: str) -> str:
    """Strip whitespace, an IPv4 ``:port``, and IPv6 brackets with their optional port.

    Raises :class:`ValueError` for a malformed port or bracket (``[::1]x``,
    ``1.2.3.4:http``, ``[1.2.3.4]``): a half-understood entry is not an address.
    """
    entry = entry.strip()
    if entry.startswith("["):
        end = entry.find("]")
        if end == -1 or ":" not in entry[1:end]:
            raise ValueError("brackets hold an IPv6 address")
        rest = entry[end + 1 :]
        if rest and not (rest.startswith(":") and _is_port(rest[1:])):
            raise ValueError("malformed port")
        return entry[1:end]
    if entry.count(":") == 1:
        host, port = entry.split(":")
        if not _is_port(port):
            raise ValueError("malformed port")
        return host
    return entry


def _parse_entry(entry: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """One chain entry as an address (IPv4-mapped IPv6 as IPv4); ``ValueError`` otherwise."""
    address = ipaddress.ip_address(_strip_entry(entry))
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id is not None:
            raise ValueError("zone id")
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
    return address


def parse_networks(values: Sequence[str]) -> tuple[IPNetwork, ...]:
    """Parse ``TRUSTED_PROXIES`` CIDRs (``ValueError`` on a bad one)."""
    return tuple(ipaddress.ip_network(value, strict=False) for value in values)


def _wire_length(text: str) -> int:
    # WSGI and ASGI servers hand headers over decoded as latin-1: one character per byte.
    try:
        return len(text.encode("latin-1"))
    except UnicodeEncodeError:
        return len(text.encode("utf-8", "surrogatepass"))


def _forwarded_entries(forwarded_for: str | Sequence[str] | None) -> list[str]:
    """The ``X-Forwarded-For`` entries, right to left, all header lines joined.

    Empty list elements (``a,,b``, a blank line) are not entries: RFC 9110 section 5.6.1
    has recipients ignore them. Raises ``IdentityError(selector_identity_invalid)`` when
    the header is over 4 KiB.
    """
    if forwarded_for is None:
        header = ""
    elif isinstance(forwarded_for, str):
        header = forwarded_for
    else:
        header = ",".join(forwarded_for)
    if _wire_length(header) > Bounds.MAX_FORWARDED_FOR_BYTES:
        raise IdentityError(SELECTOR_IDENTITY_INVALID, "ip")
    return [entry for entry in reversed(header.split(",")) if entry.strip()]


@functools.lru_cache(maxsize=Bounds.MAX_NORMALIZED)
def _normalized_entry(entry: str, ipv6_prefix: int) -> str:
    """One client entry normalised, remembered: parsing an address twice with
    ``ipaddress`` costs more than the rest of a request's subject. An entry that does not
    parse raises :class:`IdentityError` and is not remembered."""
    try:
        return normalize_ip(str(_parse_entry(entry)), ipv6_prefix)
    except ValueError:
        raise IdentityError(SELECTOR_IDENTITY_INVALID, "ip") from None


def client_ip(
    remote_addr: str | None,
    forwarded_for: str | Sequence[str] | None,
    *,
    trusted_proxies: Sequence[IPNetwork] = (),
    proxy_count: int | None = None,
    ipv6_prefix: int = 64,
) -> str:
    """The normalised client address for a request (the walk of ``docs/subjects.md``).

    The chain is ``remote_addr`` then the ``X-Forwarded-For`` entries right to left
    (several header lines are joined with commas; empty elements are ignored). With
    ``proxy_count`` set, exactly that many hops are skipped, ``remote_addr`` being the
    first (DRF's ``NUM_PROXIES``; skipped hops need not parse, and an absent
    ``remote_addr``, as behind a Unix socket, is still a hop); otherwise entries inside
    ``trusted_proxies`` are skipped. The first entry not skipped is the client; a chain
    that is all trusted, or shorter than ``proxy_count + 1``, gives its left-most entry.
    The header is read only when ``remote_addr`` is skipped, so an untrusted peer's
    header, whatever its content or size, changes nothing.

    Raises :class:`IdentityError`: ``selector_identity_missing`` when the client would be
    an absent ``remote_addr``; ``selector_identity_invalid`` when the client entry, or an
    entry walked past to find it, does not parse, or the header (when read) is over
    4 KiB. It never moves further left past a bad entry and never falls back to a proxy.
    """
    remote = (remote_addr or "").strip()

    def normalized(entry: str) -> str:
        if not entry:
            raise IdentityError(SELECTOR_IDENTITY_MISSING, "ip")
        return _normalized_entry(entry, ipv6_prefix)

    if proxy_count is not None:
        if proxy_count == 0:
            return normalized(remote)
        chain = [remote, *_forwarded_entries(forwarded_for)]
        return normalized(chain[min(proxy_count, len(chain) - 1)])
    if not trusted_proxies or not remote:
        return normalized(remote)
    try:
        peer = _parse_entry(remote)
    except ValueError:
        raise IdentityError(SELECTOR_IDENTITY_INVALID, "ip") from None
    if not _trusted(peer, trusted_proxies):
        return normalize_ip(str(peer), ipv6_prefix)
    # remote_addr is a trusted proxy: walk the header right to left; when every entry
    # is trusted, the last one walked (the left-most) is the client.
    address = peer
    for entry in _forwarded_entries(forwarded_for):
        try:
            address = _parse_entry(entry)
        except ValueError:
            raise IdentityError(SELECTOR_IDENTITY_INVALID, "ip") from None
        if not _trusted(address, trusted_proxies):
            break
    return normalize_ip(str(address), ipv6_prefix)


def _trusted(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, networks: Sequence[IPNetwork]
) -> bool:
    return any(address in network for network in networks)


def _has_control_characters(value: str) -> bool:
    # Unicode category Cc: C0 controls, DEL and the C1 controls.
    return any(ord(char) < 32 or 127 <= ord(char) < 160 for char in value)


def normalize_value(dimension: str, value: object, ipv6_prefix: int) -> str:
    """Turn one raw subject value (``str``, ``int`` or ``uuid.UUID``) into its normalised
    string form: an int as its decimal text, a UUID as its canonical text.

    Any other type (``bytes``, ``bool``, ``float``, an object whose ``str()`` may differ
    per instance and mint a fresh budget per call) raises ``TypeError`` naming the
    dimension and the type, never the value; :data:`INVALID_VALUE` (an edge's mark for a
    value it could not read) is invalid. ``None`` or ``""`` raises
    ``IdentityError(selector_identity_missing)``.
    ``IdentityError(selector_identity_invalid)`` is raised for an API key over 256 UTF-8
    bytes or with control characters, an IP that does not parse (one address, optionally
    with a port or brackets; no chain, no zone id), and a route with control characters
    or over 1 KiB (route values stay readable in keys and logs). Other values (user ids,
    tenants) are only ever hashed: any non-empty text is valid.
    """
    if value is None or value == "":
        raise IdentityError(SELECTOR_IDENTITY_MISSING, dimension)
    if isinstance(value, str):
        text = value
    elif isinstance(value, int) and not isinstance(value, bool):
        text = str(int(value))  # an IntEnum member is its number, not its name
    elif isinstance(value, uuid.UUID):
        text = str(value)
    elif value is INVALID_VALUE:
        raise IdentityError(SELECTOR_IDENTITY_INVALID, dimension)
    else:
        raise TypeError(
            f"identity value of dimension {dimension!r} must be str, int or uuid.UUID, "
            f"not {type(value).__name__}"
        )
    if dimension == "ip":
        try:
            return _normalize_address(text, ipv6_prefix)
        except ValueError:
            raise IdentityError(SELECTOR_IDENTITY_INVALID, dimension) from None
    if dimension == "api_key" and (
        _has_control_characters(text) or _utf8_length(text) > Bounds.MAX_API_KEY_BYTES
    ):
        raise IdentityError(SELECTOR_IDENTITY_INVALID, dimension)
    if dimension == "route" and (
        _has_control_characters(text) or _utf8_length(text) > Bounds.MAX_VALUE_BYTES
    ):
        raise IdentityError(SELECTOR_IDENTITY_INVALID, dimension)
    return text


def _utf8_length(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _normalize_address(text: str, ipv6_prefix: int) -> str:
    text = text.strip()
    if "/" in text:
        return normalize_ip(text, ipv6_prefix)
    return normalize_ip(str(_parse_entry(text)), ipv6_prefix)


def resolve_auto(subject: Mapping[str, object]) -> str:
    """The dimension ``auto`` stands for: ``user``, else ``api_key``, else ``ip``.

    The HTTP layer puts ``api_key`` into a subject for ``auto`` only when a verified key
    (``API_KEY_RESOLVER``) gave one, so this rule matches ``docs/subjects.md``.
    """
    for dimension in ("user", "api_key"):
        if subject.get(dimension) not in (None, ""):
            return dimension
    return "ip"


def build_identity(
    selector: Sequence[str],
    subject: Mapping[str, object],
    *,
    hmac_key: bytes,
    hmac_key_version: int,
    ipv6_prefix: int = 64,
) -> Identity:
    """Build the :class:`Identity` of ``subject`` (dimension -> raw value) for ``selector``.

    Raises :class:`IdentityError` for a missing or invalid dimension (an unknown identity
    is never replaced by another) and ``TypeError`` for a value that is not ``str``,
    ``int`` or ``uuid.UUID`` (:func:`normalize_value`).
    """
    dimensions = [resolve_auto(subject) if d == Selector.AUTO else d for d in selector]
    dimensions.sort(key=Selector.FRAMING_ORDER.index)
    components = [(d, normalize_value(d, subject.get(d), ipv6_prefix)) for d in dimensions]
    route = next((value for name, value in components if name == "route"), None)
    private = [(name, value) for name, value in components if name != "route"]
    pseudonym = pseudonymise(frame(private), hmac_key, hmac_key_version) if private else None
    hash_tag = pseudonym if pseudonym is not None else (route or "-")
    return Identity(tuple(dimensions), pseudonym, route, hash_tag)


class IdentityCache:
    """Identities remembered per process (bounded: at most ``size``, then emptied), so
    that a subject's pseudonym is computed once, not once per policy and request. Only
    subjects of plain string and integer values (or None) are remembered; the others are
    built every time (:func:`build_identity`, with these keyword arguments)."""

    def __init__(
        self, size: int, *, hmac_key: bytes, hmac_key_version: int, ipv6_prefix: int
    ) -> None:
        self.size = size
        self.hmac_key = hmac_key
        self.hmac_key_version = hmac_key_version
        self.ipv6_prefix = ipv6_prefix
        self._found: dict[tuple[object, ...], Identity] = {}

    def get(self, selector: Sequence[str], subject: Mapping[str, object]) -> Identity:
        """``subject``'s identity for ``selector`` (raises :class:`IdentityError`)."""
        items = tuple(subject.items())
        cacheable = True
        for _, value in items:
            kind = type(value)
            if kind is not str and kind is not int and value is not None:
                cacheable = False
                break
        key = (selector, items)
        if cacheable:
            found = self._found.get(key)
            if found is not None:
                return found
        identity = build_identity(
            selector,
            subject,
            hmac_key=self.hmac_key,
            hmac_key_version=self.hmac_key_version,
            ipv6_prefix=self.ipv6_prefix,
        )
        if cacheable:
            if len(self._found) >= self.size:
                self._found.clear()
            self._found[key] = identity
        return identity
