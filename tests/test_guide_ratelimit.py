"""docs/django-ratelimit.md, run: the page's django-quota snippets are executed as they are
written and the behaviour the page describes is checked through Django's test client, on
the memory backend with a frozen clock. django-ratelimit itself is not needed.

The page's ``python`` blocks fall into three kinds:

- settings blocks (they start with ``QUOTA = {``): their ``POLICIES`` are merged;
- definition blocks (imports, functions, classes): executed in order into one module
  namespace whose ``__name__`` is ``myapp.views``, so generated policy ids read
  ``view:myapp.views.<function>`` as on the page;
- usage blocks (statements at top level, like ``outcome = evaluate(...)``): executed in
  the test that checks them, once settings are in place.

The ``INSTALLED_APPS`` excerpt (with its ``...``) is the one block not run.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.urls import path

import django_quota
from django_quota import outcomes
from django_quota.decorators import quota as quota_decorator
from tests import clock

PAGE = Path(__file__).resolve().parent.parent / "docs" / "django-ratelimit.md"
MODULE = "myapp.views"
URLCONF = "tests.guide_ratelimit_urls"
#: A minute and an hour boundary, so that windows start with the test.
START = 1_764_000_000.0


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def is_settings(block: str) -> bool:
    return block.startswith("QUOTA = {")


def is_usage(block: str) -> bool:
    """Top-level statements other than imports, definitions and plain assignments."""
    for node in ast.parse(block).body:
        if isinstance(
            node,
            ast.Import | ast.ImportFrom | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
        ):
            continue
        return True
    return False


TEXT = PAGE.read_text()
BLOCKS = [block for block in python_blocks(TEXT) if "INSTALLED_APPS" not in block]
assert not any("django_ratelimit" in block for block in BLOCKS)
SETTINGS_BLOCKS = [block for block in BLOCKS if is_settings(block)]
DEFINITION_BLOCKS = [b for b in BLOCKS if not is_settings(b) and not is_usage(b)]
USAGE_BLOCKS = [b for b in BLOCKS if not is_settings(b) and is_usage(b)]


def page_policies() -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for block in SETTINGS_BLOCKS:
        namespace: dict[str, Any] = {}
        exec(block, namespace)
        merged.update(namespace["QUOTA"].get("POLICIES", {}))
    return merged


views = types.ModuleType(MODULE)
views.__dict__["__name__"] = MODULE
for block in DEFINITION_BLOCKS:
    exec(compile(block, f"{PAGE.name} (definitions)", "exec"), views.__dict__)
V = views.__dict__


def plain(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("plain")


urls = types.ModuleType(URLCONF)
urls.urlpatterns = [  # type: ignore[attr-defined]
    path("contact/", V["contact"]),
    path("dashboard/", V["dashboard"]),
    path("export/", V["export"]),
    path("profile/", V["profile"]),
    path("login/", V["login"]),
    path("search/", V["search"]),
    path("signup/", V["signup"]),
    path("comments/", plain),  # the middleware policy "comments" (routes /comments)
    path("comment-view/", V["CommentView"].as_view()),
    path("report.pdf", V["report_pdf"]),
    path("report.csv", V["report_csv"]),
    path("feed/", V["feed"]),
]
sys.modules[URLCONF] = urls

pytestmark = [pytest.mark.urls(URLCONF), pytest.mark.django_db]


@pytest.fixture(autouse=True)
def page_settings(quota: Any) -> None:
    clock.set_to(START)
    quota(CLOCK="tests.clock.now", POLICIES=page_policies())


def statuses(send: Any, count: int) -> list[int]:
    return [send().status_code for _ in range(count)]


def test_the_page_has_the_blocks_this_test_runs() -> None:
    assert len(SETTINGS_BLOCKS) >= 5
    assert len(DEFINITION_BLOCKS) >= 6
    assert len(USAGE_BLOCKS) == 1


def test_the_sixth_request_in_a_minute_gets_the_429_shown_on_the_page(client: Any) -> None:
    assert statuses(lambda: client.get("/contact/"), 5) == [200] * 5
    response = client.get("/contact/")
    assert response.status_code == 429
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "61"
    shown = re.search(r"^```json\n(.*?)^```$", TEXT, flags=re.MULTILINE | re.DOTALL)
    assert shown is not None
    assert json.loads(response.content) == json.loads(shown.group(1))
    assert "Retry-After: 61" in TEXT


def test_auto_counts_a_logged_in_user_apart_from_the_address(
    client: Any, django_user_model: Any
) -> None:
    first = client.get("/dashboard/")
    [anonymous] = outcomes(first.wsgi_request)
    assert (anonymous.policy, anonymous.remaining) == ("view:myapp.views.dashboard", 99)
    client.force_login(django_user_model.objects.create_user("ada"))
    [member] = outcomes(client.get("/dashboard/").wsgi_request)
    assert member.remaining == 99  # a counter of its own, not the address's


def test_api_key_selector_reads_the_header_and_refuses_a_request_without_it(
    client: Any,
) -> None:
    [first] = outcomes(client.get("/export/", HTTP_X_API_KEY="key-1").wsgi_request)
    assert first.remaining == 999
    [other] = outcomes(client.get("/export/", HTTP_X_API_KEY="key-2").wsgi_request)
    assert other.remaining == 999
    missing = client.get("/export/")
    assert missing.status_code == 429
    assert json.loads(missing.content)["reason"] == "selector_identity_missing"


def test_user_selector_refuses_anonymous_unless_the_policy_skips(client: Any) -> None:
    @quota_decorator(rate="20/m", selector="user")
    def strict(request: Any) -> Any:
        raise AssertionError("never reached")

    from django.test import RequestFactory

    request = RequestFactory().get("/strict/")
    from django.contrib.auth.models import AnonymousUser

    request.user = AnonymousUser()
    refused = strict(request)
    assert refused.status_code == 429
    assert "Retry-After" not in refused
    assert json.loads(refused.content)["reason"] == "selector_identity_missing"
    # The page's "profile" policy skips a missing user: anonymous requests pass, unlimited.
    assert statuses(lambda: client.get("/profile/"), 25) == [200] * 25
    [skipped] = outcomes(client.get("/profile/").wsgi_request)
    assert (skipped.policy, skipped.decision) == ("profile", "skipped")


def test_login_counts_per_submitted_username(client: Any) -> None:
    def attempt(username: str) -> int:
        return int(client.post("/login/", {"username": username}).status_code)

    assert [attempt("ada") for _ in range(5)] == [200] * 5
    refused = client.post("/login/", {"username": "ada"})
    assert refused.status_code == 429
    assert refused["Retry-After"] == "60"  # fixed_window, at the start of a minute
    assert attempt("grace") == 200  # another account, its own counter
    assert attempt("") == 429  # no username: selector_identity_missing
    assert client.get("/login/").status_code == 200  # GET is never counted


def test_search_chooses_the_policy_per_request(client: Any, django_user_model: Any) -> None:
    assert statuses(lambda: client.get("/search/"), 60) == [200] * 60
    assert client.get("/search/").status_code == 429  # visitors: 60 an hour per address
    client.force_login(django_user_model.objects.create_user("ada"))
    assert client.get("/search/").status_code == 200  # members: their own 600
    assert django_quota.peek("search-members", {"user": "1"}).limit == 600


def test_shadow_policy_lets_the_view_see_that_the_request_is_limited(client: Any) -> None:
    answers = [client.post("/signup/") for _ in range(6)]
    assert [a.status_code for a in answers] == [200] * 6
    assert [a.content for a in answers] == [b"welcome"] * 5 + [b"please solve the captcha first"]
    [limited] = outcomes(answers[-1].wsgi_request)
    assert (limited.decision, limited.reason) == ("shadow_denied", "default_quota_exhausted")
    assert "RateLimit" not in answers[-1]


def test_methods_middleware_policy_counts_only_posts(client: Any) -> None:
    assert statuses(lambda: client.get("/comments/"), 7) == [200] * 7
    assert statuses(lambda: client.post("/comments/"), 6) == [200] * 5 + [429]


def test_method_decorator_on_post_leaves_get_alone(client: Any) -> None:
    assert statuses(lambda: client.get("/comment-view/"), 7) == [200] * 7
    assert statuses(lambda: client.post("/comment-view/"), 6) == [200] * 5 + [429]
    refused = client.post("/comment-view/")
    assert json.loads(refused.content)["policy"] == "view:myapp.views.commentview.post"


def test_a_named_policy_is_shared_like_a_group(client: Any) -> None:
    sent = [client.get("/report.pdf" if n % 2 else "/report.csv") for n in range(10)]
    assert [response.status_code for response in sent] == [200] * 10
    assert client.get("/report.pdf").status_code == 429
    assert client.get("/report.csv").status_code == 429


def test_two_windows_in_one_decision(client: Any) -> None:
    assert statuses(lambda: client.get("/feed/"), 11) == [200] * 10 + [429]
    refused = client.get("/feed/")
    assert json.loads(refused.content)["reason"] == "burst_quota_exhausted"
    clock.set_to(START + 2)  # the burst window and the one before it are empty again
    [allowed] = outcomes(client.get("/feed/").wsgi_request)
    assert allowed.decision == "allowed"
    sustained = next(window for window in allowed.windows if window.name == "sustained")
    assert sustained.remaining == 89  # 10 + 1 admitted; the refused requests charged nothing


def test_stacked_rate_decorators_share_one_id_so_the_inner_rate_is_lost(client: Any) -> None:
    # The page's warning: what two @quota(rate=...) on one view really do.
    @quota_decorator(rate="5/h", selector="ip")
    @quota_decorator(rate="2/h", selector="ip")
    def stacked(request: Any) -> Any:
        from django.http import HttpResponse

        return HttpResponse("ok")

    from django.test import RequestFactory

    sent = [stacked(RequestFactory().get("/stacked/")).status_code for _ in range(6)]
    assert sent == [200] * 5 + [429]  # 5/h applies; 2/h never does


def test_stacked_named_policies_both_apply(quota: Any) -> None:
    quota(
        CLOCK="tests.clock.now",
        POLICIES={
            "per-key": {"windows": "5/h", "selector": ["api_key"]},
            "per-address": {"windows": "2/h", "selector": ["ip"]},
        },
    )

    @quota_decorator("per-key")
    @quota_decorator("per-address")
    def stacked(request: Any) -> Any:
        from django.http import HttpResponse

        return HttpResponse("ok")

    from django.test import RequestFactory

    sent = [
        stacked(RequestFactory().get("/", HTTP_X_API_KEY=f"key-{n}")).status_code for n in range(3)
    ]
    assert sent == [200, 200, 429]  # fresh keys, one address: per-address refuses


def test_rates_the_page_says_are_refused() -> None:
    for rate in ("100/300", "0/m"):
        with pytest.raises(ImproperlyConfigured):
            quota_decorator(rate=rate)(plain)
    for rate in ("10/minute", "2/hours", "100/5m"):
        quota_decorator(rate=rate)(plain)


def test_evaluate_and_peek_block_as_on_the_page() -> None:
    [block] = USAGE_BLOCKS
    namespace: dict[str, Any] = {}
    exec(compile(block, f"{PAGE.name} (usage)", "exec"), namespace)
    outcome, state = namespace["outcome"], namespace["state"]
    assert (outcome.allowed, outcome.remaining) == (True, 9)
    assert state.remaining == 9
    assert "outcome.remaining    # 9 after" in block and "state.remaining      # still 9" in block
    with pytest.raises(django_quota.policies.UnknownPolicy):
        django_quota.evaluate("no-such-policy", {"user": "42"})


def test_quota_decorator_ignores_a_policy_s_methods(quota: Any) -> None:
    # The page: a policy's routes and methods are read by QuotaMiddleware only.
    quota(
        CLOCK="tests.clock.now",
        POLICIES={"posts-only": {"windows": "2/m", "selector": ["ip"], "methods": ["POST"]}},
    )

    @quota_decorator("posts-only")
    def view(request: Any) -> Any:
        from django.http import HttpResponse

        return HttpResponse("ok")

    from django.test import RequestFactory

    sent = [view(RequestFactory().get("/")).status_code for _ in range(3)]
    assert sent == [200, 200, 429]  # GET requests are counted all the same
