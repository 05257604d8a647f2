"""A document's way through `sekv ask` to its store, as a call graph: the files it enters.

    python scripts/ask_path.py sample_docs/lighthouse.md       # this checkout
    python scripts/ask_path.py sample_docs/lighthouse.md --root OTHER_CHECKOUT

Runs `sekv ask DOC QUESTION` in this process under a scratch $SEKV_HOME (the store is built
first, untraced) and follows every Python call into the checkout's ``sekv_*`` packages, leaving
out code run at import, until the SeKV method's ``prepare`` returns (the store is loaded and the
memory set up); separately, the calls under ``load_store``. Each caller -> callee edge counts
once, in the order first taken. Prints, per path: the files entered, the *returns* (edges into
another file already entered) and the edges. With ``--edges``, also the files in the order
entered and the file-level caller -> callee edges with their counts, in the order first taken,
a return marked ``<-``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

QUESTION = "What is this document about?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("document", type=Path)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--edges", action="store_true", help="list the files and file edges")
    args = parser.parse_args()
    root = str(args.root.resolve())
    sys.path.insert(0, root)
    os.environ.setdefault("SEKV_HOME", tempfile.mkdtemp(prefix="sekv-path-"))
    import sekv_core
    from sekv_cli.main import app

    if not sekv_core.__file__.startswith(root):
        sys.exit(f"Error: sekv_core imported from {sekv_core.__file__}; run with PYTHONPATH={root}")

    document = str(args.document.resolve())
    ask = ["ask", document, QUESTION, "--max-new-tokens", "1"]
    app(ask, standalone_mode=False)  # builds the store: not traced
    paths = {"ask": [], "load_store": []}
    sys.settrace(Tracer(root, paths))
    try:
        app(ask, standalone_mode=False)
    finally:
        sys.settrace(None)
    for name, edges in paths.items():
        files, returns = walk(edges)
        print(f"{name}: {len(files)} files, {returns} returns, {len(edges)} edges")
        if args.edges:
            print_edges(files, edges)


class Tracer:
    """Records each new caller -> callee edge (their files, relative to ``root``) in ``paths``:
    under ``ask`` until a method's ``prepare`` returns, under ``load_store`` within it."""

    def __init__(self, root: str, paths: dict[str, list[tuple[str | None, str]]]) -> None:
        self.root, self.paths = root, paths
        self.seen: dict[str, set] = {name: set() for name in paths}
        self.asking, self.loading = True, 0

    def ours(self, code) -> bool:
        return code.co_filename.startswith(self.root) and "/sekv_" in code.co_filename

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if not self.ours(code):
            return None
        if event == "call":
            if importing(frame):
                return None
            caller = frame.f_back
            while caller is not None and not self.ours(caller.f_code):
                caller = caller.f_back
            edge = (caller.f_code if caller else None, code)
            if code.co_name == "load_store":
                self.loading += 1
            elif self.loading:
                self.record("load_store", edge)
            if self.asking:
                self.record("ask", edge)
            return self
        if event == "return":
            if code.co_name == "load_store":
                self.loading -= 1
            if code.co_name == "prepare" and "/methods/" in code.co_filename:
                self.asking = False
        return self

    def record(self, name: str, edge: tuple) -> None:
        if edge not in self.seen[name]:
            self.seen[name].add(edge)
            files = (os.path.relpath(c.co_filename, self.root) if c else None for c in edge)
            self.paths[name].append(tuple(files))


def importing(frame) -> bool:
    """Whether ``frame`` runs under a module's import (its top-level code)."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_code.co_filename != __file__:
            return True
        frame = frame.f_back
    return False


def walk(edges: list[tuple[str | None, str]]) -> tuple[list[str], int]:
    """The files in the order entered, and the edges into another file already entered."""
    files: list[str] = []
    returns = 0
    for caller, callee in edges:
        if caller is not None and caller not in files:
            files.append(caller)
        if callee != caller and callee in files:
            returns += 1
        if callee not in files:
            files.append(callee)
    return files, returns


def print_edges(files: list[str], edges: list[tuple[str | None, str]]) -> None:
    """The files in the order entered, then each file-level caller -> callee edge (calls within
    one file left out) with how many function-level edges it stands for; ``<-`` marks those
    that return into a file entered before."""
    for number, name in enumerate(files, 1):
        print(f"  {number:3d} {name}")
    counts: dict[tuple[str | None, str], int] = {}
    back: dict[tuple[str | None, str], int] = {}
    entered: set[str | None] = set()
    for caller, callee in edges:
        entered.add(caller)
        if callee != caller:
            counts[caller, callee] = counts.get((caller, callee), 0) + 1
            if callee in entered:
                back[caller, callee] = back.get((caller, callee), 0) + 1
        entered.add(callee)
    for (caller, callee), count in counts.items():
        mark = f"  <- {back[caller, callee]}" if (caller, callee) in back else ""
        print(f"  {count:3d}  {caller} -> {callee}{mark}")


if __name__ == "__main__":
    main()
