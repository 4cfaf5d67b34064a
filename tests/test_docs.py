"""The documentation and the sources cite only what users have: the docs pages, never a
specification document that is not shipped with the package."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Citations of the product specification (case-insensitive). The character classes keep
#: these patterns from matching their own source text.
CITATIONS = re.compile(
    r"contract[s]?\s+(?:sections?\s+)?\d"  # "section 4", "5.4" after the word
    r"|contract[s]?\s+sections?\b"
    r"|contract[.]md"
    r"|(?:\b|_)the[\s_]+contract"  # in prose, or inside a name such as "is_the_..."
    r"|contract[']s\b"
    r"|\bcontract_\w+",  # a name that starts with the word, such as "..._url"
    re.IGNORECASE,
)

#: Lines about import-linter, whose configuration calls its rules "contracts".
IMPORT_LINTER = re.compile(r"import-?linter|importlinter|lint-imports|import-direction", re.I)


def project_text_files() -> list[Path]:
    """Every file git tracks or would track (untracked but not ignored), as text."""
    result = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    files = []
    for name in result.stdout.split("\0"):
        path = ROOT / name
        if name and path.is_file():
            files.append(path)
    return files


def citations_in(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` for each citation outside the import-linter lines."""
    lines = text.splitlines()
    found = []
    for match in CITATIONS.finditer(text):
        number = text.count("\n", 0, match.start()) + 1
        # A match may run over a line break ("the" ending one line): check both lines.
        last = text.count("\n", 0, match.end()) + 1
        spanned = " ".join(lines[number - 1 : last])
        if not IMPORT_LINTER.search(spanned):
            found.append((number, spanned.strip()))
    return found


def cite(sample: str) -> list[tuple[int, str]]:
    """:func:`citations_in` on ``sample`` with ``{word}`` spelled out (so that this file
    does not cite anything itself)."""
    return citations_in(sample.format(word="contract", WORD="CONTRACT"))


def test_the_patterns_catch_citations_and_spare_import_linter() -> None:
    assert cite("as {word} section 4 walks the chain") != []
    assert cite("one round trip ({word} 5.4)") != []
    assert cite("The product {word} is `{WORD}.md`.") != []
    assert cite("choices made where the\n{word} is silent") == [
        (1, "choices made where the {word} is silent".format(word="contract"))
    ]
    assert cite("one of the {word}'s failure reasons") != []
    assert cite("def test_defaults_table_is_the_{word}_table():") != []
    assert cite("self.url = {word}_url(url)") != []
    assert cite("{WORD}_OPTIONS = ('retry',)") != []
    assert cite("`lint-imports` ({word}s in `pyproject.toml`)") == []
    assert cite("[[tool.importlinter.{word}s]]") == []
    assert cite("the failure reasons (docs/failures.md)") == []


def test_no_file_cites_a_contract_users_do_not_have() -> None:
    files = project_text_files()
    assert ROOT / "pyproject.toml" in files
    assert Path(__file__).resolve() in files
    cited = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in citations_in(text):
            cited.append(f"{path.relative_to(ROOT)}:{number}: {line}")
    assert cited == [], "\n".join(cited)


#: A script named with its SHA1 in a page (``quota preload`` and ``quota check`` output).
SCRIPT_SHA1 = re.compile(r"\b(evaluate(?:_[a-z_]+)?|reset|refund|release) ([0-9a-f]{40})\b")


def test_the_pages_show_the_scripts_current_sha1() -> None:
    from django_quota.backends.scripting import sources

    current = {name: source.sha1 for name, source in sources().items()}
    shown = [
        (page.name, name, sha1)
        for page in sorted((ROOT / "docs").glob("*.md"))
        for name, sha1 in SCRIPT_SHA1.findall(page.read_text())
    ]
    assert shown  # the command pages show them
    assert [row for row in shown if row[2] != current[row[1]]] == []
