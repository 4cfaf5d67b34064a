"""docs/commands.md holds to ``manage.py quota``'s parser: every subcommand has its
section, and every option string the parser accepts is documented (a subcommand's own
options in its section, Django's common ones in theirs)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from django_quota.management.commands.quota import Command

PAGE = Path(__file__).resolve().parent.parent / "docs" / "commands.md"
COMMON_SECTION = "Options of every subcommand"


def parser() -> argparse.ArgumentParser:
    return Command().create_parser("manage.py", "quota")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [
        action
        for action in parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    return dict(action.choices)


def option_strings(found: argparse.ArgumentParser) -> set[str]:
    return {option for action in found._actions for option in action.option_strings}


def positionals(found: argparse.ArgumentParser) -> set[str]:
    return {
        action.dest
        for action in found._actions
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction)
    }


def sections() -> dict[str, str]:
    """The text under each ``## `` heading of the page, by heading."""
    parts = re.split(r"^## (.+)$", PAGE.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def documented(option: str, text: str) -> bool:
    """``option`` appears in backticks, alone or as the start of ``--ip IP``."""
    return re.search(rf"`{re.escape(option)}[` ]", text) is not None


def test_the_parser_is_what_this_test_expects() -> None:
    assert sorted(subcommands()) == ["check", "inspect", "policies", "preload", "reset"]
    assert {"--json", "--user", "--yes", "--no-input"} <= set().union(
        *(option_strings(sub) for sub in subcommands().values())
    )


def test_every_subcommand_has_its_section() -> None:
    headings = set(sections())
    for name in subcommands():
        assert f"`quota {name}`" in headings, name


def test_every_option_of_each_subcommand_is_in_its_section() -> None:
    found = sections()
    common = option_strings(parser()) - {"--version"}
    for name, sub in subcommands().items():
        text = found[f"`quota {name}`"]
        for option in sorted(option_strings(sub) - common):
            assert documented(option, text), f"quota {name} {option}"
        for argument in positionals(sub):
            assert f"`<{argument}>`" in text, f"quota {name} <{argument}>"


def test_every_common_option_is_in_the_common_section() -> None:
    text = sections()[COMMON_SECTION]
    every = option_strings(parser()).union(*(option_strings(s) for s in subcommands().values()))
    own = set().union(
        *(option_strings(sub) - option_strings(parser()) for sub in subcommands().values())
    )
    for option in sorted(every - own):
        assert documented(option, text), option
    assert own == {"--json", "--user", "--api-key", "--ip", "--route", "--tenant", "--yes",
                   "--no-input", "--plan"}


def test_exit_codes_are_documented() -> None:
    text = sections()["Exit codes"]
    assert {"`0`", "`1`", "`2`"} <= set(re.findall(r"^\| (`\d`) \|", text, re.M))
