"""File and function sizes of the package, for keeping modules near ~400 lines and
functions near ~50: ``python scripts/code_sizes.py [PACKAGE_DIR] [--top N]``.

Prints the files over 400 lines, the classes with more than 25 methods, and the longest
functions (lines from ``def`` to the end, docstring included). Generated stubs are skipped.
"""

from __future__ import annotations

import argparse
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", type=pathlib.Path, default=ROOT / "asyncdiloco")
    parser.add_argument("--top", type=int, default=15, help="how many of the longest functions to list")
    args = parser.parse_args()
    files, funcs = [], []
    for path in sorted(args.package.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        rel, text = path.relative_to(args.package), path.read_text()
        files.append((len(text.splitlines()), str(rel)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
            elif isinstance(node, ast.ClassDef):
                methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > 25:
                    print(f"class {rel}:{node.name}: {node.end_lineno - node.lineno + 1} lines, {len(methods)} methods")
    print(f"{len(files)} modules, {sum(n for n, _ in files)} lines")
    print("files over 400 lines:", ", ".join(f"{f} ({n})" for n, f in sorted(files, reverse=True) if n > 400) or "none")
    funcs.sort(reverse=True)
    print(f"functions over 50 lines: {sum(1 for n, _ in funcs if n > 50)}; the longest:")
    for n, name in funcs[: args.top]:
        print(f"  {n:4d}  {name}")


if __name__ == "__main__":
    main()
