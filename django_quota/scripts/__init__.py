"""The Lua scripts, read once from this package's ``*.lua`` files by name, and the
variants of ``evaluate.lua`` generated from it per policy shape (:mod:`.shapes`).

Each file opens with a header listing its KEYS, ARGV (with units) and reply shape.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from django_quota.scripts.shapes import SINGLE_WINDOW_SCRIPTS, single_window

#: Every script: the general ``evaluate.lua``, its variants, then ``reset`` and ``refund``.
SCRIPT_NAMES = ("evaluate", *SINGLE_WINDOW_SCRIPTS.values(), "reset", "refund", "release")


@dataclass(frozen=True, slots=True)
class ScriptSource:
    """A script's name, Lua source and SHA1 (what ``EVALSHA`` names it by)."""

    name: str
    source: str
    sha1: str


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


@cache
def load(name: str) -> ScriptSource:
    """Read ``<name>.lua`` from this package, or generate the variant ``name`` of
    ``evaluate.lua`` (``KeyError`` for an unknown name)."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"no script named {name!r}; known: {', '.join(SCRIPT_NAMES)}")
    # The generated variants of ``evaluate.lua``, by name: the algorithm of their one policy.
    variants = {variant: algorithm for algorithm, variant in SINGLE_WINDOW_SCRIPTS.items()}
    algorithm = variants.get(name)
    source = _read(name) if algorithm is None else single_window(_read("evaluate"), algorithm)
    return ScriptSource(name, source, hashlib.sha1(source.encode()).hexdigest())


def all_scripts() -> tuple[ScriptSource, ...]:
    """Every script, in :data:`SCRIPT_NAMES` order."""
    return tuple(load(name) for name in SCRIPT_NAMES)
