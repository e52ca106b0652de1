"""Griffe extension for the documentation site: doctest examples become code blocks.

fnattn's docstrings hold their examples as bare doctest sessions (``>>>`` lines,
``...`` continuations and the expected output), wherever they fit: after the
summary, after an "Args:" or "Returns:" section, in a module docstring. pytest
runs them (``--doctest-modules``). Markdown, though, reads a line starting with
``>`` as a blockquote, so an example would render as grey run-on prose with its
prompts eaten. Once the package is loaded, every docstring is rewritten so that
each session is a fenced ``pycon`` block (a highlighted Python console) before
Markdown sees it:

* a session starts at a line whose first characters (after its indentation) are
  ``>>>`` and runs, as doctest reads it, over the lines that follow it at that
  indentation or deeper until a blank line; sessions separated only by blank
  lines join into one block;
* the fence takes the session's indentation, so a session inside an indented
  block (a Google section, "Example:" followed by an indented session) stays in it;
* doctest directives (``# doctest: +ELLIPSIS``) are dropped from the shown code,
  as they are noise to a reader;
* a session that is already inside a fenced block is left alone.

The source is not touched: pytest still runs the docstrings as written.

Loaded by mkdocs.yml (plugins: mkdocstrings: handlers: python: options:
extensions) before ``sphinx_roles``, which leaves fenced blocks alone; nothing in
the package imports it.
"""

import re

import griffe

PROMPT = re.compile(r"^(?P<indent>[ \t]*)>>>(?: |$)")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
DIRECTIVE = re.compile(r"[ \t]*#[ \t]*doctest:.*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def fence_sessions(text: str) -> str:
    """``text`` with every doctest session wrapped in a fenced ``pycon`` block."""
    lines = text.split("\n")
    out = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence = not in_fence
        start = None if in_fence else PROMPT.match(line)
        if start is None:
            out.append(line)
            i += 1
            continue
        indent = start["indent"]
        width = len(indent)
        session = []
        while i < len(lines):
            # One doctest example run: the prompt line and what follows it until a blank line.
            while i < len(lines) and lines[i].strip() and _indent(lines[i]) >= width:
                session.append(DIRECTIVE.sub("", lines[i]))
                i += 1
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            after = PROMPT.match(lines[j]) if j < len(lines) else None
            if after is None or len(after["indent"]) != width:
                break
            session += [""] * (j - i)  # blank lines between two runs stay inside the block
            i = j
        out += [f"{indent}```pycon", *session, f"{indent}```"]
    return "\n".join(out)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class DoctestBlocks(griffe.Extension):
    """Rewrites the docstrings of a package once it is loaded (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None and ">>>" in obj.docstring.value:
                obj.docstring.value = fence_sessions(obj.docstring.value)
