"""Inputs refused with a clear error, identically on every backend (``docs/subjects.md``,
``docs/failures.md``): identity values are ``str``, ``int`` or ``uuid.UUID`` (anything
else a ``TypeError`` naming the dimension and the type, never the value); evaluation ids
are printable strings of 1 to 128 characters (``ValueError``; a non-string
``TypeError``). Refused before any backend call: nothing is written.

The HTTP edge converts what requests carry (bytes from ``request.auth`` or a resolver,
objects) so that a request never raises."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from django.http import HttpRequest
from django.test import Client

import django_quota
from django_quota.core.identity import build_identity, normalize_value
from tests import test_limiter

#: The fixture parametrised over memory, fakeredis and a real redis-server.
configure = test_limiter.configure
POLICY = {"algorithm": "fixed_window", "windows": "3/h", "selector": ["user"]}


class Opaque:
    """An object whose ``str()`` differs per instance: a fresh budget per call."""


BAD_VALUES = [
    (Opaque(), "Opaque"),
    (b"42", "bytes"),
    (4.2, "float"),
    (["42"], "list"),
    (True, "bool"),
    ({"id": 42}, "dict"),
]


def keys(client: Any) -> list[bytes]:
    return [] if client is None else sorted(client.keys("*"))


# -- identity values ---------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "type_name"), BAD_VALUES)
def test_core_refuses_identity_values_of_other_types(value: object, type_name: str) -> None:
    message = (
        f"identity value of dimension 'user' must be str, int or uuid.UUID, not {type_name}"
    )
    with pytest.raises(TypeError) as caught:
        normalize_value("user", value, 64)
    assert str(caught.value) == message
    with pytest.raises(TypeError) as caught:
        build_identity(["user"], {"user": value}, hmac_key=b"k" * 32, hmac_key_version=1)
    assert str(caught.value) == message


@pytest.mark.parametrize(("value", "type_name"), BAD_VALUES)
def test_every_backend_refuses_identity_values_of_other_types(
    configure: Any, value: object, type_name: str
) -> None:
    client = configure(POLICIES={"p": POLICY})
    expected = f"identity value of dimension 'user' must be str, int or uuid.UUID, not {type_name}"
    calls = [
        lambda: django_quota.evaluate("p", {"user": value}),
        lambda: django_quota.peek("p", {"user": value}),
        lambda: django_quota.reset("p", {"user": value}),
        lambda: asyncio.run(django_quota.aevaluate("p", {"user": value})),
    ]
    for call in calls:
        with pytest.raises(TypeError) as caught:
            call()
        assert str(caught.value) == expected
    assert keys(client) == []


def test_int_and_uuid_identities_are_their_text(configure: Any) -> None:
    configure(POLICIES={"p": POLICY})
    token = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert django_quota.evaluate("p", {"user": 42}).remaining == 2
    assert django_quota.evaluate("p", {"user": "42"}).remaining == 1
    assert django_quota.evaluate("p", {"user": token}).remaining == 2
    assert django_quota.evaluate("p", {"user": str(token)}).remaining == 1


# -- evaluation ids ----------------------------------------------------------------------------
BAD_IDS: list[tuple[object, type[Exception], str]] = [
    (42, TypeError, "evaluation_id must be a str, not int"),
    (b"abc", TypeError, "evaluation_id must be a str, not bytes"),
    ("", ValueError, "evaluation_id must be 1 to 128 characters, not 0"),
    ("e" * 129, ValueError, "evaluation_id must be 1 to 128 characters, not 129"),
    ("bad\ud800id", ValueError, "evaluation_id must be printable text (no control characters "
                                "or lone surrogates)"),
    ("bad\nid", ValueError, "evaluation_id must be printable text (no control characters "
                            "or lone surrogates)"),
    ("\x00", ValueError, "evaluation_id must be printable text (no control characters "
                         "or lone surrogates)"),
]


@pytest.mark.parametrize(("value", "error", "message"), BAD_IDS)
def test_core_refuses_bad_evaluation_ids(
    value: object, error: type[Exception], message: str
) -> None:
    from django_quota.core.protocol import check_evaluation_id

    with pytest.raises(error) as caught:
        check_evaluation_id(value)
    assert type(caught.value) is error
    assert str(caught.value) == message


@pytest.mark.parametrize(("value", "error", "message"), BAD_IDS)
def test_every_backend_refuses_bad_evaluation_ids(
    configure: Any, value: Any, error: type[Exception], message: str
) -> None:
    client = configure(POLICIES={"p": POLICY})
    with pytest.raises(error) as caught:
        django_quota.evaluate("p", {"user": "42"}, evaluation_id=value)
    assert str(caught.value) == message
    with pytest.raises(error):
        asyncio.run(django_quota.aevaluate("p", {"user": "42"}, evaluation_id=value))
    assert keys(client) == []
    assert django_quota.peek("p", {"user": "42"}).remaining == 3


@pytest.mark.parametrize("value", ["e" * 128, "order 42 / ключ 🔑", "x"])
def test_printable_evaluation_ids_up_to_128_characters_work(configure: Any, value: str) -> None:
    configure(POLICIES={"p": POLICY})
    first = django_quota.evaluate("p", {"user": "42"}, evaluation_id=value)
    again = django_quota.evaluate("p", {"user": "42"}, evaluation_id=value)
    assert (first.decision, first.remaining, first.evaluation_id) == ("allowed", 2, value)
    assert (again.decision, again.remaining) == ("allowed", 2)


# -- the HTTP edge never raises ----------------------------------------------------------------
def bytes_key(request: HttpRequest) -> bytes:
    return "ключ".encode()


def latin1_bytes_key(request: HttpRequest) -> bytes:
    return b"\xff\xfe"


def object_tenant(request: HttpRequest) -> object:
    return Opaque()


@pytest.mark.django_db
def test_a_resolver_returning_utf8_bytes_is_its_text(quota: Any) -> None:
    quota(
        API_KEY_RESOLVER="tests.test_inputs.bytes_key",
        POLICIES={"k": {"windows": "2/m", "selector": ["api_key"], "routes": ["/api"]}},
    )
    client = Client()
    assert [client.get("/api/items/").status_code for _ in range(3)] == [200, 200, 429]
    assert django_quota.peek("k", {"api_key": "ключ"}).remaining == 0


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("setting", "dimension"), [("API_KEY_RESOLVER", "api_key"), ("TENANT_RESOLVER", "tenant")]
)
@pytest.mark.parametrize("resolver", ["latin1_bytes_key", "object_tenant"])
def test_a_resolver_returning_something_else_is_an_invalid_identity(
    quota: Any, setting: str, dimension: str, resolver: str
) -> None:
    quota(
        **{setting: f"tests.test_inputs.{resolver}"},
        POLICIES={"t": {"windows": "2/m", "selector": [dimension], "routes": ["/api"]}},
    )
    response = Client().get("/api/items/")
    assert response.status_code == 429
    assert [(o.decision, o.reason) for o in django_quota.outcomes(response.wsgi_request)] == [
        ("denied", "selector_identity_invalid")
    ]
