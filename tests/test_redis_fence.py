"""redis-py's private state is touched in two modules only, ``backends/redispy.py`` and
``backends/redispy_transport.py`` (the fence, docs/architecture.md): counted here over
every module of the package, with ``ast``. The fence's switch to redis-py's public path,
and its version pin."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import redis

import django_quota
from django_quota.backends import redispy
from tests.output import without_unread_redis_py_warning

PACKAGE = Path(django_quota.__file__).resolve().parent
#: The fence's modules: the switch, the sync path, the cluster client; an asyncio
#: connection's replies and socket.
FENCE = (PACKAGE / "backends" / "redispy.py", PACKAGE / "backends" / "redispy_transport.py")
#: Names with a leading underscore that are public API: named tuples' methods, Django's
#: model options and default manager.
PUBLIC_UNDERSCORED = frozenset(
    {"_replace", "_asdict", "_fields", "_make", "_meta", "_default_manager"}
)
#: redis-py state without an underscore that its documentation does not give (what the
#: fence reads of its cluster clients and pools).
UNDOCUMENTED = frozenset(
    {
        "nodes_manager",
        "nodes_cache",
        "slots_cache",
        "startup_nodes",
        "commands_parser",
        "connection_kwargs",
        "connection_class",
        "owns_connection",
    }
)
#: Private state of libraries other than redis-py, each known by name (the goal here is
#: redis-py's; these are for fences of their own): DRF's ``Request`` keeps the
#: ``HttpRequest`` it wraps as ``_request``; prometheus_client's created-series switch.
OTHER_LIBRARIES = {
    "ledger.py": ["getattr(..., '_request')"],
    "metrics.py": ["getattr(..., '_use_created')"],
    "throttling.py": ["getattr(..., '_request')"],
}
_PRIVATE = re.compile(r"_(?!_)\w*\Z")


def _is_private(name: str) -> bool:
    return bool(_PRIVATE.match(name)) and name not in PUBLIC_UNDERSCORED


class _Touches(ast.NodeVisitor):
    """Every touch of another library's private state in one module: ``x._name`` where
    ``x`` is not ``self``, ``cls``, ``super()`` nor a module of ours; ``getattr``,
    ``setattr`` and ``hasattr`` of such a name; an import from ``redis._*``; redis-py's
    undocumented attributes (:data:`UNDOCUMENTED`); and ``os.write`` (a write on a
    socket's descriptor)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.ours: set[str] = {"self", "cls", "django_quota"}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith("django_quota"):
                self.ours.add((alias.asname or alias.name).split(".")[0])
            if alias.name.startswith("redis._"):
                self.found.append(f"{node.lineno}: import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.startswith("django_quota") or node.level:
            self.ours.update(alias.asname or alias.name for alias in node.names)
        if module.startswith("redis._") or (
            module.startswith("redis") and any(_is_private(a.name) for a in node.names)
        ):
            self.found.append(f"{node.lineno}: from {module} import ...")

    def _owned(self, value: ast.expr) -> bool:
        while isinstance(value, ast.Attribute):
            value = value.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            return value.func.id == "super"
        return isinstance(value, ast.Name) and value.id in self.ours

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        if _is_private(name) and not self._owned(node.value):
            self.found.append(f"{node.lineno}: ._{name.lstrip('_')}")
        elif name in UNDOCUMENTED:
            self.found.append(f"{node.lineno}: .{name}")
        elif name == "write" and isinstance(node.value, ast.Name) and node.value.id == "os":
            self.found.append(f"{node.lineno}: os.write")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and not self._owned(node.args[0])
        ):
            self.found.append(f"{node.lineno}: {func.id}(..., {node.args[1].value!r})")
        self.generic_visit(node)


def touches(path: Path) -> list[str]:
    """The touches of private state in the module at ``path`` (see :class:`_Touches`)."""
    visitor = _Touches()
    tree = ast.parse(path.read_text(), str(path))
    # Imports first: a name imported below its first use is still ours.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            visitor.visit(node)
    visitor.found.clear()
    visitor.visit(tree)
    return visitor.found


def test_no_module_but_the_fence_touches_private_state() -> None:
    found = {
        str(path.relative_to(PACKAGE)): [line.split(": ", 1)[1] for line in found]
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in FENCE and (found := touches(path))
    }
    # Before the fence (main at 043702c): 37, of which 34 in backends/ (cluster.py 19,
    # redis.py 11, scripting.py 3, pipeline.py 1).
    assert found == OTHER_LIBRARIES


def test_the_counter_sees_each_kind_of_touch(tmp_path: Path) -> None:
    module = tmp_path / "sample.py"
    module.write_text(
        "import os\n"
        "from redis._parsers import AsyncCommandsParser\n"
        "from django_quota import conf\n"
        "def f(connection, client, request, self=None):\n"
        "    connection._sock.close()\n"  # 1
        "    getattr(connection, '_writer', None)\n"  # 2
        "    client.nodes_manager.slots_cache\n"  # 3, 4
        "    os.write(3, b'')\n"  # 5
        "    request._replace(a=1)\n"  # public
        "    self._idle\n"  # ours
        "    conf._state\n"  # ours
        "    super()._retire()\n"  # ours
        "    return connection.__class__\n"  # a dunder
    )
    assert len(touches(module)) == 6  # and the import from redis._parsers


def test_the_fence_is_where_the_touches_are() -> None:
    # What the fence holds is counted too, so that the test above counts what it says
    # (30 in all when the fence was split in two: 18 and 12).
    assert [len(touches(module)) >= 10 for module in FENCE] == [True, True]


def test_the_environment_variable_takes_the_public_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis, "__version__", "8.1.0")
    monkeypatch.delenv(redispy.PUBLIC_PATH_ENV, raising=False)
    assert redispy.public_path() is False
    assert redispy.public_path(True) is True  # QUOTA["REDIS_PUBLIC_PATH"]
    monkeypatch.setenv(redispy.PUBLIC_PATH_ENV, "0")
    assert redispy.public_path() is False
    monkeypatch.setenv(redispy.PUBLIC_PATH_ENV, "1")
    assert redispy.public_path() is True


