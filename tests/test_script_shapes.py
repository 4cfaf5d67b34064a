"""The evaluation script specialised per policy shape (django_quota/scripts/shapes.py,
docs/architecture.md#the-script-protocol): the general script is evaluate.lua as it is;
each variant, generated from it, holds its own algorithm's code and no other's, no loop
over policies or windows; the backend picks a script by the group's shape and recovers
NOSCRIPT for each. The differential tests hold every script to the model."""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import lupa.lua51 as lua51
import pytest
import redis

from django_quota.backends.redis import RedisBackend
from django_quota.backends.scripting import evaluate_call, sources
from django_quota.core.calls import PolicyCall
from django_quota.core.policy import Window
from django_quota.core.protocol import GroupRequest, fingerprint
from django_quota.scripts import SCRIPT_NAMES, load
from django_quota.scripts.shapes import (
    CONDITION_NAMES,
    SINGLE_WINDOW_SCRIPTS,
    ShapeError,
    check_general,
    render,
)

#: The algorithms with a variant of their own (a concurrency policy runs the general
#: script: docs/concurrency.md).
VARIANTS = tuple(SINGLE_WINDOW_SCRIPTS)

EVALUATE_LUA = resources.files("django_quota.scripts").joinpath("evaluate.lua").read_text()

#: Code only an algorithm has: its window's view, or a sliding log's lists.
SIGNATURES = {
    "fixed_window": r"^\s*if used \+ cost > limit then allowed = false end$",
    "sliding_window": r"stored_start \+ period|prev \* \(period - elapsed\)",
    "token_bucket": r"\bdeficit\b|\bcapacity\b",
    "sliding_log": r"LINDEX|LRANGE|LPUSH|LTRIM|LLEN|PEXPIRE|LOG_MODULUS|\blv\b|log_view",
}
#: What only the general script needs: the loops over policies and windows, the
#: per-policy arrays, the dispatch on the algorithm (the fixed window's variant tells a
#: calendar call, code 5, from an epoch-aligned one: that is no dispatch), the function
#: splitting the windows' numbers (a closure made on every call).
GENERAL_ONLY = (
    r"for i = 1, n do|for w = 1, m do|policies\[|policy\[|algorithm == [1-4]|m > 1|split48"
)


def code_lines(source: str) -> list[str]:
    """The lines of ``source`` that are not Lua comments (the header's long comment, a
    line comment, a trailing comment)."""
    body = source[source.index("\n]]\n") :] if "--[[" in source else source
    return [line.split("--")[0] for line in body.splitlines() if line.split("--")[0].strip()]


def request(
    algorithm: str, windows: int = 1, policies: int = 1, now_ms: int | None = 1_000_000
) -> GroupRequest:
    calls = tuple(
        PolicyCall(
            algorithm,
            tuple(Window(f"w{index}", 5, 60_000, 5) for index in range(windows)),
            1,
            True,
        )
        for _ in range(policies)
    )
    return GroupRequest(
        counters=tuple(f"q:{{s}}:p{index}:r" for index in range(policies)),
        calls=calls,
        now_ms=now_ms,
        peek=False,
        max_regression_ms=-1,
        dedup_ttl_ms=5_000,
        cleanup_grace_ms=1_000,
        fingerprint=fingerprint("e1"),
    )


def test_every_script_is_known_by_its_name_and_its_own_sha1() -> None:
    assert SCRIPT_NAMES == (
        "evaluate",
        "evaluate_fixed_window",
        "evaluate_sliding_window",
        "evaluate_sliding_log",
        "evaluate_token_bucket",
        "reset",
        "refund",
        "release",
    )
    assert list(sources()) == list(SCRIPT_NAMES)  # what preload loads and NOSCRIPT finds
    shas = [source.sha1 for source in sources().values()]
    assert len(set(shas)) == len(shas)
    with pytest.raises(KeyError):
        load("evaluate_leaky_bucket")


def test_the_general_script_is_evaluate_lua_as_it_is() -> None:
    assert load("evaluate").source == EVALUATE_LUA
    check_general(EVALUATE_LUA)  # every line of code runs in it; "--+" lines are comments
    rendered = render(EVALUATE_LUA, CONDITION_NAMES).splitlines()
    kept = [
        re.sub(r"\s+--@ \w+(?: or \w+)*\s*$", "", line)
        for line in EVALUATE_LUA.splitlines()
        if not re.match(r"\s*--[@+]", line)
    ]
    assert rendered == kept


