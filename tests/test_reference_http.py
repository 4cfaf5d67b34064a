"""``docs/http.md`` against the HTTP edge: every example response on the page is what the
test client gets from ``QuotaMiddleware`` (same status, headers in order, body), the
``DENIED_VIEW`` shown is the one that ran, and every header the edge adds to a response
is named on the page."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import Client

from tests.doc_tables import code_blocks, page
from tests.test_middleware import CLOCK, dead_redis_url

PAGE = "http.md"
ORDERS = {
    "windows": {"burst": "2/m", "sustained": "5/h"},
    "selector": ["ip"],
    "routes": ["/api"],
}
#: The headers a refusal or the rate-limit headers add to a response.
EDGE_HEADERS = {
    "RateLimit-Policy", "RateLimit", "Retry-After",
    "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset",
    # Django's session middleware, because the edge read request.user (a user selector).
    "Vary",
}


def rate_limited(request: HttpRequest, outcome: Any) -> HttpResponse:
    if outcome.decision == "failed_closed":
        return HttpResponse("Try again in a moment.\n", status=503, content_type="text/plain")
    return HttpResponse(
        f"Too many requests ({outcome.reason}).\n", status=429, content_type="text/plain"
    )


def render(response: Any) -> str:
    """A response as the page shows it: status line, headers in order, blank line, body
    (JSON indented, for reading)."""
    lines = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}"]
    lines += [f"{name}: {value}" for name, value in response.headers.items()]
    body = response.content.decode()
    if "json" in response["Content-Type"]:
        body = json.dumps(json.loads(body), indent=2)
    return "\n".join([*lines, "", body.rstrip("\n")])


def examples(quota: Any) -> dict[str, Any]:
    """The responses the page shows, by name."""
    found: dict[str, Any] = {}
    quota(CLOCK=CLOCK, POLICIES={"orders": ORDERS})
    client = Client()
    found["allowed"] = client.get("/api/items/")
    client.get("/api/items/")
    found["denied"] = client.get("/api/items/")
    quota(CLOCK=CLOCK, HEADERS="both", POLICIES={"orders": ORDERS})
    found["both"] = Client().get("/api/items/")
    quota(CLOCK=CLOCK, POLICIES={"orders": {**ORDERS, "selector": ["user"]}})
    found["identity"] = Client().get("/api/items/")
    quota(REDIS_URL=dead_redis_url(), POLICIES={"orders": ORDERS})
    found["failed_closed"] = Client().get("/api/items/")
    view = f"{__name__}.rate_limited"
    quota(CLOCK=CLOCK, DENIED_VIEW=view, POLICIES={"orders": ORDERS})
    client = Client()
    client.get("/api/items/")
    client.get("/api/items/")
    found["denied_view"] = client.get("/api/items/")
    quota(REDIS_URL=dead_redis_url(), DENIED_VIEW=view, POLICIES={"orders": ORDERS})
    found["denied_view_failed"] = Client().get("/api/items/")
    return found


@pytest.fixture
def responses(quota: Any) -> dict[str, Any]:
    return examples(quota)


def test_the_example_responses_are_the_middleware_s(responses: dict[str, Any]) -> None:
    assert [responses[name].status_code for name in responses] == [
        200, 429, 200, 429, 503, 429, 503,
    ]
    blocks = code_blocks(page(PAGE))
    for name, response in responses.items():
        assert render(response) in blocks, f"{name}:\n{render(response)}"


def test_the_denied_view_shown_is_the_one_that_ran() -> None:
    assert inspect.getsource(rate_limited).rstrip("\n") in code_blocks(page(PAGE))


def test_every_header_the_edge_writes_is_named_on_the_page(
    responses: dict[str, Any], quota: Any
) -> None:
    quota(POLICIES={})
    baseline = set(Client().get("/api/items/").headers)
    written = {name for response in responses.values() for name in response.headers} - baseline
    # The exercise covers every header the edge has (a page cannot pass on an empty set).
    assert written == EDGE_HEADERS
    text = page(PAGE)
    for name in written | {"Content-Type"}:
        assert f"`{name}`" in text, name
    # The refusals' own content type (the others are the view's and DENIED_VIEW's).
    refusals = {responses[name]["Content-Type"] for name in ("denied", "identity", "failed_closed")}
    assert refusals == {"application/problem+json"}
    assert "`Content-Type: application/problem+json`" in text
