"""``evaluate.lua``'s reply as the client reads it (``protocol.parse_reply``, whose one
policy, one window call is unrolled): a malformed reply is a ``ValueError`` with the same
cause whichever path reads it, and a request's KEYS keep the counters and calls paired."""

from __future__ import annotations

import pytest

from django_quota.core.calls import GROUP_DECIDED, REFUSED, PolicyCall
from django_quota.core.policy import Window
from django_quota.core.protocol import GroupRequest, parse_reply

HOUR = Window("hour", 10, 3_600_000, 10)
NOW = 1_800_000_000_000  # ms, on a whole hour


def test_a_one_window_reply_gives_the_model_numbers() -> None:
    call = PolicyCall("fixed_window", (HOUR,), 3)
    reply = parse_reply([GROUP_DECIDED, NOW + 60_000, 4], [call], False)
    (result,) = reply.results
    assert (reply.status, result.now_ms) == (GROUP_DECIDED, NOW + 60_000)
    assert tuple(result.windows[0]) == (3, 3_540_000, -1, 3_540_000)  # 4 used + 3 charged
    denied = parse_reply([GROUP_DECIDED, NOW + 60_000, 8], [call], False).results[0]
    assert denied.status == REFUSED
    assert tuple(denied.windows[0]) == (2, 3_540_000, 3_540_000, 3_540_000)  # nothing charged


@pytest.mark.parametrize(
    ("algorithm", "reply", "message"),
    [
        ("fixed_window", [GROUP_DECIDED, NOW], "shorter than its windows"),
        ("sliding_window", [GROUP_DECIDED, NOW, 1], "shorter than its windows"),
        ("fixed_window", [GROUP_DECIDED, NOW, 1, 2], "longer than its windows"),
        # A bad number is reported before the length, as the group loop reports it.
        ("fixed_window", [GROUP_DECIDED, NOW, "x", 2], "invalid literal"),
        ("token_bucket", [GROUP_DECIDED, NOW, 1, "x"], "longer than its windows"),
    ],
)
def test_a_malformed_one_window_reply_is_a_value_error(
    algorithm: str, reply: list[object], message: str
) -> None:
    call = PolicyCall(algorithm, (HOUR,), 1)
    with pytest.raises(ValueError, match=message):
        parse_reply(reply, [call], False)  # type: ignore[arg-type]


def test_keys_of_counters_and_calls_that_do_not_pair_are_refused() -> None:
    one = PolicyCall("fixed_window", (HOUR,), 1)
    request = GroupRequest(("c1", "c2"), (one,), None, False, -1, 5_000, 1_000)
    with pytest.raises(ValueError, match="zip"):
        request.keys()
    assert GroupRequest(("c1",), (one,), None, False, -1, 5_000, 1_000).keys() == ("c1",)
