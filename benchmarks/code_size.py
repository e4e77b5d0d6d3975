"""The size of a source folder at git revisions: lines and bytes, and two measures that the
formatting does not move, code tokens and prose words.

Lines fall when statements are joined or paragraphs rewrapped, with nothing removed; the
tokens of the Python code (every token outside strings and comments, one per string) and the
words of its prose (docstrings, strings, comments, and every other file such as a report
template) do not. Counting a change by lines alone can therefore report a reduction that is
only a reformatting. One f-string counts as one string (Python 3.11 tokenizes it whole).

Usage: .venv/bin/python benchmarks/code_size.py [--folder src/fedfm/reproduce] REV [REV ...]
(``WT``: the working tree).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path

LAYOUT = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


@dataclass
class Size:
    """Totals of a set of files."""

    files: int = 0
    lines: int = 0
    bytes: int = 0
    code_tokens: int = 0
    prose_words: int = 0

    def add(self, path: str, text: str) -> None:
        """Counts one file (Python: tokens and prose words; any other: prose words)."""
        self.files += 1
        self.lines += text.count("\n")
        self.bytes += len(text.encode("utf-8"))
        if not path.endswith(".py"):
            self.prose_words += len(text.split())
            return
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                self.prose_words += len(tok.string.split())
            if tok.type not in LAYOUT and tok.type != tokenize.COMMENT:
                self.code_tokens += 1


def git(*args: str) -> str:
    """The output of one git command (an error stops the benchmark)."""
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def files_at(rev: str, folder: str) -> dict[str, str]:
    """Path -> text of every file under ``folder`` at ``rev`` (``WT``: the working tree)."""
    if rev == "WT":  # the files git would commit (tracked or new, not ignored)
        listed = git("ls-files", "--cached", "--others", "--exclude-standard", folder).split()
        return {n: Path(n).read_text() for n in listed if Path(n).is_file()}
    names = git("ls-tree", "-r", "--name-only", rev, folder).split()
    return {n: git("show", f"{rev}:{n}") for n in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("revs", nargs="+", help="git revisions; WT for the working tree")
    p.add_argument("--folder", default="src/fedfm/reproduce")
    args = p.parse_args()
    sizes = {rev: Size() for rev in args.revs}
    for rev, total in sizes.items():
        for path, text in files_at(rev, args.folder).items():
            total.add(path, text)
    first = next(iter(sizes.values()))
    print(f"{args.folder}: size per revision (change from {args.revs[0]})")
    columns = (("lines", 14), ("bytes", 16), ("code_tokens", 15), ("prose_words", 15))
    titles = " ".join(key.replace("_", " ").rjust(width) for key, width in columns)
    print(f"{'revision':>12} {'files':>5} {titles}")
    for rev, s in sizes.items():
        cells = []
        for key, width in columns:
            now, then = getattr(s, key), getattr(first, key)
            change = f"{(now - then) / then:+.0%}" if then else ""
            cells.append(f"{now:,} {change:>5}".rjust(width))
        print(f"{rev:>12} {s.files:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()
