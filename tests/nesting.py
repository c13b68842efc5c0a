"""List functions whose blocks nest deeper than two levels (issue 14; STYLE.md: shallow nesting).

Run `python tests/nesting.py [--max 2] [PATH...]` (default: kerncc/, passes/, runtime/). Depth
counts the compound statements (if, for, while, with, try, match) enclosing a statement inside
one function; `elif` chains count once, nested functions are measured on their own. Prints
`depth path:line function`, deepest first, and the count.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
          ast.Match) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _children(node: ast.AST) -> Iterator[list[ast.stmt]]:
    if isinstance(node, ast.If):
        yield node.body
        # `elif` is an If alone in orelse: the same level, not one deeper.
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            yield from _children(node.orelse[0])
        else:
            yield node.orelse
        return
    if isinstance(node, ast.Match):
        for case in node.cases:
            yield case.body
        return
    for name in ("body", "orelse", "finalbody"):
        yield getattr(node, name, [])
    for handler in getattr(node, "handlers", []):
        yield handler.body


def depth(body: list[ast.stmt]) -> int:
    """The deepest block nesting in `body` (0: straight-line code)."""
    best = 0
    for stmt in body:
        if isinstance(stmt, FUNCTIONS + (ast.ClassDef,)):
            continue
        if isinstance(stmt, BLOCKS):
            best = max(best, 1 + max((depth(b) for b in _children(stmt)), default=0))
    return best


def deep_functions(paths: list[Path], limit: int) -> list[tuple[int, str, str]]:
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, FUNCTIONS) and (d := depth(node.body)) > limit:
                found.append((d, f"{path}:{node.lineno}", node.name))
    return sorted(found, key=lambda row: (-row[0], row[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=2, help="allowed depth (default 2)")
    parser.add_argument("paths", nargs="*", default=["kerncc", "passes", "runtime"])
    args = parser.parse_args(argv)
    files = sorted(f for p in map(Path, args.paths)
                   for f in ([p] if p.is_file() else p.rglob("*.py")))
    rows = deep_functions(files, args.max)
    for d, where, name in rows:
        print(f"{d} {where} {name}")
    print(f"{len(rows)} functions nest deeper than {args.max} levels", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
