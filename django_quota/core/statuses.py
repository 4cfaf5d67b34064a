"""Which responses keep their charge: a policy's ``count_when`` key, HTTP statuses and
classes (``docs/refunds.md``)."""

from __future__ import annotations

from collections.abc import Sequence

from django_quota.core.errors import ConfigurationError


def parse_count_when(value: object, key: str) -> tuple[int | str, ...] | None:
    """A policy's ``count_when`` key (``docs/refunds.md``): None (every request counts)
    or a non-empty list of HTTP statuses (ints 100 to 599) and classes (``"2xx"``, any
    case). Not part of the revision: which responses count changes no counter's layout
    or meaning per unit. Raises :class:`ConfigurationError` naming the bad entry."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ConfigurationError(
            key, 'expected None or a non-empty list of statuses and classes, e.g. ["2xx"]'
        )
    classes = ("1xx", "2xx", "3xx", "4xx", "5xx")  # the classes ``count_when`` accepts
    found: list[int | str] = []
    for index, entry in enumerate(value):
        if isinstance(entry, str) and entry.lower() in classes:
            found.append(entry.lower())
        elif isinstance(entry, int) and not isinstance(entry, bool) and 100 <= entry <= 599:
            found.append(entry)
        else:
            raise ConfigurationError(
                f"{key}[{index}]",
                f"{entry!r} is not an HTTP status (100 to 599) or a class "
                f"({', '.join(classes)})",
            )
    return tuple(found)
