"""The README is a front door, and the docs' links lead somewhere.

A newcomer reads README.md first: it stays short (at most 200 lines), it
names the two commands that set everything up (``bash run.sh cluster``,
``bash run.sh test``), every relative link in it and in docs/*.md points at
a file of the repository, and every ``metalog <subcommand>`` its fenced code blocks
show is a real subcommand (``metalog <sub> --help`` exits 0). Moving or
renaming a doc, or a CLI subcommand, then fails here instead of leaving a
dead end for the reader."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_LINES_MAX = 200

# [text](target) or [text](target "title"); images too. Targets with a scheme
# (https:, mailto:) or only an anchor are not files of the repository.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# `metalog` as a command word (at a line's start, after a space, or after a
# slash as in .venv/bin/metalog; not metalog.broker or metalog-local), then up
# to two words that can name a subcommand and its sub-subcommand (an option
# such as --from ends the words).
COMMAND = re.compile(r"(?:^|[\s/;|&(])metalog((?:[ \t]+[a-z][a-z0-9-]*){1,2})", re.M)


def _relative_links(path: Path) -> list[str]:
    targets = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def _doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def _code_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def _subcommands(text: str) -> set[tuple[str, ...]]:
    """Each `metalog a [b]` of the README's fenced code blocks, as (a,) or (a, b)."""
    found = set()
    for block in _code_blocks(text):
        for match in COMMAND.finditer(block):
            found.add(tuple(match.group(1).split()))
    return found


# One interpreter runs every `metalog <sub> --help` through the console
# script's own entry point (metalog.tools.cli:main, what .venv/bin/metalog
# calls), printing one exit code per command: a process per command costs
# seconds each on a loaded machine.
HELP_DRIVER = """
import contextlib, io, json, sys
from metalog.tools.cli import main
codes = []
for words in json.loads(sys.argv[1]):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main([*words, "--help"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    codes.append(code)
print(json.dumps(codes))
"""


def _help_exit_codes(commands: list[tuple[str, ...]]) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", HELP_DRIVER, json.dumps(commands)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_readme_is_a_front_door_of_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES_MAX, (
        f"README.md has {len(lines)} lines (at most {README_LINES_MAX}): move details into docs/ "
        "and history into CHANGELOG.md")


def test_readme_names_both_commands():
    text = README.read_text(encoding="utf-8")
    for command in ("bash run.sh cluster", "bash run.sh test"):
        assert command in text, f"README.md does not name `{command}`"
    # run.sh really has both (the README promises them unchanged).
    run_sh = (REPO / "run.sh").read_text(encoding="utf-8")
    assert re.search(r"^\s*cluster\)", run_sh, re.M) and re.search(r"^\s*test\)", run_sh, re.M)


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_a_file(doc: Path):
    missing = [t for t in _relative_links(doc) if t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(REPO)} links to files that do not exist: {missing}"


def test_link_check_sees_a_dead_link(tmp_path: Path):
    """The check above must be able to fail: a dead link and a live one."""
    (tmp_path / "there.md").write_text("x")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](there.md#top) [b](gone.md) [c](https://example.com/x.md) [d](#anchor)\n")
    assert _relative_links(doc) == ["there.md", "gone.md"]
    assert [t for t in _relative_links(doc) if not (doc.parent / t).exists()] == ["gone.md"]


def test_subcommand_parser_reads_code_blocks_only():
    text = ("Prose naming metalog bogus is not a command.\n"
            "```\n.venv/bin/metalog cluster kill $LEADER   # comment\n"
            "from metalog.broker.client import X\nmetalog produce --no-idempotence x\n```\n")
    assert _subcommands(text) == {("cluster", "kill"), ("produce",)}


def test_every_metalog_subcommand_in_the_readme_exists():
    commands = _subcommands(README.read_text(encoding="utf-8"))
    assert commands, "README.md shows no `metalog <subcommand>` in its code blocks"
    ordered = sorted(commands)
    # The check must be able to fail: a subcommand that does not exist is refused.
    *codes, bogus = _help_exit_codes([*ordered, ("no-such-subcommand",)])
    assert bogus != 0, "metalog accepts any subcommand: this check would prove nothing"
    failed = [" ".join(words) for words, code in zip(ordered, codes) if code != 0]
    assert not failed, f"README.md shows metalog subcommands that `--help` refuses: {failed}"
