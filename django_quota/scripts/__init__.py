"""The Lua scripts, read once from this package's ``*.lua`` files by name.

Each file opens with a header listing its KEYS, ARGV (with units) and reply shape.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources

SCRIPT_NAMES = ("evaluate", "reset", "refund")


@dataclass(frozen=True, slots=True)
class ScriptSource:
    """A script's name, Lua source and SHA1 (what ``EVALSHA`` names it by)."""

    name: str
    source: str
    sha1: str


@cache
def load(name: str) -> ScriptSource:
    """Read ``<name>.lua`` from this package (``KeyError`` for an unknown name)."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"no script named {name!r}; known: {', '.join(SCRIPT_NAMES)}")
    source = resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return ScriptSource(name, source, hashlib.sha1(source.encode()).hexdigest())


def all_scripts() -> tuple[ScriptSource, ...]:
    """Every script, in :data:`SCRIPT_NAMES` order."""
    return tuple(load(name) for name in SCRIPT_NAMES)
