"""The house keeps its rooms (issue 31's measures, held by the suite):
broker/ is a hall of rooms, not a heap of modules (at most 12 modules
directly in it, each room a package whose docstring says its job), and no
class over 450 lines or function over 100 lines in broker/, storage/ and
protocol/, so that each can be read at once. The import contracts per room
are tests/test_layers.py; the types, tests/test_types.py."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from metalog.tools.cluster.launcher import REPO_ROOT

CLASS_LINES_MAX = 450
FUNCTION_LINES_MAX = 100
BROKER_MODULES_MAX = 12
ROOMS = ("quorum", "controller", "net", "client", "server")


def _too_long(root: str) -> list[str]:
    found = []
    for path in sorted(Path(REPO_ROOT, root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                limit = CLASS_LINES_MAX
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = FUNCTION_LINES_MAX
            else:
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}: {lines} lines (max {limit})")
    return found


def test_no_class_or_function_too_long_to_read_at_once():
    assert [line for root in ("broker", "storage", "protocol") for line in _too_long(root)] == []


def test_broker_is_a_hall_of_rooms():
    broker = Path(REPO_ROOT, "broker")
    modules = sorted(p.name for p in broker.glob("*.py"))
    assert len(modules) <= BROKER_MODULES_MAX, modules
    rooms = sorted(p.name for p in broker.iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(ROOMS)
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((broker / room / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 8, f"broker/{room}/__init__.py: say what the room is for"


def test_the_size_check_can_fail(tmp_path, monkeypatch):
    """A function of 101 lines is named, with its file, line and length."""
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def long_one():\n{body}\n")
    monkeypatch.setattr(f"{__name__}.REPO_ROOT", str(tmp_path))
    assert _too_long("pkg") == [f"{os.path.join('pkg', 'm.py')}:1 long_one: 101 lines (max 100)"]
