"""One marked section of a Markdown file (docs/results.md), replaced in place by the scripts and
benchmarks that generate it: the text between `<!-- begin: NAME -->` and `<!-- end: NAME -->`
(markers included) is swapped for a new block, or the block is appended when the file has none."""

from __future__ import annotations

import os


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of section NAME."""
    return f"<!-- begin: {name} -->", f"<!-- end: {name} -->"


def write_section(path: str, name: str, body: str) -> None:
    """Replace (or append) section NAME of `path` with `body` between its markers (a blank line
    before the end marker; what follows the section is kept as it was)."""
    begin, end = markers(name)
    block = f"{begin}\n{body.strip(chr(10))}\n\n{end}\n"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + block + (tail[1:] if tail.startswith("\n") else tail)  # the blank line after stays
    else:
        text = text.rstrip("\n") + "\n\n" + block
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


__all__ = ["markers", "write_section"]
