"""The docstring budget of the installed package, and no references to things that do not ship.

A docstring says what, cost and invariants in a few lines: a module's at most 15 lines, a
class's 12, a function's 10 (``ast.get_docstring(node, clean=True)``); the story goes to
``docs/`` (``docs/internals.md`` and the topic pages). A docstring never points at what a
reader of the package cannot open: a seed document's sections, issue numbers, session notes.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import radixkv.service

BUDGET = {"module": 15, "class": 12, "function": 10}

# References to documents that do not ship with the package.
NOT_SHIPPED = re.compile(
    r"\bseed(?:'s)? (?:section|§)|\bissues? #?\d+|\bsession notes?\b|\bstop \d+", re.IGNORECASE
)


def docstrings(source: str) -> Iterator[tuple[str, str, str]]:
    """``(kind, qualified name, docstring)`` of the module, every class and every function."""
    tree = ast.parse(source)
    text = ast.get_docstring(tree, clean=True)
    if text:
        yield "module", "<module>", text

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    yield ("class" if isinstance(child, ast.ClassDef) else "function"), name, doc
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def problems(source: str) -> list[str]:
    """Each docstring of ``source`` over its budget, and each reference to what does not ship."""
    found = []
    for kind, name, text in docstrings(source):
        lines = len(text.splitlines())
        if lines > BUDGET[kind]:
            found.append(f"{name}: {kind} docstring of {lines} lines (budget {BUDGET[kind]})")
        for match in NOT_SHIPPED.finditer(text):
            found.append(f"{name}: refers to {match.group(0)!r}, which does not ship")
    return found


def package_modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the installed package (generated code aside).

    ``radixkv.service`` is installed from ``service/`` (an editable install maps it there), so
    both roots are walked; a module found under both is counted once.
    """
    roots = [(Path(radixkv.__file__).parent, "radixkv"),
             (Path(radixkv.service.__file__).parent, "radixkv.service")]
    modules: dict[str, Path] = {}
    for root, package in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "_gen" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules.setdefault(".".join((package, *parts)), path)
    return modules


def test_the_checker_flags_long_docstrings_and_unshipped_references() -> None:
    body = "\n".join(f"    line {i}" for i in range(10))
    source = (
        '"""Module.\n\n' + "\n".join(f"m{i}" for i in range(14)) + '\n"""\n'
        "def short():\n"
        '    """Ten lines exactly.\n' + "\n".join(f"    l{i}" for i in range(9)) + '\n    """\n'
        "def long():\n"
        '    """Eleven lines.\n' + body + '\n    """\n'
        "class C:\n"
        '    """Thirteen lines.\n' + "\n".join(f"    c{i}" for i in range(12)) + '\n    """\n'
        "    async def m(self):\n"
        '        """As in seed section 5 and issue 17; see the session notes."""\n'
    )
    assert problems(source) == [
        "<module>: module docstring of 16 lines (budget 15)",
        "long: function docstring of 11 lines (budget 10)",
        "C: class docstring of 13 lines (budget 12)",
        "C.m: refers to 'seed section', which does not ship",
        "C.m: refers to 'issue 17', which does not ship",
        "C.m: refers to 'session notes', which does not ship",
    ]
    assert problems('"""Fine.\n\nissues with tokens, a seed of 42."""\n') == []


def test_the_walk_covers_the_package_and_the_service() -> None:
    modules = package_modules()
    assert "radixkv.cache.radix_key" in modules
    assert "radixkv.service.server.manager" in modules
    assert not [name for name in modules if "._gen" in name]


def test_docstrings_within_budget_and_no_unshipped_references() -> None:
    report = []
    for name, path in package_modules().items():
        report += [f"{name}: {p}" for p in problems(path.read_text(encoding="utf-8"))]
    assert not report, "docstrings over budget (the story goes to docs/):\n" + "\n".join(report)
