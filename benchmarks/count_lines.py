"""Lines of the source trees, per package folder: the figures of docs/architecture.md's
"The package in figures".

Counts ``.py`` files (generated gRPC code, ``*_pb2*``, excluded) of the installed package
(``radixkv/`` and ``service/``, which installs as ``radixkv.service``), ``tests/`` and
``benchmarks/``, and the C sources of the compiled paths. Each line is one of: blank, comment
(a line that starts with ``#``), docstring (inside a module, class or function docstring) or
code (the rest). ``--rev REV`` counts a commit of the git checkout instead of the working
tree (``git archive`` into a temporary folder).

    python benchmarks/count_lines.py                 # the working tree, a Markdown table
    python benchmarks/count_lines.py --rev 6c7e6d1   # a commit
    python benchmarks/count_lines.py --json out.json
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import NamedTuple

TREES = {"package": ("radixkv", "service"), "tests": ("tests",), "benchmarks": ("benchmarks",)}


class Lines(NamedTuple):
    files: int
    lines: int
    blank: int
    comment: int
    doc: int

    @property
    def code(self) -> int:
        return self.lines - self.blank - self.comment - self.doc

    def __add__(self, other: object) -> Lines:
        if not isinstance(other, Lines):
            return NotImplemented
        return Lines(*(a + b for a, b in zip(self, other)))


ZERO = Lines(0, 0, 0, 0, 0)


def count_file(path: Path) -> Lines:
    """One ``.py`` file's lines by kind (a docstring's blank lines count as docstring). O(file)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    in_doc: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str) and first.end_lineno is not None:
                in_doc.update(range(first.lineno, first.end_lineno + 1))
    rest = [s.strip() for i, s in enumerate(lines, 1) if i not in in_doc]
    blank = sum(1 for s in rest if not s)
    comment = sum(1 for s in rest if s.startswith("#"))
    return Lines(1, len(lines), blank, comment, len(in_doc))


def python_files(root: Path, top: str) -> list[Path]:
    return sorted(p for p in (root / top).rglob("*.py") if "_pb2" not in p.name)


def folder_of(root: Path, path: Path) -> str:
    """The package folder a file counts under (``service/...`` as ``radixkv.service``)."""
    rel = path.parent.relative_to(root).parts
    if rel[0] == "service":
        return ".".join(("radixkv", "service", *rel[1:2]))
    return ".".join(rel[:2])


def count(root: Path) -> dict:
    """Per tree and per package folder (two levels), plus the C sources' line count."""
    trees = {name: ZERO for name in TREES}
    folders: dict[str, Lines] = {}
    for name, tops in TREES.items():
        for top in tops:
            if not (root / top).is_dir():
                continue
            for p in python_files(root, top):
                n = count_file(p)
                trees[name] = trees[name] + n
                if name == "package":
                    key = folder_of(root, p)
                    folders[key] = folders.get(key, ZERO) + n
    c_lines = sum(len(p.read_text(encoding="utf-8").splitlines())
                  for p in sorted((root / "radixkv").rglob("*.[ch]")))
    return {"trees": {k: v._asdict() | {"code": v.code} for k, v in trees.items()},
            "package_folders": {k: v._asdict() | {"code": v.code} for k, v in sorted(folders.items())},
            "c_lines": c_lines}


def checkout(rev: str, into: str) -> Path:
    """The files of commit ``rev`` under ``into`` (``git archive``)."""
    data = subprocess.run(["git", "archive", "--format=tar", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return Path(into)


def table(doc: dict) -> str:
    head = ("| {} | files | lines | code | docstrings | comments | blank |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    row = "| {name} | {files:,} | {lines:,} | {code:,} | {doc:,} | {comment:,} | {blank:,} |\n"
    out = head.format("tree") + "".join(row.format(name=k, **v) for k, v in doc["trees"].items())
    out += f"\nC sources of the compiled paths: {doc['c_lines']:,} lines\n\n"
    out += head.format("package folder") + "".join(row.format(name=k, **v) for k, v in doc["package_folders"].items())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="count this commit instead of the working tree")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = checkout(args.rev, tmp) if args.rev else Path(__file__).resolve().parent.parent
        doc = count(root)
    doc["rev"] = args.rev or "working tree"
    print(table(doc), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
