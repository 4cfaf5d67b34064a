"""The process's state outside the limiter and the registry lives in one object,
``django_quota.core.process.PROCESS``: a settings change forgets what follows the
settings, ``clear()`` forgets every cache, and the context flags are each context's own."""

from __future__ import annotations

import contextvars
from typing import Any

from django_quota import policies
from django_quota.core.process import PROCESS


def _never(request: Any) -> bool:
    return False


def test_a_settings_change_forgets_the_exempt_when_predicates(settings: Any) -> None:
    PROCESS.exempt_when["tests.test_process_state._never"] = _never
    settings.DEBUG = not settings.DEBUG  # a watched setting: AppConfig.ready() connected this
    assert PROCESS.exempt_when == {}


def test_clear_forgets_every_cache_and_keeps_the_backends_alive() -> None:
    class Resolver:
        pass

    class Backend:
        pass

    resolver, backend = Resolver(), Backend()
    PROCESS.exempt_when["tests.test_process_state._never"] = _never
    PROCESS.mounted[resolver] = True
    PROCESS.handshakes[Resolver] = Backend
    PROCESS.backends.add(backend)
    try:
        PROCESS.clear()
        caches = (dict(PROCESS.exempt_when), dict(PROCESS.mounted), PROCESS.handshakes)
        assert caches == ({}, {}, {})
        assert backend in PROCESS.backends
    finally:
        PROCESS.backends.discard(backend)


def test_the_checking_flag_is_set_in_this_context_only() -> None:
    seen_elsewhere: list[bool] = []
    with policies.checking():
        assert PROCESS.checking.get() is True
        contextvars.Context().run(lambda: seen_elsewhere.append(PROCESS.checking.get()))
    assert (PROCESS.checking.get(), seen_elsewhere) == (False, [False])
