"""Outcome -> response: the rate-limit headers of recorded outcomes and the 429 or 503
problem response of a refusal, shared by the middleware, the decorator and the DRF
throttles (``docs/http.md``)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction
from django.http import HttpResponse
from django.utils.module_loading import import_string

from django_quota import conf, policies
from django_quota.core.log import logger
from django_quota.core.outcome import DENIED_DECISION, FAILED_CLOSED, Outcome
from django_quota.core.policy import CONCURRENCY, Form
from django_quota.signals import quota_denied


def item_name(policy: str, window: str, window_count: int) -> str:
    """The structured-field item name of a window: ``policy.window`` or ``policy``."""
    if window_count == 1 and window == Form.DEFAULT_WINDOW:
        return policy
    return f"{policy}.{window}"


def _enforced(policy_id: str) -> bool:
    # An allowed outcome does not say whether its policy is shadow: ask the registry.
    policy = policies.known_policy(policy_id)
    return policy is None or not policy.shadow


def _policy_item(name: str, policy_id: str, limit: int, period: float) -> str:
    """A ``RateLimit-Policy`` item: ``q`` the limit and ``w`` the period in seconds; a
    concurrency policy's without ``w``: it counts units in flight, over no time window
    (docs/http.md)."""
    policy = policies.known_policy(policy_id)
    if policy is not None and policy.algorithm == CONCURRENCY:
        return f'"{name}";q={limit}'
    return f'"{name}";q={limit};w={round(period)}'


def header_outcomes(found: Iterable[Outcome]) -> list[Outcome]:
    """Outcomes that produce headers: enforced, allowed or denied, with windows."""
    return [
        o
        for o in found
        if o.decision in ("allowed", DENIED_DECISION) and o.windows and _enforced(o.policy)
    ]


def _seconds_up(value: float) -> int:
    return max(0, math.ceil(value - 1e-9))


def _reported(found: Sequence[Outcome]) -> Outcome | None:
    denied = [o for o in found if o.decision == DENIED_DECISION]
    if denied:
        return min(
            enumerate(denied),
            key=lambda pair: (
                -(pair[1].retry_after or 0),
                -(pair[1].reported_window.period if pair[1].reported_window else 0),
                pair[0],
            ),
        )[1]
    if not found:
        return None
    return min(
        enumerate(found),
        key=lambda pair: (pair[1].remaining or 0, -(pair[1].reset_after or 0), pair[0]),
    )[1]


def rate_limit_headers(found: Iterable[Outcome], style: str) -> dict[str, str]:
    """Headers for recorded outcomes in ``style`` (``ietf``, ``legacy``, ``both``, ``none``).

    ``ietf`` follows draft-ietf-httpapi-ratelimit-headers-10: ``RateLimit-Policy`` and
    ``RateLimit`` Structured Field Lists, one item per window.
    """
    usable = header_outcomes(found)
    headers: dict[str, str] = {}
    if not usable or style == "none":
        return headers
    if style in ("ietf", "both"):
        policy_items = []
        limit_items = []
        for outcome in usable:
            for window in outcome.windows:
                name = item_name(outcome.policy, window.name, len(outcome.windows))
                policy_items.append(_policy_item(name, outcome.policy, window.limit, window.period))
                limit_items.append(
                    f'"{name}";r={window.remaining};t={_seconds_up(window.replenish_after)}'
                )
        headers["RateLimit-Policy"] = ", ".join(policy_items)
        headers["RateLimit"] = ", ".join(limit_items)
    if style in ("legacy", "both"):
        reported = _reported(usable)
        if reported is not None and reported.limit is not None:
            headers["X-RateLimit-Limit"] = str(reported.limit)
            headers["X-RateLimit-Remaining"] = str(reported.remaining)
            headers["X-RateLimit-Reset"] = str(_seconds_up(reported.reset_after or 0))
    return headers


def apply_headers(response: HttpResponse, found: Iterable[Outcome]) -> HttpResponse:
    """Write the configured rate-limit headers onto ``response`` (existing ones win)."""
    for name, value in rate_limit_headers(found, conf.get_settings().headers).items():
        if name not in response:
            response[name] = value
    return response


def retry_after_header(outcome: Outcome) -> str | None:
    """``Retry-After`` for a refusal: ``ceil(retry_after)``, at least 1; None when unknown."""
    if outcome.retry_after is None:
        return None
    return str(max(1, math.ceil(outcome.retry_after - 1e-9)))


def _violated(outcome: Outcome) -> list[str]:
    return [
        item_name(outcome.policy, window.name, len(outcome.windows))
        for window in outcome.windows
        if window.retry_after is not None
    ]


def problem_response(
    request: Any, outcome: Outcome, sender: object = None, *, announce: bool = True
) -> HttpResponse:
    """The 429 or 503 response for a refusing outcome (RFC 9457 problem+json), or the
    ``DENIED_VIEW``'s; sends ``quota_denied`` unless ``announce`` is False (the layer
    that refused already sent it)."""
    settings = conf.get_settings()
    if announce:
        quota_denied.send(sender=sender, request=request, outcome=outcome)
    if outcome.decision == FAILED_CLOSED:
        status = 503
        body: dict[str, object] = {
            "type": "about:blank",
            "title": "Service Unavailable",
            "status": 503,
            "detail": "The rate limiter could not decide and this policy fails closed.",
            "reason": outcome.reason,
            "policy": outcome.policy,
        }
    else:
        status = 429
        body = {
            "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
            "title": "Quota exceeded",
            "status": 429,
            "detail": _detail(outcome),
            "reason": outcome.reason,
            "policy": outcome.policy,
            "retry_after": outcome.retry_after,
            "violated-policies": _violated(outcome),
        }
    response: Any = None
    if settings.denied_view is not None:
        response = _denied_view(settings.denied_view, request, outcome)
    if response is None:
        response = HttpResponse(
            json.dumps(body), status=status, content_type="application/problem+json"
        )
    retry_after = retry_after_header(outcome)
    if retry_after is not None and "Retry-After" not in response:
        response["Retry-After"] = retry_after
    return response  # type: ignore[no-any-return]


def _denied_view(path: str, request: Any, outcome: Outcome) -> Any:
    """``DENIED_VIEW``'s response, or None when it raises: the default refusal is sent
    then, and the exception logged (docs/settings.md#when-a-projects-callable-fails)."""
    try:
        view = import_string(path)
        if iscoroutinefunction(view):
            view = async_to_sync(view)
        return view(request, outcome=outcome)
    except Exception:
        logger.exception("DENIED_VIEW %s raised: the default refusal is sent", path)
        return None


def _detail(outcome: Outcome) -> str:
    if outcome.reason and outcome.reason.endswith("_quota_exhausted"):
        return f"The {outcome.window} window of policy {outcome.policy} is exhausted."
    if outcome.reason == "cost_exceeds_limit":
        return f"The request costs more than policy {outcome.policy} can ever admit."
    return f"The request has no valid identity for policy {outcome.policy} ({outcome.reason})."
