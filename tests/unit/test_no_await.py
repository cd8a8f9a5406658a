"""The core's critical sections stay free of ``await`` (ckptfs/core/critical.py).

Reads ``ckptfs/core`` with ``ast``: every function marked ``@no_await`` must be a plain
``def`` without ``await``, ``async for`` or ``async with`` (nor an async function nested
in it), and the sections the core's invariants rely on must be marked."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "ckptfs" / "core"

# (module, class, function): the sections decisions 0013 and 0018 name.
REQUIRED = {
    ("refresh", "Refresh", "_apply_listing"),
    ("refresh", "Refresh", "_take_entry"),
    ("refresh", "Refresh", "_forget_vanished"),
    ("entries", "EntryIO", "adopt"),
    ("held", "HeldEntries", "show_again"),
    ("refresh", "Refresh", "_forget_subtree"),
    ("listed_dirs", "ListedDirIds", "check"),
    ("listed_dirs", "ListedDirIds", "_movable"),
    ("listed_dirs", "ListedDirIds", "_move_here"),
    ("publish", "Publish", "_commit"),
    ("publish", "Publish", "_land"),
    ("rename", "Rename", "_move_locally"),
    ("names", "Names", "_unlink_locally"),
}


def _is_marker(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "no_await") or \
        (isinstance(node, ast.Attribute) and node.attr == "no_await")


def _marked() -> dict[tuple[str, str, str], ast.FunctionDef | ast.AsyncFunctionDef]:
    found = {}
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        any(_is_marker(d) for d in fn.decorator_list):
                    found[(path.stem, cls.name, fn.name)] = fn
    return found


def _awaits(fn: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(fn):
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
            bad.append(f"line {node.lineno}: {type(node).__name__}")
        elif isinstance(node, ast.AsyncFunctionDef):
            bad.append(f"line {node.lineno}: async def {node.name}")
    return bad


def test_marked_sections_have_no_await() -> None:
    marked = _marked()
    assert marked, "no @no_await section found in ckptfs/core"
    offenders = {f"{m}.{c}.{f}": _awaits(fn) for (m, c, f), fn in marked.items()
                 if _awaits(fn)}
    assert not offenders, f"await inside a critical section: {offenders}"


def test_the_core_invariants_are_marked() -> None:
    missing = REQUIRED - set(_marked())
    assert not missing, f"critical sections not marked @no_await: {sorted(missing)}"


def test_the_check_sees_an_await() -> None:
    """The checker itself: an ``await`` or an ``async def`` is found."""
    tree = ast.parse("async def f():\n    await g()\n")
    assert _awaits(tree) == ["line 1: async def f", "line 2: Await"]
