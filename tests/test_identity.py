"""The core of docs/subjects.md, without Django: the client IP walk over forwarded
chains, IPv6 grouping, the framing of components and the HMAC pseudonym, and identity
errors. Every expected value is written out or recomputed here with hmac/hashlib/base64,
never taken from the code under test.

:data:`FORWARDED_CHAINS` is the table of forwarded chains; ``tests/test_subjects.py``
runs the same table through the HTTP layer, and ``docs/subjects.md`` shows it (a test
below keeps the page equal to :func:`forwarded_chains_markdown`)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIRequestFactory
from rest_framework.throttling import SimpleRateThrottle

from django_quota.core.identity import (
    INVALID_VALUE,
    IdentityError,
    build_identity,
    client_ip,
    derive_hmac_key,
    frame,
    normalize_ip,
    normalize_value,
    parse_networks,
    pseudonymise,
    resolve_auto,
)
from django_quota.core.policy import parse_policy
from django_quota.core.protocol import counter_key
from django_quota.subjects import identity_value

INVALID = "selector_identity_invalid"
MISSING = "selector_identity_missing"
SECRET_KEY = "tests-secret-key-not-for-production"
KEY = b"an-hmac-key-of-sixteen-bytes-or-more"
TRUSTED = ["10.0.0.0/8", "2001:db8:ffff::/48"]
#: 4096 bytes exactly (the limit) and 4097 (over it): empty elements pad the header.
AT_LIMIT = "," * (4096 - len("198.51.100.7")) + "198.51.100.7"
OVER_LIMIT = "," + AT_LIMIT

ForwardedFor = str | list[str] | None
#: (description, REMOTE_ADDR, X-Forwarded-For, TRUSTED_PROXIES, PROXY_COUNT, identity or
#: reason). A list of X-Forwarded-For values stands for several header lines.
# fmt: off
FORWARDED_CHAINS: list[tuple[str, str, ForwardedFor, list[str], int | None, str]] = [
    # -- no proxy configured: REMOTE_ADDR is the client, the header is never read
    ("no proxies: REMOTE_ADDR is the client", "203.0.113.9", None, [], None, "203.0.113.9"),
    ("no proxies: a spoofed header is ignored", "203.0.113.9", "198.51.100.7", [], None,
     "203.0.113.9"),
    ("no proxies: a garbage header is ignored", "203.0.113.9", "garbage", [], None,
     "203.0.113.9"),
    ("no proxies: an oversized header is ignored", "203.0.113.9", OVER_LIMIT, [], None,
     "203.0.113.9"),
    ("REMOTE_ADDR with an IPv4 port", "203.0.113.9:5678", None, [], None, "203.0.113.9"),
    ("REMOTE_ADDR IPv6 becomes its /64", "2001:db8:1:2:3:4:5:6", None, [], None,
     "2001:db8:1:2::/64"),
    ("REMOTE_ADDR IPv4-mapped IPv6 is IPv4", "::ffff:198.51.100.7", None, [], None,
     "198.51.100.7"),
    ("REMOTE_ADDR garbage", "garbage", None, [], None, INVALID),
    ("REMOTE_ADDR with a zone id", "fe80::1%eth0", None, [], None, INVALID),
    ("REMOTE_ADDR absent", "", None, [], None, MISSING),
    # -- TRUSTED_PROXIES: skip trusted entries right to left
    ("untrusted peer: its header is ignored", "203.0.113.9", "198.51.100.7", TRUSTED, None,
     "203.0.113.9"),
    ("untrusted peer: its garbage header is ignored", "203.0.113.9", "garbage", TRUSTED,
     None, "203.0.113.9"),
    ("untrusted peer: its oversized header is ignored", "203.0.113.9", OVER_LIMIT, TRUSTED,
     None, "203.0.113.9"),
    ("trusted peer: the right-most entry is the client", "10.0.0.1", "198.51.100.7",
     TRUSTED, None, "198.51.100.7"),
    ("spoofed entries left of the client are never read", "10.0.0.1",
     "1.1.1.1, 198.51.100.7", TRUSTED, None, "198.51.100.7"),
    ("two trusted hops are skipped", "10.0.0.1", "198.51.100.7, 10.0.0.2", TRUSTED, None,
     "198.51.100.7"),
    ("all trusted: the left-most entry wins", "10.0.0.1", "10.0.0.3, 10.0.0.2", TRUSTED,
     None, "10.0.0.3"),
    ("trusted peer without a header is the left-most entry", "10.0.0.1", None, TRUSTED,
     None, "10.0.0.1"),
    ("trusted peer absent (no REMOTE_ADDR)", "", "198.51.100.7", TRUSTED, None, MISSING),
    ("IPv4 entry with a port", "10.0.0.1", "198.51.100.7:5678", TRUSTED, None,
     "198.51.100.7"),
    ("bracketed IPv6 with a port", "10.0.0.1", "[2001:db8::1]:443", TRUSTED, None,
     "2001:db8::/64"),
    ("bracketed IPv6 without a port", "10.0.0.1", "[2001:db8::1]", TRUSTED, None,
     "2001:db8::/64"),
    ("bare IPv6 entry", "10.0.0.1", "2001:DB8:0:0:1::1", TRUSTED, None, "2001:db8::/64"),
    ("IPv4-mapped IPv6 entry is IPv4", "10.0.0.1", "::ffff:198.51.100.7", TRUSTED, None,
     "198.51.100.7"),
    ("IPv4-mapped hop inside a v4 CIDR is trusted", "10.0.0.1",
     "198.51.100.7, ::ffff:10.0.0.2", TRUSTED, None, "198.51.100.7"),
    ("trusted IPv6 peer (v6 CIDR)", "2001:db8:ffff::1", "198.51.100.7", TRUSTED, None,
     "198.51.100.7"),
    ("trusted IPv6 hops (v6 CIDR) are skipped", "10.0.0.1",
     "2001:db8:1::5, [2001:db8:ffff:1::2]:443", TRUSTED, None, "2001:db8:1::/64"),
    ("whitespace around entries", "10.0.0.1", "  198.51.100.7 ,\t10.0.0.2  ", TRUSTED,
     None, "198.51.100.7"),
    ("empty elements are ignored", "10.0.0.1", "198.51.100.7,,10.0.0.2,, ,", TRUSTED, None,
     "198.51.100.7"),
    ("a blank header is the peer alone", "10.0.0.1", " ", TRUSTED, None, "10.0.0.1"),
    ("several header lines are joined", "10.0.0.1", ["198.51.100.7", "10.0.0.2"], TRUSTED,
     None, "198.51.100.7"),
    ("several header lines: the last line is read first", "10.0.0.1",
     ["1.1.1.1, 198.51.100.7", "10.0.0.3, 10.0.0.2"], TRUSTED, None, "198.51.100.7"),
    ("a blank header line is ignored", "10.0.0.1", ["198.51.100.7", ""], TRUSTED, None,
     "198.51.100.7"),
    ("garbage client entry", "10.0.0.1", "garbage", TRUSTED, None, INVALID),
    ("garbage right of the client: invalid, never further left", "10.0.0.1",
     "198.51.100.7, garbage", TRUSTED, None, INVALID),
    ("garbage between trusted hops: invalid, not the proxy", "10.0.0.1",
     "198.51.100.7, garbage, 10.0.0.2", TRUSTED, None, INVALID),
    ("garbage left of the client is never read", "10.0.0.1", "garbage, 198.51.100.7",
     TRUSTED, None, "198.51.100.7"),
    ("'unknown' is not an address", "10.0.0.1", "unknown", TRUSTED, None, INVALID),
    ("zone id entry", "10.0.0.1", "fe80::1%eth0", TRUSTED, None, INVALID),
    ("bracketed zone id with a port", "10.0.0.1", "[fe80::1%eth0]:443", TRUSTED, None,
     INVALID),
    ("port that is not a number", "10.0.0.1", "198.51.100.7:http", TRUSTED, None, INVALID),
    ("port over 65535", "10.0.0.1", "198.51.100.7:65536", TRUSTED, None, INVALID),
    ("bracketed IPv4", "10.0.0.1", "[198.51.100.7]", TRUSTED, None, INVALID),
    ("junk after the brackets", "10.0.0.1", "[2001:db8::1]x", TRUSTED, None, INVALID),
    ("a network is not an address", "10.0.0.1", "198.51.100.0/24", TRUSTED, None, INVALID),
    ("leading zeros are not an address", "10.0.0.1", "198.051.100.7", TRUSTED, None,
     INVALID),
    ("a header of exactly 4 KiB is read", "10.0.0.1", AT_LIMIT, TRUSTED, None,
     "198.51.100.7"),
    ("a header over 4 KiB is invalid", "10.0.0.1", OVER_LIMIT, TRUSTED, None, INVALID),
    # -- PROXY_COUNT: exactly that many hops, REMOTE_ADDR the first (DRF's NUM_PROXIES)
    ("PROXY_COUNT 0: REMOTE_ADDR is the client", "10.0.0.1", "198.51.100.7", [], 0,
     "10.0.0.1"),
    ("PROXY_COUNT 0: the header is never read", "10.0.0.1", OVER_LIMIT, [], 0, "10.0.0.1"),
    ("PROXY_COUNT 1: the right-most entry", "10.0.0.1", "1.1.1.1, 198.51.100.7", [], 1,
     "198.51.100.7"),
    ("PROXY_COUNT 1 without a header: REMOTE_ADDR (left-most)", "10.0.0.1", None, [], 1,
     "10.0.0.1"),
    ("PROXY_COUNT 2: chain longer", "10.0.0.1", "1.1.1.1, 198.51.100.7, 10.0.0.2", [], 2,
     "198.51.100.7"),
    ("PROXY_COUNT 2: chain shorter gives its left-most entry", "10.0.0.1", "198.51.100.7",
     [], 2, "198.51.100.7"),
    ("PROXY_COUNT 3: chain longer", "10.0.0.1",
     "1.1.1.1, 198.51.100.7, 10.0.0.3, 10.0.0.2", [], 3, "198.51.100.7"),
    ("PROXY_COUNT 3: chain of exactly 4", "10.0.0.1", "198.51.100.7, 10.0.0.3, 10.0.0.2",
     [], 3, "198.51.100.7"),
    ("PROXY_COUNT 3: chain shorter gives its left-most entry", "10.0.0.1",
     "198.51.100.7, 10.0.0.2", [], 3, "198.51.100.7"),
    ("PROXY_COUNT 2: skipped hops need not parse", "10.0.0.1", "198.51.100.7, unknown",
     [], 2, "198.51.100.7"),
    ("PROXY_COUNT 2: a garbage client entry is invalid", "10.0.0.1", "garbage, 10.0.0.2",
     [], 2, INVALID),
    ("PROXY_COUNT 2: a bracketed IPv6 client", "10.0.0.1", "[2001:db8::1]:443, 10.0.0.2",
     [], 2, "2001:db8::/64"),
    ("PROXY_COUNT 1: empty elements are not hops", "10.0.0.1", "198.51.100.7,, ", [], 1,
     "198.51.100.7"),
    ("PROXY_COUNT 1: a header over 4 KiB is invalid", "10.0.0.1", OVER_LIMIT, [], 1,
     INVALID),
    ("PROXY_COUNT wins over TRUSTED_PROXIES", "10.0.0.1", "198.51.100.7, 10.0.0.2",
     TRUSTED, 1, "10.0.0.2"),
    ("PROXY_COUNT 1, REMOTE_ADDR absent (Unix socket)", "", "198.51.100.7", [], 1,
     "198.51.100.7"),
    ("PROXY_COUNT 1, REMOTE_ADDR and header absent", "", None, [], 1, MISSING),
]
# fmt: on


def resolve_chain(
    remote: str,
    forwarded_for: ForwardedFor,
    trusted: Sequence[str],
    proxy_count: int | None,
    ipv6_prefix: int = 64,
) -> str:
    """The core's answer for one row: the normalised IP, or the identity error's reason."""
    try:
        return client_ip(
            remote,
            forwarded_for,
            trusted_proxies=parse_networks(trusted),
            proxy_count=proxy_count,
            ipv6_prefix=ipv6_prefix,
        )
    except IdentityError as exc:
        assert exc.dimension == "ip"
        return exc.reason


def _cell(value: object) -> str:
    if value is None or value == []:
        return "—"
    if isinstance(value, list):
        return "`[" + ", ".join(f'"{item}"' for item in value) + "]`"
    text = str(value)
    if len(text) > 60:
        return f"`{text[:4]}…{text[-14:]}` ({len(text)} bytes)"
    if text.strip() != text or text == "":
        return f'`"{text}"`'.replace("\t", "\\t")
    return f"`{text}`"


def forwarded_chains_markdown() -> str:
    """:data:`FORWARDED_CHAINS` as the markdown table of ``docs/subjects.md``."""
    lines = [
        "| # | case | REMOTE_ADDR | X-Forwarded-For | TRUSTED_PROXIES | PROXY_COUNT | ip |",
        "|---|---|---|---|---|---|---|",
    ]
    for number, (description, remote, xff, trusted, count, expected) in enumerate(
        FORWARDED_CHAINS, start=1
    ):
        cells = [
            str(number),
            description,
            _cell(remote) if remote else "(absent)",
            _cell(xff),
            "trusted" if trusted else "—",
            "—" if count is None else str(count),
            f"`{expected}`",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- 1. forwarded chains -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("description", "remote", "forwarded_for", "trusted", "proxy_count", "expected"),
    FORWARDED_CHAINS,
    ids=[row[0] for row in FORWARDED_CHAINS],
)
def test_forwarded_chain_gives_the_documented_client(
    description: str,
    remote: str,
    forwarded_for: ForwardedFor,
    trusted: list[str],
    proxy_count: int | None,
    expected: str,
) -> None:
    assert resolve_chain(remote, forwarded_for, trusted, proxy_count) == expected


def test_forwarded_chain_table_rows_are_unique() -> None:
    descriptions = [row[0] for row in FORWARDED_CHAINS]
    assert len(descriptions) == len(set(descriptions))


def test_docs_show_the_forwarded_chain_table_with_each_row_identity() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "subjects.md").read_text(
        encoding="utf-8"
    )
    assert forwarded_chains_markdown() in page


@pytest.mark.parametrize(
    ("xff", "num_proxies"),
    [
        (None, 1),
        ("198.51.100.7", 1),
        ("1.1.1.1, 198.51.100.7", 1),
        ("1.1.1.1, 198.51.100.7, 10.0.0.2", 2),
        ("198.51.100.7", 2),
        ("1.1.1.1, 198.51.100.7, 10.0.0.3, 10.0.0.2", 3),
        ("198.51.100.7, 10.0.0.2", 3),
        ("198.51.100.7", 0),
    ],
)
def test_proxy_count_picks_the_entry_drf_num_proxies_picks(
    settings: Any, xff: str | None, num_proxies: int
) -> None:
    settings.REST_FRAMEWORK = {"NUM_PROXIES": num_proxies}
    extra: dict[str, Any] = {"REMOTE_ADDR": "10.0.0.1"}
    if xff is not None:
        extra["HTTP_X_FORWARDED_FOR"] = xff
    request = APIRequestFactory().get("/", **extra)
    drf = SimpleRateThrottle.__new__(SimpleRateThrottle).get_ident(request)
    assert client_ip("10.0.0.1", xff, proxy_count=num_proxies) == drf


def test_missing_remote_addr_without_proxies_is_missing_not_invalid() -> None:
    for remote in (None, "", "  "):
        with pytest.raises(IdentityError) as caught:
            client_ip(remote, "198.51.100.7")
        assert caught.value.reason == MISSING


# -- 2. IPv6 grouping ------------------------------------------------------------------------
def ip_identity(address: str, ipv6_prefix: int = 64) -> str:
    identity = build_identity(
        ["ip"], {"ip": address}, hmac_key=KEY, hmac_key_version=1, ipv6_prefix=ipv6_prefix
    )
    assert identity.pseudonym is not None
    return identity.pseudonym


def test_every_address_of_one_slash_64_shares_one_identity() -> None:
    same = [
        "2001:db8:1:2::1",
        "2001:db8:1:2::2",
        "2001:db8:1:2:ffff:ffff:ffff:ffff",
        "2001:0DB8:0001:0002:0000:0000:0000:0009",
        "[2001:db8:1:2::5]:443",
        "[2001:db8:1:2::6]",
        "2001:db8:1:2::/64",  # the normalised form itself (what the HTTP layer passes on)
    ]
    assert {ip_identity(address) for address in same} == {ip_identity("2001:db8:1:2::")}
    assert ip_identity("2001:db8:1:2::1") == pseudonymise(
        frame([("ip", "2001:db8:1:2::/64")]), KEY, 1
    )


def test_a_different_slash_64_is_another_identity() -> None:
    assert ip_identity("2001:db8:1:3::1") != ip_identity("2001:db8:1:2::1")
    assert ip_identity("2001:db8:1:2::1") != ip_identity("2001:db8:1:2::1", ipv6_prefix=128)


def test_ipv6_prefix_48_groups_the_slash_48() -> None:
    assert normalize_ip("2001:db8:1:2::1", 48) == "2001:db8:1::/48"
    assert ip_identity("2001:db8:1:2::1", 48) == ip_identity("2001:db8:1:ffff::9", 48)
    assert ip_identity("2001:db8:1:2::1", 48) != ip_identity("2001:db8:2::1", 48)


def test_ipv6_prefix_128_keeps_each_address_apart() -> None:
    assert normalize_ip("2001:db8:1:2::1", 128) == "2001:db8:1:2::1"
    assert ip_identity("2001:db8:1:2::1", 128) != ip_identity("2001:db8:1:2::2", 128)
    assert client_ip("2001:db8:1:2::1", None, ipv6_prefix=128) == "2001:db8:1:2::1"


def test_ipv6_prefix_does_not_touch_ipv4_or_ipv4_mapped() -> None:
    for prefix in (48, 64, 128):
        assert normalize_ip("198.51.100.7", prefix) == "198.51.100.7"
        assert normalize_ip("::ffff:198.51.100.7", prefix) == "198.51.100.7"
    assert ip_identity("::ffff:198.51.100.7") == ip_identity("198.51.100.7")


@pytest.mark.parametrize("prefix", [48, 64, 128])
@pytest.mark.parametrize(
    "address", ["198.51.100.7", "::ffff:198.51.100.7", "2001:db8:1:2::1", "::1", "fe80::1"]
)
def test_ip_normalisation_is_idempotent(address: str, prefix: int) -> None:
    once = normalize_value("ip", address, prefix)
    assert normalize_value("ip", once, prefix) == once


@pytest.mark.parametrize(
    "value",
    [
        "2001:db8:1::/48",  # a network of another prefix than IPV6_PREFIX
        "2001:db8:1:2::1/64",  # host bits set: not a normalised network
        "198.51.100.0/24",
        "::ffff:198.51.100.0/120",
        "fe80::1%eth0",
        "198.51.100.7, 10.0.0.1",  # a chain is not an address
        "garbage",
        " ",
    ],
)
def test_ip_value_that_is_not_one_address_is_invalid(value: str) -> None:
    with pytest.raises(IdentityError) as caught:
        normalize_value("ip", value, 64)
    assert (caught.value.reason, caught.value.dimension) == (INVALID, "ip")


# -- 3. framing ------------------------------------------------------------------------------
def test_frame_is_length_prefixed_name_then_value() -> None:
    assert frame([("user", "42")]) == b"\x00\x00\x00\x04user\x00\x00\x00\x0242"
    assert frame([("user", "42"), ("ip", "198.51.100.7")]) == (
        b"\x00\x00\x00\x04user\x00\x00\x00\x0242\x00\x00\x00\x02ip\x00\x00\x00\x0c198.51.100.7"
    )
    assert frame([]) == b""
    assert frame([("user", "é")]) == b"\x00\x00\x00\x04user\x00\x00\x00\x02\xc3\xa9"


def test_user_42_and_api_key_42_never_share_a_counter() -> None:
    user = build_identity(["user"], {"user": "42"}, hmac_key=KEY, hmac_key_version=1)
    api_key = build_identity(["api_key"], {"api_key": "42"}, hmac_key=KEY, hmac_key_version=1)
    assert user.pseudonym != api_key.pseudonym
    assert user.hash_tag != api_key.hash_tag


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"tenant": "ab", "user": "c"}, {"tenant": "a", "user": "bc"}),
        ({"tenant": "a\x00b", "user": "c"}, {"tenant": "a", "user": "\x00bc"}),
        ({"tenant": "4:ab", "user": "c"}, {"tenant": "4", "user": ":abc"}),
        (
            {"tenant": "x\x00\x00\x00\x04user\x00\x00\x00\x01y", "user": "z"},
            {"tenant": "x", "user": "y"},
        ),
        ({"tenant": "", "user": "ab"}, {"tenant": "a", "user": "b"}),
    ],
)
def test_shifted_splits_across_dimensions_never_collide(
    first: dict[str, str], second: dict[str, str]
) -> None:
    first_frame = frame(sorted(first.items(), key=lambda item: item[0] != "tenant"))
    second_frame = frame(sorted(second.items(), key=lambda item: item[0] != "tenant"))
    assert first_frame != second_frame
    assert pseudonymise(first_frame, KEY, 1) != pseudonymise(second_frame, KEY, 1)
    if all(first.values()):
        identities = [
            build_identity(["tenant", "user"], subject, hmac_key=KEY, hmac_key_version=1)
            for subject in (first, second)
        ]
        assert identities[0].pseudonym != identities[1].pseudonym


def test_framing_is_injective_over_tricky_values() -> None:
    values = ["", "a", "b", "ab", "\x00", "\x00\x00\x00\x01", "4:", ":a", "user"]
    dimensions = ["tenant", "user"]
    seen: dict[bytes, object] = {}
    for count in (1, 2):
        for names in itertools.product(dimensions, repeat=count):
            for chosen in itertools.product(values, repeat=count):
                components = tuple(zip(names, chosen, strict=True))
                framed = frame(components)
                assert seen.setdefault(framed, components) == components


def test_components_are_framed_route_tenant_user_api_key_ip_whatever_the_selector_order() -> None:
    subject = {
        "route": "api:items",
        "tenant": "acme",
        "user": "42",
        "api_key": "k1",
        "ip": "198.51.100.7",
    }
    expected = pseudonymise(
        frame([("tenant", "acme"), ("user", "42"), ("api_key", "k1"), ("ip", "198.51.100.7")]),
        KEY,
        1,
    )
    for order in itertools.permutations(["ip", "api_key", "user", "tenant", "route"]):
        identity = build_identity(order, subject, hmac_key=KEY, hmac_key_version=1)
        assert identity.dimensions == ("route", "tenant", "user", "api_key", "ip")
        assert identity.pseudonym == expected
        assert identity.route == "api:items"


# -- 4. the pseudonym --------------------------------------------------------------------------
def independent_frame(components: Sequence[tuple[str, str]]) -> bytes:
    out = b""
    for name, value in components:
        for part in (name.encode(), value.encode()):
            out += len(part).to_bytes(4, "big") + part
    return out


def independent_pseudonym(
    components: Sequence[tuple[str, str]], key: bytes, version: int = 1
) -> str:
    digest = hmac.new(key, independent_frame(components), hashlib.sha256).digest()[:16]
    return f"v{version}." + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def test_derived_key_is_hmac_of_secret_key_over_the_label() -> None:
    expected = hmac.new(SECRET_KEY.encode(), b"django_quota.identity.v1", hashlib.sha256)
    assert derive_hmac_key(None, SECRET_KEY) == expected.digest()
    assert derive_hmac_key(None, SECRET_KEY.encode()) == expected.digest()


def test_configured_hmac_key_is_used_as_is() -> None:
    assert derive_hmac_key("a-dedicated-hmac-key", SECRET_KEY) == b"a-dedicated-hmac-key"
    assert derive_hmac_key(b"\x00raw-bytes-key-1234", SECRET_KEY) == b"\x00raw-bytes-key-1234"


@pytest.mark.parametrize(
    ("selector", "subject", "components"),
    [
        (["user"], {"user": "42"}, [("user", "42")]),
        (["api_key"], {"api_key": "sk_live_x"}, [("api_key", "sk_live_x")]),
        (["ip"], {"ip": "198.51.100.7:443"}, [("ip", "198.51.100.7")]),
        (["ip"], {"ip": "2001:db8::1"}, [("ip", "2001:db8::/64")]),
        (["user", "ip"], {"user": 42, "ip": "::ffff:1.2.3.4"}, [("user", "42"), ("ip", "1.2.3.4")]),
        (["route", "user"], {"route": "api:items", "user": "42"}, [("user", "42")]),
        (
            ["tenant", "api_key"],
            {"tenant": "acme", "api_key": "k"},
            [("tenant", "acme"), ("api_key", "k")],
        ),
        (["user"], {"user": "Zoë-ユーザー"}, [("user", "Zoë-ユーザー")]),
    ],
)
@pytest.mark.parametrize("key_source", ["hmac_key", "secret_key"])
def test_pseudonym_is_exactly_the_documented_hmac(
    selector: list[str],
    subject: dict[str, object],
    components: list[tuple[str, str]],
    key_source: str,
) -> None:
    if key_source == "hmac_key":
        key, expected_key = (
            derive_hmac_key("configured-hmac-key-0123", SECRET_KEY),
            (b"configured-hmac-key-0123"),
        )
    else:
        key = derive_hmac_key(None, SECRET_KEY)
        expected_key = hmac.new(
            SECRET_KEY.encode(), b"django_quota.identity.v1", hashlib.sha256
        ).digest()
    identity = build_identity(selector, subject, hmac_key=key, hmac_key_version=1)
    expected = independent_pseudonym(components, expected_key)
    assert identity.pseudonym == expected
    assert identity.hash_tag == expected
    assert len(expected) == len("v1.") + 22 and "=" not in expected


def test_hmac_key_version_changes_the_prefix_and_the_value() -> None:
    one = build_identity(["user"], {"user": "42"}, hmac_key=KEY, hmac_key_version=1)
    seven = build_identity(["user"], {"user": "42"}, hmac_key=KEY, hmac_key_version=7)
    assert one.pseudonym == independent_pseudonym([("user", "42")], KEY, 1)
    assert seven.pseudonym is not None and seven.pseudonym.startswith("v7.")
    assert seven.pseudonym != one.pseudonym
    other_key = build_identity(["user"], {"user": "42"}, hmac_key=b"x" * 32, hmac_key_version=1)
    assert other_key.pseudonym != one.pseudonym


def test_hmac_key_version_prefix_is_documented() -> None:
    # The digest part stays the HMAC of the framed components (the version is not hashed);
    # a new version still starts fresh counters because the key name changes.
    one = pseudonymise(frame([("user", "42")]), KEY, 1)
    two = pseudonymise(frame([("user", "42")]), KEY, 2)
    assert (one[:3], two[:3]) == ("v1.", "v2.")
    assert one[3:] == two[3:]


def test_route_only_selector_keeps_the_route_readable_as_hash_tag() -> None:
    identity = build_identity(["route"], {"route": "api:items"}, hmac_key=KEY, hmac_key_version=1)
    assert (identity.pseudonym, identity.route, identity.hash_tag) == (
        None,
        "api:items",
        "api:items",
    )
    policy = parse_policy("per_route", {"windows": "5/m", "selector": ["route"]})
    assert (
        counter_key("quota", policy, identity)
        == f"quota:{{api:items}}:9:per_route:{policy.revision}"
    )


def test_route_with_other_dimensions_is_outside_the_hmac_and_in_the_key() -> None:
    alone = build_identity(["user"], {"user": "42"}, hmac_key=KEY, hmac_key_version=1)
    routed = build_identity(
        ["route", "user"], {"route": "api:items", "user": "42"}, hmac_key=KEY, hmac_key_version=1
    )
    assert routed.pseudonym == alone.pseudonym  # same subject, same slot as its other policies
    policy = parse_policy("per_view", {"windows": "5/m", "selector": ["route", "user"]})
    assert counter_key("quota", policy, routed) == (
        f"quota:{{{alone.pseudonym}}}:8:per_view:{policy.revision}:api:items"
    )
    assert routed.label == f"route=api:items id={alone.pseudonym}"


def test_ids_and_routes_containing_colons_never_share_a_counter_name() -> None:
    identity = build_identity(
        ["route", "user"], {"route": "b:1:c", "user": "42"}, hmac_key=KEY, hmac_key_version=1
    )
    other = build_identity(
        ["route", "user"], {"route": "c", "user": "42"}, hmac_key=KEY, hmac_key_version=1
    )
    short = parse_policy("a", {"windows": "5/m", "selector": ["route", "user"]})
    long = parse_policy("a:1:b", {"windows": "5/m", "selector": ["route", "user"]})
    short = type(short)(
        **{**{f: getattr(short, f) for f in short.__dataclass_fields__}, "revision": "1"}
    )
    long = type(long)(
        **{**{f: getattr(long, f) for f in long.__dataclass_fields__}, "revision": "1"}
    )
    assert counter_key("q", short, identity) != counter_key("q", long, other)


# -- 5. identity errors --------------------------------------------------------------------
@pytest.mark.parametrize("dimension", ["user", "api_key", "ip", "tenant", "route"])
@pytest.mark.parametrize("value", [None, ""])
def test_absent_dimension_is_missing(dimension: str, value: object) -> None:
    with pytest.raises(IdentityError) as caught:
        build_identity([dimension], {dimension: value}, hmac_key=KEY, hmac_key_version=1)
    assert (caught.value.reason, caught.value.dimension) == (MISSING, dimension)
    with pytest.raises(IdentityError) as caught:
        build_identity([dimension], {}, hmac_key=KEY, hmac_key_version=1)
    assert caught.value.reason == MISSING


def test_identity_error_names_the_dimension_never_the_value() -> None:
    with pytest.raises(IdentityError) as caught:
        build_identity(["api_key"], {"api_key": "sk\nSECRET"}, hmac_key=KEY, hmac_key_version=1)
    assert str(caught.value) == "selector_identity_invalid: api_key"


def test_one_bad_dimension_of_several_fails_the_identity() -> None:
    with pytest.raises(IdentityError) as caught:
        build_identity(
            ["user", "ip"], {"user": "42", "ip": "garbage"}, hmac_key=KEY, hmac_key_version=1
        )
    assert (caught.value.reason, caught.value.dimension) == (INVALID, "ip")


@pytest.mark.parametrize(
    "key",
    [
        "k" * 257,
        "é" * 128 + "k",  # 257 UTF-8 bytes in 129 characters
        "sk_live\x00x",
        "sk_live\nx",
        "sk_live\tx",
        "sk_live\x7fx",
        "sk_live\x85x",  # a C1 control (NEL)
        "\x1b[31m",
    ],
)
def test_api_key_over_256_bytes_or_with_control_characters_is_invalid(key: str) -> None:
    with pytest.raises(IdentityError) as caught:
        normalize_value("api_key", key, 64)
    assert (caught.value.reason, caught.value.dimension) == (INVALID, "api_key")


@pytest.mark.parametrize("key", ["k" * 256, "é" * 128, "ключ-🔑", "sk live with spaces"])
def test_api_key_of_256_bytes_or_non_ascii_is_valid(key: str) -> None:
    assert normalize_value("api_key", key, 64) == key
    # Bytes are the HTTP edge's to decode (the core takes str, int or uuid.UUID).
    assert normalize_value("api_key", identity_value(key.encode()), 64) == key


@pytest.mark.parametrize(
    ("dimension", "value"),
    [("user", "Zoë-ユーザー"), ("user", "🙂"), ("api_key", "ключ-🔑"), ("tenant", "Ünïcode GmbH")],
)
def test_non_ascii_identities_are_allowed_and_stable(dimension: str, value: str) -> None:
    first = build_identity([dimension], {dimension: value}, hmac_key=KEY, hmac_key_version=1)
    again = build_identity(
        [dimension], {dimension: identity_value(value.encode())}, hmac_key=KEY,
        hmac_key_version=1,
    )
    assert first.pseudonym == again.pseudonym == independent_pseudonym([(dimension, value)], KEY)


def test_bytes_that_are_not_utf8_are_invalid() -> None:
    """The HTTP edge marks them INVALID_VALUE; the core refuses that mark (and any bytes)."""
    assert identity_value(b"\xff\xfe") is INVALID_VALUE
    with pytest.raises(IdentityError) as caught:
        normalize_value("user", INVALID_VALUE, 64)
    assert caught.value.reason == INVALID
    with pytest.raises(TypeError):
        normalize_value("user", b"\xff\xfe", 64)


@pytest.mark.parametrize("dimension", ["user", "tenant"])
def test_huge_hashed_identities_are_valid_and_fixed_size(dimension: str) -> None:
    huge = "u" * (1 << 20)
    identity = build_identity([dimension], {dimension: huge}, hmac_key=KEY, hmac_key_version=1)
    assert identity.pseudonym == independent_pseudonym([(dimension, huge)], KEY)
    assert len(identity.pseudonym) == 25
    other = build_identity(
        [dimension], {dimension: huge[:-1] + "v"}, hmac_key=KEY, hmac_key_version=1
    )
    assert other.pseudonym != identity.pseudonym


def test_user_and_tenant_values_are_only_hashed_so_any_text_is_valid() -> None:
    for value in ("a\x00b", "line\nbreak", " padded "):
        assert normalize_value("user", value, 64) == value
        assert normalize_value("tenant", value, 64) == value


@pytest.mark.parametrize("route", ["r" * 1025, "api\nitems", "api\x00items"])
def test_readable_route_with_control_characters_or_over_1_kib_is_invalid(route: str) -> None:
    with pytest.raises(IdentityError) as caught:
        normalize_value("route", route, 64)
    assert (caught.value.reason, caught.value.dimension) == (INVALID, "route")
    assert normalize_value("route", "r" * 1024, 64) == "r" * 1024


def test_invalid_ip_is_never_replaced_by_another_address() -> None:
    networks = parse_networks(["10.0.0.0/8"])
    for header in ("garbage", "198.51.100.7, garbage", "fe80::1%eth0", OVER_LIMIT):
        with pytest.raises(IdentityError) as caught:
            client_ip("10.0.0.1", header, trusted_proxies=networks)
        assert caught.value.reason == INVALID


def test_auto_means_user_else_api_key_else_ip_in_the_core() -> None:
    assert resolve_auto({"user": "42", "api_key": "k", "ip": "1.2.3.4"}) == "user"
    assert resolve_auto({"user": None, "api_key": "k", "ip": "1.2.3.4"}) == "api_key"
    assert resolve_auto({"user": "", "api_key": None, "ip": "1.2.3.4"}) == "ip"
    assert resolve_auto({}) == "ip"
    with pytest.raises(IdentityError) as caught:
        build_identity(["auto"], {"ip": "garbage"}, hmac_key=KEY, hmac_key_version=1)
    assert (caught.value.reason, caught.value.dimension) == (INVALID, "ip")
    auto = build_identity(["auto"], {"user": "42"}, hmac_key=KEY, hmac_key_version=1)
    assert auto.dimensions == ("user",)
    assert auto.pseudonym == independent_pseudonym([("user", "42")], KEY)


def test_normalised_client_entries_are_remembered_within_a_bound() -> None:
    from django_quota.core import identity as identity_module

    identity_module._normalized_entry.cache_clear()
    for host in range(identity_module.Bounds.MAX_NORMALIZED + 10):
        address = f"10.{host // 65536}.{host // 256 % 256}.{host % 256}"
        assert client_ip(address, None) == address
    remembered = identity_module._normalized_entry.cache_info().currsize
    assert 0 < remembered <= identity_module.Bounds.MAX_NORMALIZED
    # the same entry under another IPv6 prefix is its own entry
    assert client_ip("2001:db8::1", None, ipv6_prefix=64) == "2001:db8::/64"
    assert client_ip("2001:db8::1", None, ipv6_prefix=128) == "2001:db8::1"
    with pytest.raises(IdentityError):
        client_ip("10.0.0.256", None)  # a bad entry is never remembered as good
    with pytest.raises(IdentityError):
        client_ip("10.0.0.256", None)
