"""What a table of settings is built from: a :class:`Field` per key, the small parsers
it is made of (:func:`boolean`, :func:`number`, :func:`integer`, :func:`choice`,
:func:`optional`, :func:`string_list`, :func:`dotted_path`…), and the :class:`Reader` that
collects every problem of one pass. :mod:`django_quota.conf` holds the table itself."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django_quota.messages import Message, Problems

#: The largest number of seconds a setting takes (about 31.7 years): times travel to the
#: Redis scripts as milliseconds below 2**48.
MAX_SECONDS = 1e9


@dataclass(frozen=True, slots=True)
class SettingsProblem:
    """One invalid setting: the check id, the key as written, what is wrong, the fix."""

    id: str
    key: str
    message: str
    hint: str | None = None


class Invalid(Exception):
    """Raised by a parser: the value is reported, and the key takes its default instead."""

    def __init__(self, message: Message, **values: object) -> None:
        super().__init__(message.text)
        self.message = message
        self.values = values


class Reader:
    """What one :func:`~django_quota.conf.parse_settings` call knows: the key being
    read, the options it was given and every problem found so far."""

    def __init__(self, *, secret_key: str | bytes, with_policies: bool) -> None:
        self.secret_key = secret_key
        self.with_policies = with_policies
        self.problems: list[SettingsProblem] = []
        self.field: Field | None = None
        self.key = "QUOTA"
        #: ``TIMEZONE`` once read: the policies' default timezone.
        self.timezone = "UTC"

    def report(self, message: Message, key: str | None = None, /, **values: object) -> None:
        """Add a problem of ``key`` (the key being read when not given)."""
        text, hint = message.render(**values)
        self.problems.append(SettingsProblem(message.id, key or self.key, text, hint))

    def read(self, field: Field, value: Any) -> Any:
        """``value`` parsed by ``field``, or its default parsed when it is invalid."""
        self.field, self.key = field, key_of(field.key)
        try:
            return field.parse(value, self)
        except Invalid as invalid:
            self.report(invalid.message, **invalid.values)
            return field.parse(field.default, self)

    @property
    def default(self) -> Any:
        """The default of the key being read."""
        assert self.field is not None
        return self.field.default


#: Parses one value: returns what the settings hold, raises :class:`Invalid`, or
#: reports a problem that keeps the value.
Parse = Callable[[Any, Reader], Any]


@dataclass(frozen=True, slots=True)
class Field:
    """One key of ``settings.QUOTA``: its default and how it is parsed into the
    :class:`~django_quota.conf.QuotaSettings` attribute of its name in lower case."""

    key: str
    default: Any
    parse: Parse

    @property
    def attribute(self) -> str:
        """The ``QuotaSettings`` attribute this key fills."""
        return self.key.lower()


def key_of(name: str) -> str:
    """How a problem names the key ``name``: ``QUOTA['TIMEOUT']``."""
    return f"QUOTA[{name!r}]"


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


# -- the parsers ---------------------------------------------------------------------------
def boolean(value: Any, reader: Reader) -> bool:
    """``True`` or ``False``."""
    if not isinstance(value, bool):
        raise Invalid(Problems.EXPECTED_BOOLEAN, value=value)
    return value


def number(minimum: float, *, allow_zero: bool = False) -> Parse:
    """A number of seconds from ``minimum`` to :data:`MAX_SECONDS`, as a float."""

    def parse(value: Any, reader: Reader) -> float:
        # NaN compares false with everything, so it would pass the bound checks.
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not minimum <= value <= MAX_SECONDS
            or (value == 0 and not allow_zero)
        ):
            raise Invalid(
                Problems.EXPECTED_SECONDS, minimum=minimum, maximum=MAX_SECONDS, value=value
            )
        return float(value)

    return parse


def integer(minimum: int, maximum: int | None = None) -> Parse:
    """An integer from ``minimum`` (to ``maximum``, when given)."""
    message = Problems.EXPECTED_INTEGER_AT_LEAST
    if maximum is not None:
        message = Problems.EXPECTED_INTEGER_BETWEEN

    def parse(value: Any, reader: Reader) -> int:
        if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
            raise Invalid(message, minimum=minimum, maximum=maximum, value=value)
        return value  # type: ignore[no-any-return]

    return parse


def choice(choices: Sequence[str]) -> Parse:
    """One of ``choices``."""

    def parse(value: Any, reader: Reader) -> str:
        if value not in choices:
            raise Invalid(Problems.NOT_A_CHOICE, value=value, choices=", ".join(choices))
        return str(value)

    return parse


def optional(parse: Parse, message: Message | None = None) -> Parse:
    """None, or what ``parse`` takes; ``message`` (which says that None is allowed too)
    reports what neither is, with the values ``parse`` reported."""

    def parse_optional(value: Any, reader: Reader) -> Any:
        if value is None:
            return None
        try:
            return parse(value, reader)
        except Invalid as invalid:
            if message is None:
                raise
            raise Invalid(message, **invalid.values) from invalid

    return parse_optional


def _string(value: Any, reader: Reader) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(Problems.EXPECTED_OPTIONAL_STRING, value=value)
    return value


optional_string = optional(_string)


def _callable_path(value: Any, reader: Reader) -> str:
    from django.utils.module_loading import import_string

    path = _string(value, reader)
    try:
        target = import_string(path)
    except ImportError as exc:
        raise Invalid(Problems.CANNOT_IMPORT, value=path, error=exc) from exc
    if not callable(target):
        raise Invalid(Problems.NOT_CALLABLE, value=path)
    return path


#: None, or the dotted path of a callable (imported once, to check it).
dotted_path = optional(_callable_path)


def string_list(item: Callable[[str, Reader], Any] | None = None) -> Parse:
    """A list of non-empty strings, as a tuple; each passed through ``item`` when given,
    which reports what is wrong with one and returns what to keep (None: nothing)."""

    def parse(value: Any, reader: Reader) -> tuple[Any, ...]:
        if (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not all(isinstance(entry, str) and entry for entry in value)
        ):
            raise Invalid(Problems.EXPECTED_STRING_LIST, value=value)
        if item is None:
            return tuple(value)
        kept = (item(entry, reader) for entry in value)
        return tuple(entry for entry in kept if entry is not None)

    return parse


def one_of(choices: Sequence[str]) -> Callable[[str, Reader], str]:
    """A list item that is one of ``choices`` (reported, and kept, when not)."""

    def check(entry: str, reader: Reader) -> str:
        if entry not in choices:
            reader.report(Problems.NOT_A_CHOICE, value=entry, choices=", ".join(choices))
        return entry

    return check
