"""``QuotaMiddleware``: applies the policies whose ``routes`` and ``methods`` match, as one
layer (one backend call), and writes rate-limit headers for every outcome recorded on the
request on the way out. Sync and async capable."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponse

from django_quota import conf, http, policies, releasing
from django_quota.core.outcome import Outcome
from django_quota.core.policy import Policy
from django_quota.ledger import adecide, decide, ledger_of, outcomes
from django_quota.routes import path_matches, policy_applies
from django_quota.usage import is_usage_request


def login_refusal(request: HttpRequest) -> Outcome | None:
    """The outcome with which ``QuotaLoginBackend`` refused this request's login, if any
    (``django_quota.auth`` is imported only where ``django.contrib.auth`` is)."""
    auth = sys.modules.get("django_quota.auth")
    return None if auth is None else auth.refusal(request)


class QuotaMiddleware:
    """Rate-limit requests by the middleware policies of ``settings.QUOTA``.

    Place it after ``AuthenticationMiddleware`` (the ``user`` dimension is Django's
    session user; DRF authentication runs later, inside the view) and inside any CORS
    middleware (expose ``RateLimit``, ``RateLimit-Policy`` and ``Retry-After`` with
    ``Access-Control-Expose-Headers``). Never answers 500 for rate-limiting reasons:
    backend failures become 503 (fail closed) or pass (fail open).
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        group = self._matching(request, policies.get_registry())
        if group:
            decision = decide(request, group)
            if decision.refusing is not None:
                return self._finish(request, self._refuse(request, decision.refusing))
            if decision.held:  # concurrency leases: released when the response is done
                try:
                    response = self.get_response(request)
                except BaseException:
                    releasing.release(decision.held)
                    raise
                return self._finish(request, releasing.release_after(response, decision.held))
        return self._finish(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        group = self._matching(request, await policies.aget_registry())
        held: tuple[releasing.Held, ...] = ()
        if group:
            decision = await adecide(request, group)
            refusing = decision.refusing
            if refusing is not None:
                # quota_denied receivers and DENIED_VIEW are ordinary sync code (they may
                # query the database): run them in a thread, as Django runs sync views.
                refused = await sync_to_async(self._refuse)(request, refusing)
                return self._finish(request, refused)
            held = decision.held
        if held:  # concurrency leases: released when the response is done
            try:
                response = await self.get_response(request)
            except BaseException:
                await releasing.arelease(held)
                raise
            response = await releasing.arelease_after(response, held)
        else:
            response = await self.get_response(request)
        response = await self._alogin_refused(request, response)
        return self._finish(request, response)

    def _matching(self, request: HttpRequest, registry: policies.Registry) -> list[Policy]:
        settings = conf.get_settings()
        if not settings.enabled:
            return []
        path = request.path_info
        if any(path_matches(prefix, path) for prefix in settings.exempt_paths):
            return []
        ledger = ledger_of(request)
        decided = ledger.memo
        found = [
            policy
            for policy in registry.middleware
            if policy.id not in decided and policy_applies(policy, request, ledger)
        ]
        if found and is_usage_request(request, ledger):
            return []  # the usage view is never limited (docs/usage.md)
        return found

    def _refuse(self, request: HttpRequest, refusing: Outcome) -> HttpResponse:
        return http.problem_response(request, refusing, sender=self.__class__)

    def _finish(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if not self.is_async:
            response = self._login_refused(request, response)
        return http.apply_headers(response, outcomes(request))

    def _login_refused(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        """The 429 (or 503) instead of ``response`` when ``QuotaLoginBackend`` refused
        this request's login (docs/login.md); ``response`` otherwise."""
        refused = login_refusal(request)
        if refused is None:
            return response
        response.close()  # never sent: its resources (a streaming response's leases) go
        ledger_of(request).record([refused])
        return self._refuse(request, refused)

    async def _alogin_refused(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        """Async twin of :meth:`_login_refused`: the refusal is built in a thread."""
        if login_refusal(request) is None:
            return response
        return await sync_to_async(self._login_refused)(request, response)
