"""The fenced code blocks of a Markdown file, with their doc-test directives.

A block is a fence at the start of a line: three backticks and a language (``python``,
``bash``, ``json`` or ``text``), its lines, three backticks. HTML comments on the lines
right above the fence tell the doc-test (tests/test_docs.py) what to do with it; they are
invisible on GitHub but are part of the README's source, so the reason for every
exception is kept next to the block it concerns:

* ``<!-- doctest: skip (REASON) -->``: the block is not run (listed as skipped, with
  REASON);
* ``<!-- doctest: skip "PREFIX" (REASON) -->``: in a bash block, the commands starting
  with PREFIX are not run;
* ``<!-- doctest: file NAME -->``: the block is the file NAME, written into the
  doc-test's folder before anything runs, and run by a later command that names it.

Block ids are ``<section slug>-<n>`` (the n-th block under the nearest heading), and a
bash block's commands ``<id>.<k>``: stable while text moves inside a section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LANGUAGES = ("python", "bash", "json", "text")
_DIRECTIVE = re.compile(r"^<!--\s*doctest:\s*(.*?)\s*-->\s*$")
_SKIP = re.compile(r'^skip\s+(?:"([^"]+)"\s+)?\((.+)\)$')
_FILE = re.compile(r"^file\s+(\S+)$")


class DocBlockError(ValueError):
    """A Markdown file whose blocks or directives the doc-test cannot read."""


@dataclass(frozen=True)
class Command:
    """One command of a bash block (continuation lines joined)."""

    id: str
    line: int
    text: str
    skip: str | None = None  # the reason, when a directive skips it


@dataclass(frozen=True)
class Block:
    id: str
    path: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None = None
    file: str | None = None
    skip_prefixes: dict[str, str] = field(default_factory=dict)  # prefix -> reason

    def commands(self) -> list[Command]:
        """The commands of a bash block: comment-only and blank lines left out, lines
        ending in a backslash joined with the next."""
        out: list[Command] = []
        pending, start = "", 0
        for i, raw in enumerate(self.text.splitlines()):
            line = raw.rstrip()
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if not pending:
                start = self.line + 1 + i
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            text = (pending + line).strip()
            pending = ""
            reason = next((r for p, r in self.skip_prefixes.items() if text.startswith(p)), None)
            out.append(Command(f"{self.id}.{len(out) + 1}", start, text, reason))
        unused = [p for p in self.skip_prefixes if not any(c.text.startswith(p) for c in out)]
        if unused:
            raise DocBlockError(f"{self.path}:{self.line}: skip prefix {unused[0]!r} matches no command")  # fmt: skip
        return out


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-") or "top"


def read_blocks(path: str) -> list[Block]:
    """Every fenced block of the Markdown file ``path``, in order."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks: list[Block] = []
    section, count = "top", 0
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section, count = _slug(line.lstrip("#")), 0
        if not line.startswith("```"):
            i += 1
            continue
        lang = line[3:].strip()
        if lang not in LANGUAGES:
            raise DocBlockError(
                f"{path}:{i + 1}: a code block needs one of the languages {LANGUAGES} "
                f"(got {lang!r}): say what it is, `text` if it is not code"
            )
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise DocBlockError(f"{path}:{i + 1}: code block never closed")
        count += 1
        skip, file, prefixes = None, None, {}
        j = i - 1
        while j >= 0 and (m := _DIRECTIVE.match(lines[j])):
            words = m.group(1)
            if s := _SKIP.match(words):
                if s.group(1):
                    prefixes[s.group(1)] = s.group(2)
                else:
                    skip = s.group(2)
            elif named := _FILE.match(words):
                file = named.group(1)
            else:
                raise DocBlockError(f"{path}:{j + 1}: unknown doctest directive {words!r}")
            j -= 1
        if prefixes and lang != "bash":
            raise DocBlockError(f'{path}:{i + 1}: skip "PREFIX" is for bash blocks')
        if file and lang != "python":
            raise DocBlockError(f"{path}:{i + 1}: file NAME is for python blocks")
        text = "\n".join(lines[i + 1 : end]) + "\n"
        bid = f"{section}-{count}"
        blocks.append(Block(bid, path, i + 1, lang, text, skip, file, prefixes))
        i = end + 1
    return blocks
