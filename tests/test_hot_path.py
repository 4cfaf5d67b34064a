"""What the hot path does instead of the generic code it replaces, held to the same
results: the outcome classes' own ``__init__`` (a frozen dataclass's generated one is
twice as slow), the packed header remembered per server-clock shape, and the sync
``EVALSHA`` packed by hiredis (``docs/benchmarks.md``)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

import pytest

from django_quota.backends import redis as redis_backend
from django_quota.core import protocol
from django_quota.core.calls import Packing, PolicyCall
from django_quota.core.outcome import Outcome, WindowState
from django_quota.core.policy import Window
from django_quota.core.protocol import GroupRequest

CALL = PolicyCall("fixed_window", (Window("default", 5, 60_000, 5),), 1)


@pytest.mark.parametrize("kind", [Outcome, WindowState])
def test_the_init_takes_the_dataclass_fields_in_order_with_their_defaults(kind: type) -> None:
    parameters = list(inspect.signature(kind).parameters.values())
    fields = dataclasses.fields(kind)
    assert [parameter.name for parameter in parameters] == [item.name for item in fields]
    assert [parameter.default for parameter in parameters] == [
        inspect.Parameter.empty if item.default is dataclasses.MISSING else item.default
        for item in fields
    ]


def test_an_outcome_built_by_position_or_keyword_has_every_field_and_stays_frozen() -> None:
    window = WindowState("default", 5, 60.0, 4, 59.5, None, 59.5)
    by_position = Outcome(
        "p", "allowed", None, "default", 5, 4, 59.5, None, (window,), "exact", "redis", "id"
    )
    by_keyword = Outcome(
        policy="p",
        decision="allowed",
        window="default",
        limit=5,
        remaining=4,
        reset_after=59.5,
        windows=(window,),
        backend_mode="redis",
        evaluation_id="id",
    )
    assert by_position == by_keyword
    assert dataclasses.asdict(by_position)["windows"][0]["remaining"] == 4
    assert Outcome("p", "skipped").backend_mode == "memory"
    assert WindowState("w", 1, 1.0, 0, 1.0, 1.0).replenish_after == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        by_position.remaining = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Outcome("p")  # type: ignore[call-arg]
    assert dataclasses.replace(by_position, remaining=3).remaining == 3
    assert hash(by_position) == hash(by_keyword)


def packed_afresh(request: GroupRequest) -> bytes:
    return Packing.HEADER.pack(
        request.mode + (0 if request.now_ms is None else 4),  # 4: the client's clock
        len(request.calls),
        0 if request.now_ms is None else request.now_ms + 1,
        request.max_regression_ms + 1,
        request.dedup_ttl_ms,
        request.cleanup_grace_ms,
    )


def test_the_remembered_header_is_the_one_packed_afresh() -> None:
    server = GroupRequest(("k",), (CALL,), None, False, -1, 5000, 1000, b"abcde", False)
    client = server._replace(now_ms=1_700_000_000_000, max_regression_ms=2000)
    retry = server._replace(may_repeat=True)
    for request in (server, server, client, client, retry, server._replace(peek=True)):
        assert request.args()[1] == packed_afresh(request) + CALL.packed
    # Only the server clock's headers are remembered: a client clock's has its now in it.
    assert all(fields[2] == 0 for fields in protocol._HEADERS)


def test_a_header_the_script_cannot_take_is_refused_every_time() -> None:
    request = GroupRequest(("k",), (CALL,), None, False, -1, 2**48, 1000, b"abcde", False)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"outside 0\.\.2\*\*48"):
            request.args()


class RecordingConnection:
    """Takes what ``send`` hands it."""

    def __init__(self) -> None:
        self.packed: list[Any] = []
        self.commands: list[tuple[Any, ...]] = []

    def send_packed_command(self, command: Any) -> None:
        self.packed.append(command)

    def send_command(self, *args: Any) -> None:
        self.commands.append(args)

    def read_response(self, **options: Any) -> int:  # timeout=, disconnect_on_error=
        return 7


class OnePool:
    def __init__(self, connection: RecordingConnection) -> None:
        self.connection = connection
        self.released = 0

    def get_connection(self) -> RecordingConnection:
        return self.connection

    def release(self, connection: RecordingConnection) -> None:
        self.released += 1


def test_the_sync_command_is_sent_as_the_bytes_redis_py_would_pack() -> None:
    import redis

    command = ("EVALSHA", "a" * 40, 1, "quota:{x}:1:p:r", b"\x00\xff", b"\x01")
    connection = RecordingConnection()
    pool = OnePool(connection)
    assert redis_backend.send(pool, command) == 7
    assert pool.released == 1
    expected = b"".join(redis.Connection().pack_command(*command))
    if redis_backend.pack_command is None:  # no hiredis: redis-py packs it
        assert connection.commands == [command]
    else:
        assert connection.packed == [[expected]]


def test_the_init_annotations_resolve_in_the_module() -> None:
    import typing

    assert typing.get_type_hints(Outcome.__init__)["windows"] == tuple[WindowState, ...]
    signature = inspect.signature(Outcome, eval_str=True)
    assert signature.parameters["reason"].annotation == str | None


def test_a_now_outside_the_packable_range_is_refused_not_sent_as_the_server_clock() -> None:
    request = GroupRequest(("k",), (CALL,), -1, False, 2000, 5000, 1000, b"abcde", False)
    with pytest.raises(ValueError, match=r"outside 0\.\.2\*\*48"):
        request.args()


def test_the_hot_path_builders_make_ordinary_frozen_instances() -> None:
    import copy
    import pickle

    from django_quota.core.outcome import build_outcome, build_window_state

    window_fields = ("burst", 5, 1.0, 4, 0.5, None, 0.25)
    window = build_window_state(*window_fields)
    fields = ("p", "allowed", None, "burst", 5, 4, 0.5, None, (window,), "exact", "redis", "id")
    built = build_outcome(*fields)
    assert type(built) is Outcome and type(window) is WindowState
    assert built == Outcome(*fields) and hash(built) == hash(Outcome(*fields))
    assert window == WindowState(*window_fields)
    assert [getattr(built, item.name) for item in dataclasses.fields(Outcome)] == list(fields)
    assert pickle.loads(pickle.dumps(built)) == built
    assert copy.deepcopy(built) == built
    assert dataclasses.replace(built, remaining=3).remaining == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.remaining = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        window.remaining = 0  # type: ignore[misc]


def test_the_builders_typed_signatures_are_the_fields_in_order() -> None:
    import ast
    from pathlib import Path

    from django_quota.core import outcome

    tree = ast.parse(Path(outcome.__file__).read_text())
    typed = {
        node.name: [argument.arg for argument in node.args.posonlyargs]
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("build_")
    }
    assert typed == {
        "build_outcome": [item.name for item in dataclasses.fields(Outcome)],
        "build_window_state": [item.name for item in dataclasses.fields(WindowState)],
    }


def test_evaluation_ids_are_distinct_22_character_base64url() -> None:
    from django_quota.engine.prepared import new_evaluation_id

    made = [new_evaluation_id() for _ in range(500)]
    assert len(set(made)) == len(made)
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert all(len(made_id) == 22 and set(made_id) <= alphabet for made_id in made)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_hands_out_its_parents_ids() -> None:
    from django_quota.engine.prepared import new_evaluation_id

    # An id made ahead of use (a batch) would be copied into a child: never hand one out
    # twice. A fork made in C skips os.register_at_fork's hooks, so ids are made per call.
    new_evaluation_id()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first ids, then exit without running pytest's teardown
        os.close(reader)
        os.write(writer, " ".join(new_evaluation_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {new_evaluation_id() for _ in range(8)}
    assert len(child) == 8
    assert not child & parent