def test_a_redis_py_the_fence_was_not_read_against_takes_the_public_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(redispy.PUBLIC_PATH_ENV, raising=False)
    monkeypatch.setattr(redispy, "_warned", type(redispy._warned)())
    monkeypatch.setattr(redis, "__version__", "9.0.0")
    with caplog.at_level(logging.WARNING, logger="django_quota"):
        assert redispy.public_path() is True
        assert redispy.public_path() is True
    warnings = [r.getMessage() for r in caplog.records if "redis-py 9.0.0" in r.getMessage()]
    assert len(warnings) == 1 and "read against (8.0, 8.1, 8.2)" in warnings[0]
    # What the exact-output tests leave out of a command's stderr is this line, whole.
    stderr = f"{warnings[0]}\nCommandError: connectivity: down\n"
    assert without_unread_redis_py_warning(stderr) == "CommandError: connectivity: down\n"
    monkeypatch.setattr(redis, "__version__", "8.0.3")
    assert redispy.public_path() is False


def test_a_backend_built_with_another_redis_py_takes_the_public_path(
    monkeypatch: pytest.MonkeyPatch, quota: object
) -> None:
    from django_quota import limiter
    from django_quota.backends.redis import PublicMarkingConnectionPool

    monkeypatch.delenv(redispy.PUBLIC_PATH_ENV, raising=False)
    monkeypatch.setattr(redis, "__version__", "7.4.0")
    quota(REDIS_URL="redis://127.0.0.1:1/0")  # type: ignore[operator]  # never connected
    backend = limiter.get_backend()
    assert backend.public is True  # type: ignore[attr-defined]
    pool = backend.client.connection_pool  # type: ignore[attr-defined]
    assert type(pool) is PublicMarkingConnectionPool


def test_pyproject_names_the_versions_the_fence_was_read_against() -> None:
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    named = ", ".join(f"{major}.{minor}" for major, minor in redispy.READ_AGAINST)
    assert f"read against redis-py {named}" in pyproject


def test_the_installed_redis_py_is_one_the_fence_was_read_against() -> None:
    # The one test that fails on a redis-py release nobody has read the fence against yet
    # (the other tests pass on its public path; those that compare a command's stderr
    # leave out the warning line: tests/output.py). docs/development.md, "A new redis-py".
    version = str(redis.__version__)
    named = ", ".join(f"{major}.{minor}" for major, minor in redispy.READ_AGAINST)
    assert redispy.read_against(version), (
        f"redis-py {version} is installed; the fence (django_quota/backends/redispy.py "
        f"and redispy_transport.py) was read against {named} only, so the backends take "
        "redis-py's public path. Read each 'Relies on' item of both modules in this "
        "release's source against the last one read; then add it to READ_AGAINST, "
        "pyproject.toml's comment and the docs that "
        "name the versions, or fix the fence first (docs/development.md, 'A new redis-py')."
    )
