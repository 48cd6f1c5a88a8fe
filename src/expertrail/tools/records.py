"""Tables in README.md and docs/ written from the JSON records under docs/results/, so that a
figure shown and its record cannot disagree.

A generated block sits in a Markdown file between two comments, which name the record (relative
to docs/) and how to show it:

    <!-- record: results/bench-default.json bench -->
    ```
    ...the table, as the command printed it...
    ```
    <!-- end record -->

``python -m expertrail.tools.records`` checks every block of README.md and docs/*.md against
its record (exit 1, naming the blocks that differ); ``--write`` writes them anew. The test suite
runs the check (tests/test_records.py).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BLOCK = re.compile(r"(<!-- record: (\S+) (\S+) -->\n)(.*?)(<!-- end record -->)", re.S)


def _fenced(text: str) -> str:
    return f"```\n{text.rstrip()}\n```\n"


def _bench(record: dict) -> str:
    """`expertrail bench`'s table, as it prints it."""
    from .bench import format_table
    return _fenced(format_table(record))


def _decode(record: dict) -> str:
    """`expertrail bench --decode`'s table, as it prints it."""
    from .bench_decode import format_decode
    results = {mode: {int(tokens): r for tokens, r in sizes.items()} for mode, sizes in record["results"].items()}
    return _fenced(format_decode(dict(record, results=results)))       # JSON keys are strings


def _train(record: dict) -> str:
    """`expertrail train`'s summary lines (per backend: the largest difference from the
    single-process run, the first and last loss)."""
    lines = []
    for name, r in record["backends"].items():
        lines.append(f"{name}: max |loss - single process| = {r['max_abs_diff']:.2e}, loss {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f}")
    return _fenced("\n".join(lines))


KINDS = {"bench": _bench, "decode": _decode, "train": _train}


def render(kind: str, record_path: Path) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}; known: {sorted(KINDS)}")
    return KINDS[kind](json.loads(record_path.read_text()))


def blocks(document: Path, docs: Path) -> list[tuple[str, str, str, str]]:
    """(record, kind, shown, rendered) of every block of ``document``; records are relative to
    ``docs``."""
    text = document.read_text()
    return [(record, kind, shown, render(kind, docs / record)) for _, record, kind, shown, _ in BLOCK.findall(text)]


def rewrite(document: Path, docs: Path) -> bool:
    """Write ``document``'s blocks anew from their records; whether anything changed."""
    text = document.read_text()
    new = BLOCK.sub(lambda m: m.group(1) + render(m.group(3), docs / m.group(2)) + m.group(5), text)
    if new != text:
        document.write_text(new)
    return new != text


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m expertrail.tools.records", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: here)")
    parser.add_argument("--write", action="store_true", help="write the blocks anew from their records")
    args = parser.parse_args(argv)
    docs, stale = args.root / "docs", []
    for document in documents(args.root):
        if args.write:
            if rewrite(document, docs):
                print(f"wrote {document}")
            continue
        stale += [f"{document}: {record} ({kind})" for record, kind, shown, rendered in blocks(document, docs)
                  if shown != rendered]
    for line in stale:
        print(f"differs from its record: {line}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
