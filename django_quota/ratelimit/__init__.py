"""django-ratelimit 4.x on django-quota's engine (``docs/django-ratelimit.md``).

A project moves by changing its import lines from ``django_ratelimit`` to
``django_quota.ratelimit``: ``decorators.ratelimit``, ``core.is_ratelimited`` and
``core.get_usage``, ``exceptions.Ratelimited``, ``middleware.RatelimitMiddleware``, with
django-ratelimit's arguments, ``request.limited`` and ``RATELIMIT_*`` settings. Each
decision is one evaluation of this app's engine: atomic on Redis, identities
pseudonymised, typed outcomes, metrics and failure modes.

This module imports nothing of Django, as django-ratelimit's own does not.
"""

from __future__ import annotations

__all__ = ["ALL", "UNSAFE"]

#: ``method=ALL``: every HTTP method (django-ratelimit's sentinel, the same value).
ALL: tuple[None] = (None,)
#: ``method=UNSAFE``: the methods that change state.
UNSAFE: list[str] = ["DELETE", "PATCH", "POST", "PUT"]
