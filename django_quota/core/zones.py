"""The timezone names a policy and ``QUOTA["TIMEZONE"]`` may use: IANA zone names
``zoneinfo`` knows, and not the host's own files (``docs/policies.md``, "Calendar
windows")."""

from __future__ import annotations

import zoneinfo

from django_quota.core.errors import ConfigurationError


def host_zone(value: str) -> bool:
    """True for a name the host's zoneinfo opens that is no IANA zone name.

    A file of the zoneinfo database that is no zone's name: the host's own zone
    (``localtime``), a copy of some default (``posixrules``), a placeholder (``Factory``);
    each host may hold another zone under them, so two processes would cut a calendar day
    at different instants on one counter. Or a name under a directory of alternative
    copies: ``posix/`` repeats the zones, ``right/`` counts leap seconds, which Python's
    datetime does not.
    """
    return value in {"localtime", "posixrules", "Factory"} or value.startswith(
        ("posix/", "right/")
    )


def parse_timezone(value: object, key: str) -> str:
    """``value`` when it names an IANA timezone ``zoneinfo`` knows (``"Europe/Berlin"``,
    ``"UTC"``), else :class:`ConfigurationError` naming ``key``; also for a name that is
    the host's and no IANA zone's (``"localtime"``: :func:`host_zone`)."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(
            key, f"a timezone is an IANA name like 'Europe/Berlin', not {value!r}"
        )
    if host_zone(value):
        raise ConfigurationError(
            key,
            f"{value!r} is this host's zoneinfo file, not an IANA zone name: every process "
            "must cut days at the same instant; name the zone, like 'Europe/Berlin'",
        )
    try:
        zoneinfo.ZoneInfo(value)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ConfigurationError(
            key, f"unknown timezone {value!r}; use an IANA name like 'Europe/Berlin'"
        ) from None
    return value
