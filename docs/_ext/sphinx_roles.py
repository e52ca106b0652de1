"""Griffe extension for the documentation site: Sphinx roles in docstrings become links.

fnattn's docstrings refer to objects the Sphinx way (":func:`rules`",
":class:`~fnattn.AttentionSpec`", ":mod:`.layouts`"). Markdown shows those as
stray text, so once the package is loaded every docstring is rewritten:

* a name that resolves to an fnattn object becomes an optional cross-reference
  (a link where the site documents the object, plain code where it does not,
  e.g. private helpers);
* a name that resolves outside fnattn, or a dotted name that does not start
  in the module's scope (``jax.lax.psum``), becomes plain code;
* a plain name that does not resolve, or a name of an fnattn object that does
  not exist, is a stale reference: a warning, which fails
  ``mkdocs build --strict``.

A paragraph ending in the reStructuredText literal marker "::" ends in ":"
(the indented block after it is already a Markdown code block).

Fenced code blocks (the doctest sessions ``doctest_blocks`` fences, which runs
first) are left as they are: code shows what it says.

Loaded by mkdocs.yml (plugins: mkdocstrings: handlers: python: options:
extensions); nothing in the package imports it.
"""

import html
import re

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`(?P<target>[^`]+)`")
LITERAL_MARKER = re.compile(r"(?<=\S)::(?=\n\n|\n?$)")
FENCED = re.compile(r"^([ \t]*)(```|~~~).*?^\1\2[ \t]*$", re.M | re.S)
ROOT = "fnattn"


def _absolute(obj: griffe.Object, name: str) -> str:
    """The full path of ``name`` as written in ``obj``'s docstring (may not exist)."""
    if name.startswith("."):
        module = obj if obj.is_module else obj.module
        base = module.path if module.is_init_module else module.path.rpartition(".")[0]
        dots = len(name) - len(name.lstrip("."))
        for _ in range(dots - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{name.lstrip('.')}"
    first, _, rest = name.partition(".")
    if first == ROOT:
        return name
    scope = obj if obj.is_module or obj.is_class else obj.parent
    head = scope.resolve(first)  # raises griffe.NameResolutionError
    return f"{head}.{rest}" if rest else head


def _exists(collection, path: str) -> bool:
    try:
        target = collection[path]
        if target.is_alias:
            target.final_target  # noqa: B018 - raises when the alias is broken
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _rewrite(obj: griffe.Object, text: str, collection) -> str:
    def replace(match: re.Match) -> str:
        written = match["target"].strip()
        name = written.lstrip("~")
        shown = name.rpartition(".")[2] if written.startswith("~") else name
        code = f"<code>{html.escape(shown)}</code>"
        try:
            path = _absolute(obj, name)
        except griffe.NameResolutionError:
            if "." in name:  # a dotted name outside the module's scope: jax.lax.psum
                return code
            griffe.logger.warning(
                f"{obj.relative_filepath}:{obj.docstring.lineno}: {obj.path}: stale reference "
                f"{match[0]}: {name!r} does not resolve; fix the name in the docstring")
            return code
        if path.partition(".")[0] != ROOT:
            return code
        if not _exists(collection, path):
            griffe.logger.warning(
                f"{obj.relative_filepath}:{obj.docstring.lineno}: {obj.path}: stale reference "
                f"{match[0]}: {path} does not exist; fix the name in the docstring")
            return code
        return f'<autoref identifier="{path}" optional>{code}</autoref>'

    def prose(part: str) -> str:
        return LITERAL_MARKER.sub(":", ROLE.sub(replace, part))

    pieces, end = [], 0
    for block in FENCED.finditer(text):
        pieces += [prose(text[end:block.start()]), block[0]]
        end = block.end()
    return "".join(pieces) + prose(text[end:])


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SphinxRoles(griffe.Extension):
    """Rewrites the docstrings of a package once it is loaded (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj, obj.docstring.value, loader.modules_collection)