@pytest.mark.parametrize("algorithm", VARIANTS)
def test_a_variant_holds_its_algorithms_code_and_no_other(algorithm: str) -> None:
    source = load(SINGLE_WINDOW_SCRIPTS[algorithm]).source
    assert source.startswith(f"-- evaluate_{algorithm}: evaluate.lua specialised to one")
    body = source[source.index("\n]]\n") :]  # after the header, which describes them
    assert "--@" not in body and "--+" not in body  # the shape comments are gone
    code = code_lines(source)
    for other, signature in SIGNATURES.items():
        found = [line for line in code if re.search(signature, line)]
        assert bool(found) == (other == algorithm), (other, found)
    assert [line for line in code if re.search(GENERAL_ONLY, line)] == []
    general = code_lines(EVALUATE_LUA)
    for signature in [*SIGNATURES.values(), GENERAL_ONLY]:
        assert any(re.search(signature, line) for line in general)


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_compiles(name: str) -> None:
    runtime = lua51.LuaRuntime()
    compile_lua = runtime.eval("function(source) local f, e = loadstring(source) return e end")
    assert compile_lua(load(name).source) is None


@pytest.mark.parametrize("algorithm", VARIANTS)
def test_the_call_names_the_script_of_the_groups_shape(algorithm: str) -> None:
    assert evaluate_call(request(algorithm)).script == f"evaluate_{algorithm}"
    assert evaluate_call(request(algorithm, windows=2)).script == "evaluate"
    assert evaluate_call(request(algorithm, policies=2)).script == "evaluate"
    one = request(algorithm)
    assert evaluate_call(one).keys == one.keys()
    assert evaluate_call(one).args == one.args()  # the same KEYS and ARGV as the general


def test_the_generator_keeps_what_holds_where() -> None:
    source = "\n".join(
        [
            "a",
            "--@ if general",
            "b",
            "--@ elif fixed_window or token_bucket",
            "--+ c",
            "--@ else",
            "  --+ d  -- a comment",
            "--@ end",
            "e  --@ sliding_log",
            "  --+ f  --@ fixed_window",
        ]
    )
    assert render(source, CONDITION_NAMES) == "a\nb\ne\n"
    assert render(source, ("fixed_window",)) == "a\nc\n  f\n"
    assert render(source, ("sliding_log",)) == "a\n  d  -- a comment\ne\n"
    check_general(source)
    for broken in ["--@ if leaky_bucket\n--@ end", "--@ if general", "--@ end", "--@ else x"]:
        with pytest.raises(ShapeError):
            render(broken, CONDITION_NAMES)
    with pytest.raises(ShapeError, match="line 4"):  # code of the variants must be "--+"
        check_general("--@ if general\na\n--@ else\nb\n--@ end")


# -- Lua VM instructions of one decision, counted under a count hook ---------------------
COUNTED = """
return function(f)
  local n = 0
  debug.sethook(function() n = n + 1 end, "", 1)
  f()
  debug.sethook()
  return n
end
"""


def vm_instructions(source: str, call: GroupRequest, runs: int) -> list[int]:
    """Lua VM instructions of each of ``runs`` evaluations of ``call`` by ``source`` (Lua
    5.1, a stub ``redis`` keeping strings in a dict, ``TIME`` fixed)."""
    runtime = lua51.LuaRuntime(encoding=None)
    store: dict[bytes, bytes] = {}

    def command(name: bytes, *args: bytes) -> Any:
        if name == b"TIME":
            return runtime.table(b"1796307944", b"989123")
        if name == b"GET":
            return store.get(args[0], False)
        if name == b"SET":
            store[args[0]] = args[1]
            return runtime.table_from({b"ok": b"OK"})
        raise AssertionError(name)

    runtime.execute("redis = {}")
    stub = runtime.globals().redis
    stub.call = stub.pcall = command
    counted = runtime.execute(COUNTED)
    function = runtime.eval("loadstring")(source.encode())
    keys = call.keys()  # a GroupRequest's KEYS (not a mapping's)
    runtime.globals().KEYS = runtime.table(*(key.encode() for key in keys))
    runtime.globals().ARGV = runtime.table(*call.args())
    return [counted(function) for _ in range(runs)]


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "token_bucket"])
def test_a_variant_runs_far_fewer_lua_instructions_than_the_general_script(
    algorithm: str,
) -> None:
    """Charges on the server clock (TIME), the counter's expiry kept from the second on:
    the same replies and writes (the differential tests), in at most 80 % of the VM
    instructions."""
    call = request(algorithm, now_ms=None)
    general = vm_instructions(EVALUATE_LUA, call, 3)
    variant = vm_instructions(load(f"evaluate_{algorithm}").source, call, 3)
    assert general[1] == general[2] and variant[1] == variant[2]  # a counter to charge
    assert variant[2] <= 0.8 * general[2], (variant, general)


