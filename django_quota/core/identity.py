"""Subjects to identities: client IP normalisation, length-prefixed framing and the HMAC
pseudonym that is the only form of an identity that reaches Redis, logs or metrics
(contract section 4)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from django_quota.core.errors import QuotaError
from django_quota.core.policy import AUTO, FRAMING_ORDER

IDENTITY_MISSING = "selector_identity_missing"
IDENTITY_INVALID = "selector_identity_invalid"

MAX_API_KEY_BYTES = 256
MAX_VALUE_BYTES = 1024
MAX_FORWARDED_FOR_BYTES = 4096
HMAC_DERIVATION_MESSAGE = b"django_quota.identity.v1"

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


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
    return hmac.new(secret, HMAC_DERIVATION_MESSAGE, hashlib.sha256).digest()


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
    """Normalise one address: IPv4 as is, IPv4-mapped IPv6 as IPv4, other IPv6 as its
    ``/ipv6_prefix`` network (``2001:db8::/64``).

    Raises :class:`ValueError` for anything that is not a bare address (zone ids included).
    """
    address = ipaddress.ip_address(value)
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id is not None:
            raise ValueError("zone ids are not client addresses")
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        if ipv6_prefix >= 128:
            return str(address)
        network = ipaddress.IPv6Network(f"{address}/{ipv6_prefix}", strict=False)
        return str(network)
    return str(address)


def _strip_entry(entry: str) -> str:
    """Strip whitespace, an IPv4 ``:port``, and IPv6 brackets (with their port)."""
    entry = entry.strip()
    if entry.startswith("["):
        end = entry.find("]")
        if end == -1:
            return entry
        return entry[1:end]
    if entry.count(":") == 1:
        return entry.split(":", 1)[0]
    return entry


def _parse_entry(entry: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
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


def client_ip(
    remote_addr: str | None,
    forwarded_for: str | Sequence[str] | None,
    *,
    trusted_proxies: Sequence[IPNetwork] = (),
    proxy_count: int | None = None,
    ipv6_prefix: int = 64,
) -> str:
    """The normalised client address for a request, as contract section 4 walks the chain.

    The chain is ``remote_addr`` then the ``X-Forwarded-For`` entries right to left
    (several header lines are joined with commas). With ``proxy_count`` set, exactly that
    many hops are skipped (``remote_addr`` being the first); otherwise entries inside
    ``trusted_proxies`` are skipped. The first entry not skipped is the client; a chain
    that is all trusted, or shorter than ``proxy_count + 1``, gives its left-most entry.
    The header is consulted only when ``remote_addr`` is a trusted proxy (or
    ``proxy_count`` is set).

    Raises :class:`IdentityError` (``selector_identity_missing`` without any address,
    ``selector_identity_invalid`` when the chosen entry or one walked past does not parse,
    or the header is over 4 KiB); it never moves further left past a bad entry and never
    falls back to the proxy's address.
    """
    if not remote_addr:
        raise IdentityError(IDENTITY_MISSING, "ip")
    if isinstance(forwarded_for, str):
        header = forwarded_for
    elif forwarded_for:
        header = ",".join(forwarded_for)
    else:
        header = ""
    invalid = IdentityError(IDENTITY_INVALID, "ip")

    def normalized(entry: str) -> str:
        try:
            address = _parse_entry(entry)
        except ValueError:
            raise invalid from None
        return normalize_ip(str(address), ipv6_prefix)

    if proxy_count is None and not trusted_proxies:
        return normalized(remote_addr)
    if len(header.encode("utf-8", "surrogatepass")) > MAX_FORWARDED_FOR_BYTES:
        raise invalid
    chain = [remote_addr]
    if header.strip():
        chain.extend(reversed(header.split(",")))
    if proxy_count is not None:
        return normalized(chain[min(proxy_count, len(chain) - 1)])
    for entry in chain:
        try:
            address = _parse_entry(entry)
        except ValueError:
            raise invalid from None
        if not any(address in network for network in trusted_proxies):
            return normalize_ip(str(address), ipv6_prefix)
    return normalized(chain[-1])


def _has_control_characters(value: str) -> bool:
    return any(ord(char) < 32 or ord(char) == 127 for char in value)


def normalize_value(dimension: str, value: object, ipv6_prefix: int) -> str:
    """Turn one raw subject value into its normalised string form.

    ``None`` or ``""`` raises ``IdentityError(selector_identity_missing)``; an API key over
    256 bytes or any value with control characters, an IP that does not parse, or a value
    over 1 KiB raises ``IdentityError(selector_identity_invalid)``.
    """
    if value is None or value == "":
        raise IdentityError(IDENTITY_MISSING, dimension)
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            raise IdentityError(IDENTITY_INVALID, dimension) from None
    text = value if isinstance(value, str) else str(value)
    encoded_length = len(text.encode("utf-8", "surrogatepass"))
    if _has_control_characters(text) or encoded_length > MAX_VALUE_BYTES:
        raise IdentityError(IDENTITY_INVALID, dimension)
    if dimension == "api_key" and encoded_length > MAX_API_KEY_BYTES:
        raise IdentityError(IDENTITY_INVALID, dimension)
    if dimension == "ip":
        try:
            return normalize_ip(_strip_entry(text), ipv6_prefix)
        except ValueError:
            raise IdentityError(IDENTITY_INVALID, dimension) from None
    return text


def resolve_auto(subject: Mapping[str, object]) -> str:
    """The dimension ``auto`` stands for: ``user``, else ``api_key``, else ``ip``.

    The HTTP layer puts ``api_key`` into a subject for ``auto`` only when a verified key
    (``API_KEY_RESOLVER``) gave one, so this rule matches contract section 4.
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

    Raises :class:`IdentityError` for a missing or invalid dimension; an unknown identity
    is never replaced by another.
    """
    dimensions = [resolve_auto(subject) if d == AUTO else d for d in selector]
    dimensions.sort(key=FRAMING_ORDER.index)
    components = [(d, normalize_value(d, subject.get(d), ipv6_prefix)) for d in dimensions]
    route = next((value for name, value in components if name == "route"), None)
    private = [(name, value) for name, value in components if name != "route"]
    pseudonym = pseudonymise(frame(private), hmac_key, hmac_key_version) if private else None
    hash_tag = pseudonym if pseudonym is not None else (route or "-")
    return Identity(tuple(dimensions), pseudonym, route, hash_tag)
