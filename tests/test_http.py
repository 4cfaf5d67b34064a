"""Unit tests of ``django_quota.http``: route matching, subjects, headers and problem
responses, built from a ``RequestFactory`` and hand-made outcomes (docs/policies.md, subjects.md,
http.md).

Also home of :func:`parse_sf_list`, the tiny Structured Field parser (RFC 8941 lists of
string items with integer parameters) that the header tests use."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import RequestFactory
from django.urls import include, path

from django_quota import http, ledger, routes, subjects
from django_quota.core.outcome import Outcome, WindowState
from django_quota.core.policy import parse_policy

SfList = list[tuple[str, dict[str, int]]]


# -- a test-only Structured Field parser ---------------------------------------------------
def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _sf_string(text: str, pos: int) -> tuple[str, int]:
    assert text[pos] == '"', f"expected a string item at {pos}: {text!r}"
    pos += 1
    out = []
    while True:
        char = text[pos]
        pos += 1
        if char == "\\":
            escaped = text[pos]
            assert escaped in '"\\', f"bad escape in {text!r}"
            out.append(escaped)
            pos += 1
        elif char == '"':
            return "".join(out), pos
        else:
            assert 0x20 <= ord(char) < 0x7F, f"bad character in {text!r}"
            out.append(char)


def _sf_key(text: str, pos: int) -> tuple[str, int]:
    start = pos
    assert text[pos] == "*" or text[pos].islower(), f"bad key at {pos}: {text!r}"
    pos += 1
    while pos < len(text) and (
        text[pos].islower() or text[pos].isdigit() or text[pos] in "_-.*"
    ):
        pos += 1
    return text[start:pos], pos


def _sf_integer(text: str, pos: int) -> tuple[int, int]:
    start = pos
    if text[pos] == "-":
        pos += 1
    digits = pos
    while pos < len(text) and text[pos].isdigit():
        pos += 1
    assert 1 <= pos - digits <= 15, f"bad integer at {start}: {text!r}"
    assert pos == len(text) or text[pos] != ".", f"decimals are not integers: {text!r}"
    return int(text[start:pos]), pos


def parse_sf_list(text: str) -> SfList:
    """Parse an RFC 8941 List whose members are string items with integer parameters;
    assert on anything else (so a malformed header fails the test)."""
    items: SfList = []
    pos = _skip(text, 0, " ")
    if pos == len(text):
        return items
    while True:
        name, pos = _sf_string(text, pos)
        params: dict[str, int] = {}
        while pos < len(text) and text[pos] == ";":
            pos = _skip(text, pos + 1, " ")
            key, pos = _sf_key(text, pos)
            assert pos < len(text) and text[pos] == "=", f"parameter {key} has no value"
            assert key not in params, f"parameter {key} repeated"
            params[key], pos = _sf_integer(text, pos + 1)
        items.append((name, params))
        pos = _skip(text, pos, " \t")
        if pos == len(text):
            return items
        assert text[pos] == ",", f"expected ',' at {pos}: {text!r}"
        pos = _skip(text, pos + 1, " \t")
        assert pos < len(text), f"trailing comma: {text!r}"


def test_sf_parser_reads_string_items_with_integer_parameters() -> None:
    parsed = parse_sf_list('"orders.burst";q=10;w=1, "a\\"b";r=-3;t=0,"c"')
    assert parsed == [("orders.burst", {"q": 10, "w": 1}), ('a"b', {"r": -3, "t": 0}), ("c", {})]


@pytest.mark.parametrize("text", ['"a";q=1.5', "a;q=1", '"a",', '"a";q', '"a" "b"'])
def test_sf_parser_rejects_malformed_lists(text: str) -> None:
    with pytest.raises(AssertionError):
        parse_sf_list(text)


# -- helpers -------------------------------------------------------------------------------
factory = RequestFactory()


def policy(policy_id: str = "api", **definition: Any) -> Any:
    return parse_policy(policy_id, {"windows": "3/m", **definition}, source="settings")


def window(name: str = "default", **values: Any) -> WindowState:
    fields: dict[str, Any] = {
        "limit": 3,
        "period": 60.0,
        "remaining": 2,
        "reset_after": 39.6,
        "retry_after": None,
        "replenish_after": 39.6,
    }
    fields.update(values)
    return WindowState(name=name, **fields)


def outcome(policy_id: str = "api", decision: str = "allowed", **values: Any) -> Outcome:
    windows = values.pop("windows", (window(),))
    first = windows[0] if windows else None
    fields: dict[str, Any] = {
        "reason": None,
        "window": first.name if first else None,
        "limit": first.limit if first else None,
        "remaining": first.remaining if first else None,
        "reset_after": first.reset_after if first else None,
        "retry_after": None,
        "windows": windows,
    }
    fields.update(values)
    return Outcome(policy=policy_id, decision=decision, **fields)


# -- routes ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prefix", "path", "expected"),
    [
        ("/api", "/api", True),
        ("/api", "/api/", True),
        ("/api", "/api/items/", True),
        ("/api/", "/api/items/", True),
        ("/api", "/apiary/", False),
        ("/api", "/ap", False),
        ("/api/items", "/api/items/", True),
        ("/api/items", "/api/itemsx/", False),
        ("/", "/anything/", True),
    ],
)
def test_path_prefix_matches_whole_segments(prefix: str, path: str, expected: bool) -> None:
    assert routes.path_matches(prefix, path) is expected


@pytest.mark.parametrize(
    ("route", "path", "expected"),
    [
        ("*", "/nowhere/", True),
        ("/api", "/api/items/", True),
        ("/api", "/apiary/", False),
        ("api:*", "/api/items/", True),
        ("api:*", "/api/v2/items/", True),
        ("api:*", "/apiary/", False),
        ("api:*", "/nowhere/", False),
        ("api:v2:*", "/api/v2/items/", True),
        ("api:v2:*", "/api/items/", False),
        ("ap:*", "/api/items/", False),
        ("api:items", "/api/items/", True),
        ("api:items", "/api/v2/items/", False),
        ("api:v2:items", "/api/v2/items/", True),
        ("api:items", "/api/search/", False),
        ("health", "/health/", True),
        ("health", "/nowhere/", False),
    ],
)
def test_route_entry_matches_prefix_namespace_or_view_name(
    route: str, path: str, expected: bool
) -> None:
    assert routes.route_matches(route, factory.get(path)) is expected


def test_path_prefix_matches_path_info_not_the_script_name() -> None:
    request = factory.get("/api/items/", SCRIPT_NAME="/mount")
    assert request.path == "/mount/api/items/"
    assert routes.route_matches("/api", request) is True
    assert routes.route_matches("/mount", request) is False


def test_route_matching_honours_request_urlconf() -> None:
    request = factory.get("/items/")
    request.urlconf = "tests.test_http"
    assert routes.route_matches("other:*", request) is True
    assert routes.route_matches("api:*", request) is False


@pytest.mark.parametrize(
    ("methods", "method", "expected"),
    [
        ([], "GET", True),
        ([], "HEAD", True),
        ([], "OPTIONS", True),
        (["POST"], "POST", True),
        (["POST"], "GET", False),
        (["GET"], "HEAD", False),
        (["GET"], "OPTIONS", False),
        (["GET", "HEAD"], "HEAD", True),
        (["OPTIONS"], "OPTIONS", True),
    ],
)
def test_methods_filter_and_head_options_only_when_listed(
    methods: list[str], method: str, expected: bool
) -> None:
    request = factory.generic(method, "/api/items/")
    assert routes.policy_applies(policy(routes=["/api"], methods=methods), request) is expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/api/items/", "api:items"),
        ("/api/v2/items/", "api:v2:items"),
        ("/plain/7/", "plain/<int:pk>/"),
        ("/nowhere/", "-"),
    ],
)
def test_route_dimension_is_view_name_else_pattern_else_dash(path: str, expected: str) -> None:
    assert routes.route_value(factory.get(path)) == expected


# -- subjects --------------------------------------------------------------------------------
class _User:
    def __init__(self, pk: int | None) -> None:
        self.pk = pk
        self.is_authenticated = pk is not None


def test_subject_reads_ip_and_user_per_selector(quota: Any) -> None:
    quota()
    request = factory.get("/api/items/", REMOTE_ADDR="203.0.113.9")
    request.user = _User(42)  # type: ignore[assignment]
    subject = subjects.RequestSubject(request)
    assert subject.for_policy(policy(selector=["ip"])) == {"ip": "203.0.113.9"}
    assert subject.for_policy(policy(selector=["user", "ip"])) == {
        "user": "42",
        "ip": "203.0.113.9",
    }
    assert subject.for_policy(policy(selector=["auto"])) == {"user": "42"}
    assert subject.for_policy(policy(selector=["route"])) == {"route": "api:items"}


def test_auto_selector_uses_ip_for_anonymous_and_ignores_raw_api_key(quota: Any) -> None:
    quota()
    request = factory.get("/api/items/", REMOTE_ADDR="203.0.113.9", HTTP_X_API_KEY="k1")
    request.user = _User(None)  # type: ignore[assignment]
    subject = subjects.RequestSubject(request)
    assert subject.for_policy(policy(selector=["auto"])) == {"ip": "203.0.113.9"}
    assert subject.for_policy(policy(selector=["api_key"])) == {"api_key": "k1"}
    assert subject.for_policy(policy(selector=["user"])) == {"user": None}


def test_unparseable_client_ip_is_passed_on_as_invalid_not_missing(quota: Any) -> None:
    quota()
    subject = subjects.RequestSubject(factory.get("/", REMOTE_ADDR="garbage"))
    value = subject.for_policy(policy(selector=["ip"]))["ip"]
    assert value is not None and value != ""


def test_request_ip_honours_trusted_proxies(quota: Any) -> None:
    quota(TRUSTED_PROXIES=["10.0.0.0/8"])
    request = factory.get("/", REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR="198.51.100.7")
    assert subjects.request_ip(request) == "198.51.100.7"


# -- headers ---------------------------------------------------------------------------------
def test_item_name_is_policy_alone_for_a_single_default_window() -> None:
    assert http.item_name("api", "default", 1) == "api"
    assert http.item_name("api", "burst", 2) == "api.burst"
    assert http.item_name("api", "hourly", 1) == "api.hourly"


def test_ietf_headers_list_every_window_of_every_outcome(quota: Any) -> None:
    quota()
    found = [
        outcome(
            "orders",
            windows=(
                window("burst", limit=10, period=1.0, remaining=3, replenish_after=0.2),
                window("sustained", limit=1000, period=3600.0, remaining=990,
                       replenish_after=1799.01),
            ),
        ),
        outcome("api", windows=(window(remaining=2, replenish_after=39.6),)),
    ]
    headers = http.rate_limit_headers(found, "ietf")
    assert set(headers) == {"RateLimit-Policy", "RateLimit"}
    assert parse_sf_list(headers["RateLimit-Policy"]) == [
        ("orders.burst", {"q": 10, "w": 1}),
        ("orders.sustained", {"q": 1000, "w": 3600}),
        ("api", {"q": 3, "w": 60}),
    ]
    assert parse_sf_list(headers["RateLimit"]) == [
        ("orders.burst", {"r": 3, "t": 1}),
        ("orders.sustained", {"r": 990, "t": 1800}),
        ("api", {"r": 2, "t": 40}),
    ]


@pytest.mark.parametrize(
    ("decision", "reason", "windows"),
    [
        ("shadow_denied", "default_quota_exhausted", (window(),)),
        ("skipped", "selector_identity_missing", ()),
        ("failed_open", "backend_unavailable", ()),
        ("failed_closed", "backend_unavailable", ()),
        ("denied", "selector_identity_invalid", ()),
        ("denied", "cost_exceeds_limit", ()),
    ],
)
def test_outcomes_without_a_quota_decision_produce_no_headers(
    quota: Any, decision: str, reason: str, windows: tuple[WindowState, ...]
) -> None:
    quota()
    found = [outcome(decision=decision, reason=reason, windows=windows)]
    assert http.rate_limit_headers(found, "both") == {}


def test_allowed_outcome_of_a_shadow_policy_produces_no_headers(quota: Any) -> None:
    quota(POLICIES={"watch": {"windows": "3/m", "enforcement": "shadow", "routes": ["*"]}})
    assert http.rate_limit_headers([outcome("watch")], "both") == {}


def test_legacy_headers_report_the_window_with_least_remaining_across_policies() -> None:
    found = [
        outcome("a", windows=(window(limit=10, remaining=7, reset_after=12.2),)),
        outcome("b", windows=(window(limit=5, remaining=1, reset_after=30.001),)),
    ]
    assert http.rate_limit_headers(found, "legacy") == {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": "1",
        "X-RateLimit-Reset": "31",
    }


def test_legacy_headers_report_the_denied_window_with_the_longest_retry() -> None:
    found = [
        outcome("a", windows=(window(limit=10, remaining=0, reset_after=3.0),)),
        outcome(
            "b",
            decision="denied",
            reason="default_quota_exhausted",
            retry_after=20.5,
            windows=(window(limit=5, remaining=0, reset_after=20.5, retry_after=20.5),),
        ),
    ]
    assert http.rate_limit_headers(found, "legacy") == {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "21",
    }


def test_header_style_none_writes_nothing() -> None:
    assert http.rate_limit_headers([outcome()], "none") == {}


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [(None, None), (0.0, "1"), (0.001, "1"), (1.0, "1"), (1.001, "2"), (39.6, "40")],
)
def test_retry_after_is_ceiled_and_at_least_one(
    retry_after: float | None, expected: str | None
) -> None:
    denied = outcome(decision="denied", reason="default_quota_exhausted", retry_after=retry_after)
    assert http.retry_after_header(denied) == expected


def test_refusal_prefers_a_denial_over_a_failure_and_the_longest_retry() -> None:
    failed = outcome("f", decision="failed_closed", reason="backend_unavailable", windows=(),
                     retry_after=1.0)
    short = outcome("s", decision="denied", reason="default_quota_exhausted", retry_after=2.0)
    long = outcome("l", decision="denied", reason="default_quota_exhausted", retry_after=9.0)
    assert ledger.refusal([outcome(), failed]) is failed
    assert ledger.refusal([failed, short, long]) is long
    assert ledger.refusal([outcome(), outcome("b", decision="shadow_denied")]) is None


def test_problem_response_lists_the_violated_windows(quota: Any) -> None:
    quota()
    denied = outcome(
        "orders",
        decision="denied",
        reason="sustained_quota_exhausted",
        window="sustained",
        retry_after=1800.0,
        windows=(
            window("burst", limit=10, period=1.0, remaining=0, retry_after=0.5),
            window("sustained", limit=20, period=3600.0, remaining=0, retry_after=1800.0),
            window("daily", limit=500, period=86400.0, remaining=480),
        ),
    )
    response = http.problem_response(factory.get("/"), denied)
    assert response.status_code == 429
    assert response["Retry-After"] == "1800"
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content) == {
        "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
        "title": "Quota exceeded",
        "status": 429,
        "detail": "The sustained window of policy orders is exhausted.",
        "reason": "sustained_quota_exhausted",
        "policy": "orders",
        "retry_after": 1800.0,
        "violated-policies": ["orders.burst", "orders.sustained"],
    }


# -- a second URLconf, for ``request.urlconf`` ------------------------------------------------
def _other_view(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("other")


urlpatterns = [
    path("items/", include(([path("", _other_view, name="items")], "other"))),
]