# -- Redis TIME read as whole ms ------------------------------------------------------------
#: (seconds, µs) as Redis TIME gives them, the µs without leading zeros: each digit count,
#: both edges of a ms, and seconds of nine and of eleven digits (before 2001, after 2286).
TIMES = [
    (b"1796307944", b"0"),
    (b"1796307944", b"7"),
    (b"1796307944", b"999"),
    (b"1796307944", b"1000"),
    (b"1796307944", b"1999"),
    (b"1796307944", b"989123"),
    (b"1796307944", b"999999"),
    (b"999999999", b"500"),
    (b"99999999999", b"999999"),
]


def run_once(source: str, keys: list[bytes], args: list[bytes], time: tuple[bytes, bytes],
             replies: dict[bytes, Any]) -> Any:
    """``source`` run once by Lua 5.1 with ``KEYS``, ``ARGV`` (strings, as Redis passes
    them) and a stub ``redis`` whose ``TIME`` is ``time``, answering the commands named in
    ``replies`` with theirs (a list: a Lua array) and any other with 1; the reply."""
    runtime = lua51.LuaRuntime(encoding=None)

    def command(name: bytes, *_: bytes) -> Any:
        if name == b"TIME":
            return runtime.table(*time)
        reply = replies.get(name, 1)
        return runtime.table(*reply) if isinstance(reply, list) else reply

    runtime.execute("redis = {}")
    stub = runtime.globals().redis
    stub.call = stub.pcall = command
    runtime.globals().KEYS = runtime.table(*keys)
    runtime.globals().ARGV = runtime.table(*args)
    return runtime.eval("loadstring")(source.encode())()


def whole_ms(time: tuple[bytes, bytes]) -> int:
    return int(time[0]) * 1000 + int(time[1]) // 1000


@pytest.mark.parametrize("name", ["evaluate", *SINGLE_WINDOW_SCRIPTS.values()])
@pytest.mark.parametrize("time", TIMES)
def test_the_evaluation_scripts_read_redis_time_as_whole_ms(
    name: str, time: tuple[bytes, bytes]
) -> None:
    """On the server clock a decision's now is TIME's µs floored to ms: the reply's now."""
    algorithm = "fixed_window" if name == "evaluate" else name.removeprefix("evaluate_")
    call = request(algorithm, now_ms=None)
    args = [arg if isinstance(arg, bytes) else str(arg).encode() for arg in call.args()]
    keys = call.keys()  # a GroupRequest's KEYS (not a mapping's)
    counters = [key.encode() for key in keys]
    reply = run_once(load(name).source, counters, args, time, {b"GET": False, b"LINDEX": False})
    assert list(reply.values())[:2] == [0, whole_ms(time)]


@pytest.mark.parametrize("time", TIMES)
def test_release_reads_redis_time_as_whole_ms(time: tuple[bytes, bytes]) -> None:
    """A lease expiring at now has expired, one expiring 1 ms later is still held: only
    the second's units are released."""
    now = whole_ms(time)
    mine = fingerprint("e1")
    leases = [mine + bytes([0, 2]), str(now).encode(), mine + bytes([0, 5]), str(now + 1).encode()]
    args = [mine, b"0", b"1000"]
    released = run_once(load("release").source, [b"q:{s}:p0:r"], args, time, {b"ZRANGE": leases})
    assert released == 5


# -- a real Redis: NOSCRIPT recovered for each script ------------------------------------
@pytest.mark.parametrize("algorithm", VARIANTS)
def test_noscript_loads_the_variant_and_runs_it(redis_url: str, algorithm: str) -> None:
    backend = RedisBackend(url=redis_url, timeout=5.0, max_inflight=4)
    variant = load(f"evaluate_{algorithm}")
    with redis.Redis.from_url(redis_url) as client:
        client.script_flush()
        try:
            first = backend.evaluate(request(algorithm))
            assert client.script_exists(variant.sha1, load("evaluate").sha1) == [True, False]
            client.script_flush()
            second = backend.evaluate(request(algorithm, now_ms=1_000_001))
            assert client.script_exists(variant.sha1) == [True]
        finally:
            backend.close()
    assert [window.remaining for window in first.results[0].windows] == [4]
    assert [window.remaining for window in second.results[0].windows] == [3]
