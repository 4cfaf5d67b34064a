"""django-quota: exact, distributed rate limits and quotas for Django and DRF.

The Python API (``docs/failures.md``, ``docs/arithmetic.md``)::

    from django_quota import evaluate, peek, reset, Outcome
    outcome = evaluate("orders", {"user": "42"}, cost=1)

The functions are imported lazily so that importing ``django_quota`` never touches
settings or the network.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Outcome",
    "WindowState",
    "aevaluate",
    "apeek",
    "arefund",
    "arelease",
    "areset",
    "evaluate",
    "outcomes",
    "peek",
    "refund",
    "release",
    "reset",
]

if TYPE_CHECKING:
    from django_quota.core.outcome import Outcome, WindowState
    from django_quota.ledger import outcomes
    from django_quota.limiter import (
        aevaluate,
        apeek,
        arefund,
        arelease,
        areset,
        evaluate,
        peek,
        refund,
        release,
        reset,
    )

_LAZY = MappingProxyType(
    {
        "Outcome": "django_quota.core.outcome",
        "WindowState": "django_quota.core.outcome",
        "evaluate": "django_quota.limiter",
        "aevaluate": "django_quota.limiter",
        "peek": "django_quota.limiter",
        "apeek": "django_quota.limiter",
        "reset": "django_quota.limiter",
        "release": "django_quota.limiter",
        "arelease": "django_quota.limiter",
        "refund": "django_quota.limiter",
        "arefund": "django_quota.limiter",
        "areset": "django_quota.limiter",
        "outcomes": "django_quota.ledger",
    }
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'django_quota' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function and the import machinery
    return value
