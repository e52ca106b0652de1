"""The documentation site builds with ``mkdocs build --strict`` and holds what it should.

A broken link or anchor, a nav entry without a page, a docstring that documents a
parameter its function lacks, or a stale Sphinx role (``:func:`gone```) fails the
build; a page under docs/ missing from the nav fails ``test_every_page_is_in_the_nav``.
The build reads the sources statically (griffe) and needs no network.

The built HTML is then read as a reader sees it (one build for the module): every
``>>>`` example is in a code block on every page, never in a quote or a paragraph;
every docstring example of every object an API page documents is a prompt there;
no role markup shows as text; and every name of ``fnattn.__all__`` is reachable
from the nav through the API reference's root page.
"""

import collections
import html
import html.parser
import inspect
import logging
import os
import posixpath
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

import fnattn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
CONFIG = os.path.join(ROOT, "mkdocs.yml")
ENV = dict(os.environ, NO_MKDOCS_2_WARNING="1")


def _build(config: str, site_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", config,
         "--site-dir", site_dir],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _text(path: str) -> str:
    """The visible text of an HTML page's article, tags stripped."""
    page = open(path, encoding="utf-8").read()
    page = page.split("<article", 1)[1].split("</article>", 1)[0]
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def _nav_pages(nav) -> list:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            pages += _nav_pages(value)
        elif not re.match(r"[a-z]+://", value):
            pages.append(value)
    return pages


def _built(page: str) -> str:
    """The HTML file, relative to the site, that mkdocs builds from a page of docs/."""
    name = page[:-len(".md")]
    if posixpath.basename(name) == "index":
        return posixpath.join(posixpath.dirname(name), "index.html")
    return name + "/index.html"


def _config() -> dict:
    with open(CONFIG, encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = str(tmp_path_factory.mktemp("site"))
    res = _build(CONFIG, site_dir)
    assert res.returncode == 0, (
        "mkdocs build --strict failed; its warnings:\n"
        + "\n".join(line for line in (res.stdout + res.stderr).splitlines()
                    if "WARNING" in line or "ERROR" in line or "Error" in line))
    return site_dir


def test_site_has_every_nav_page(site):
    assert os.path.isfile(os.path.join(site, "index.html"))
    for page in _nav_pages(_config()["nav"]):
        html_path = _built(page)
        assert os.path.isfile(os.path.join(site, html_path)), f"{page} was not built"


def test_api_reference_is_generated_from_the_docstrings(site):
    text = _text(os.path.join(site, "api", "fnattn", "index.html"))
    # The signature as rendered from the source: every parameter of fnattn.attention.
    signature = re.search(r"attention\((.*?)\)\s*->\s*AttentionOutput", text, re.S)
    assert signature is not None, "no rendered signature of fnattn.attention"
    params = re.findall(r"(\w+):", signature[1])
    assert params == list(inspect.signature(fnattn.attention).parameters)
    summary = inspect.getdoc(fnattn.attention).splitlines()[0]
    assert html.unescape(summary.replace("``", "")) in text
    # Parameters are rendered from the Args section, and the example from the docstring.
    assert "Parameters:" in text and "jax.jit(fnattn.attention)(spec, q, k, v)" in text
    for page, names in {"masks": ["fnattn.masks.causal", "fnattn.masks.segments"],
                        "paged": ["fnattn.PagedKVCache", "fnattn.paged_attention"],
                        "sharding": ["fnattn.sharding.rules"],
                        "block_sizes": ["fnattn.TritonBlockSizes"]}.items():
        source = open(os.path.join(site, "api", page, "index.html"), encoding="utf-8").read()
        for name in names:
            assert f'id="{name}"' in source, f"{name} is not documented on api/{page}"


def test_sphinx_roles_become_links(site):
    for page in sorted(os.listdir(os.path.join(site, "api"))):
        if not os.path.isdir(os.path.join(site, "api", page)):
            continue
        text = _text(os.path.join(site, "api", page, "index.html"))
        assert not re.search(r":(func|class|meth|mod|data):", text), f"a raw role on api/{page}"
    source = open(os.path.join(site, "api", "sharding", "index.html"), encoding="utf-8").read()
    assert 'href="#fnattn.sharding.rules"' in source  # ":func:`rules`" in sharded_attention


def test_every_page_is_in_the_nav():
    on_disk = sorted(
        os.path.relpath(os.path.join(d, f), DOCS).replace(os.sep, "/")
        for d, dirs, files in os.walk(DOCS) for f in files if f.endswith(".md")
        if not any(part.startswith("_") for part in os.path.relpath(d, DOCS).split(os.sep)))
    missing = sorted(set(on_disk) - set(_nav_pages(_config()["nav"])))
    lines = []
    for page in missing:
        first = open(os.path.join(DOCS, page), encoding="utf-8").readline()
        title = first.lstrip("#").strip() if first.startswith("#") else page
        lines.append(f"      - {title}: {page}")
    assert not missing, ("pages under docs/ that mkdocs.yml's nav does not list; add under "
                         "the right section:\n" + "\n".join(lines))


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    with open(docs / "quickstart.md", "a", encoding="utf-8") as f:
        f.write("\nSee [the missing page](no_such_page.md).\n")
    config = _config()
    config["docs_dir"] = str(docs)
    python = config["plugins"][-1]["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [ROOT]
    python["options"]["extensions"] = [os.path.join(ROOT, e) for e in
                                       python["options"]["extensions"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    res = _build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert res.returncode != 0
    assert "no_such_page.md" in res.stdout + res.stderr


def test_a_stale_sphinx_role_is_a_warning(tmp_path, caplog):
    """The griffe extension of the site resolves every role against the package."""
    import griffe

    package = tmp_path / "fnattn"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        """Package.

        :func:`good` and :func:`fnattn.sub.helper` and :mod:`.sub` and
        :func:`jax.numpy.sum` and :func:`gone` and :func:`fnattn.sub.gone_too`.
        """
        from fnattn.sub import helper

        def good():
            """See :func:`helper`."""
        '''))
    (package / "sub.py").write_text('def helper():\n    """Help."""\n')
    extension = os.path.join(DOCS, "_ext", "sphinx_roles.py") + ":SphinxRoles"
    with caplog.at_level(logging.WARNING):
        pkg = griffe.load("fnattn", search_paths=[str(tmp_path)], try_relative_path=False,
                          extensions=griffe.load_extensions(extension))
    doc = pkg.docstring.value
    assert '<autoref identifier="fnattn.good" optional><code>good</code></autoref>' in doc
    assert 'identifier="fnattn.sub.helper"' in doc and 'identifier="fnattn.sub"' in doc
    assert "<code>jax.numpy.sum</code>" in doc and "jax.numpy.sum</autoref>" not in doc
    assert 'identifier="fnattn.sub.helper"' in pkg["good"].docstring.value
    stale = [r.getMessage() for r in caplog.records if "stale reference" in r.getMessage()]
    assert len(stale) == 2, stale
    assert "'gone' does not resolve" in stale[0] and "fnattn.sub.gone_too" in stale[1]


# What a reader sees: the built HTML, parsed (html.parser; no browser needed).

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}
DIRECTIVE = re.compile(r"[ \t]*#[ \t]*doctest:.*$")


class _Page(html.parser.HTMLParser):
    """One built page: where each ``>>>`` sits, its code blocks' text, its headings' ids."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []        # the open elements, outermost first
        self.prompts = []      # (ancestor tags, text) of each text node holding ">>>"
        self.nested_quotes = 0  # <blockquote> directly in a <blockquote>: Markdown's ">>>"
        self.code = []         # the text of each <pre> block
        self.heading_ids = []  # ids of mkdocstrings' object headings (class "doc-heading")
        self.shown_markup = []  # text showing an autoref tag (a role rewritten where no
        #                         Markdown is rendered, e.g. a Returns item's type)
        self._pre = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "doc-heading" in (attrs.get("class") or "").split() and attrs.get("id"):
            self.heading_ids.append(attrs["id"])
        if tag == "blockquote" and self.stack and self.stack[-1] == "blockquote":
            self.nested_quotes += 1
        if tag == "pre" and self._pre is None:
            self._pre = []
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack.pop() != tag:
                pass
        if tag == "pre" and "pre" not in self.stack and self._pre is not None:
            self.code.append("".join(self._pre))
            self._pre = None

    def handle_data(self, data):
        if self._pre is not None:
            self._pre.append(data)
        if ">>>" in data:
            self.prompts.append((tuple(self.stack), data.strip()))
        if "<autoref" in data:
            self.shown_markup.append(data.strip())


def _pages(site: str) -> dict:
    """{path relative to the site: parsed page} for every HTML page built."""
    pages = {}
    for d, _, files in os.walk(site):
        for f in files:
            if f.endswith(".html"):
                page = _Page()
                page.feed(open(os.path.join(d, f), encoding="utf-8").read())
                pages[os.path.relpath(os.path.join(d, f), site).replace(os.sep, "/")] = page
    return pages


@pytest.fixture(scope="module")
def pages(site):
    return _pages(site)


def _prompt_lines(page: _Page) -> list:
    return [line.strip() for block in page.code for line in block.splitlines()
            if line.startswith(">>>")]


def test_every_example_on_the_site_is_a_code_block(pages):
    """No ``>>>`` session reads as prose or as a quote, on any page."""
    assert len(pages) > len(_nav_pages(_config()["nav"]))  # every nav page, 404 and more
    bad = []
    for name, page in sorted(pages.items()):
        for ancestors, text in page.prompts:
            if ("pre" not in ancestors and "code" not in ancestors
                    or "blockquote" in ancestors or "p" in ancestors):
                bad.append(f"{name}: {text[:70]!r} inside <{'><'.join(ancestors[-4:])}>")
        if page.nested_quotes:
            bad.append(f"{name}: {page.nested_quotes} <blockquote> directly inside a "
                       "<blockquote>: how Markdown renders a '>>>' line")
    assert not bad, "examples that do not render as code:\n" + "\n".join(bad)


def test_no_markup_shows_as_text(pages):
    shown = [f"{name}: {text[:100]!r}" for name, page in sorted(pages.items())
             for text in page.shown_markup]
    assert not shown, ("markup a reader sees as text (a Sphinx role where the docstring "
                       "parser takes a type, e.g. 'Returns: :class:`X`: ...'; write "
                       "':class:`X` with ...'):\n" + "\n".join(shown))


def test_every_docstring_example_renders_as_code(pages):
    """Each doctest example of each object an API page documents is a prompt in a code block."""
    import doctest

    import griffe

    package = griffe.load("fnattn", search_paths=[ROOT], try_relative_path=False)
    parser = doctest.DocTestParser()
    total, missing = 0, []
    api_pages = {n: p for n, p in pages.items() if n.startswith("api/")}
    assert len(api_pages) >= len([p for p in _nav_pages(_config()["nav"]) if p.startswith("api/")])
    for name, page in sorted(api_pages.items()):
        shown = collections.Counter(DIRECTIVE.sub("", line) for line in _prompt_lines(page))
        wanted = collections.Counter()
        for path in page.heading_ids:
            obj = package if path == "fnattn" else package[path.removeprefix("fnattn.")]
            if obj.docstring is not None:
                wanted.update(DIRECTIVE.sub("", ">>> " + ex.source.splitlines()[0]).strip()
                              for ex in parser.get_examples(obj.docstring.value))
        total += sum(wanted.values())
        missing += [f"{name}: {line!r}" for line in (wanted - shown).elements()]
    assert total > 300, total  # the reference renders the package's examples
    assert not missing, (f"{len(missing)} of {total} docstring examples are not a '>>>' line "
                         "of a code block on their page:\n" + "\n".join(missing[:40]))


def _canonical(name: str) -> set:
    """The anchors under which ``fnattn.<name>`` may be documented."""
    obj = getattr(fnattn, name)
    if inspect.ismodule(obj):
        return {f"fnattn.{name}", obj.__name__}
    return {f"fnattn.{name}", f"{obj.__module__}.{obj.__qualname__}"}


def test_the_api_reference_has_a_root_page_that_reaches_every_public_name(site, pages):
    nav = _nav_pages(_config()["nav"])
    assert "api/index.md" in nav, "the API reference's root page is not in the nav"
    root = open(os.path.join(site, "api", "index.html"), encoding="utf-8").read()
    anchors = {}  # anchor -> the nav page (as built) that documents it
    for page in nav:
        built = _built(page)
        for anchor in pages[built].heading_ids:
            anchors.setdefault(anchor, built)
    unreached = []
    for name in fnattn.__all__:
        documented = sorted(_canonical(name) & set(anchors))
        if not documented:
            unreached.append(f"fnattn.{name}: documented on no page of the nav")
            continue
        links = [f'href="{posixpath.relpath(posixpath.dirname(anchors[a]), "api")}/#{a}"'
                 for a in documented]
        if not any(link in root for link in links):
            unreached.append(f"fnattn.{name}: api/index.md has no link to any of {links}")
    assert not unreached, "public names a reader cannot reach from the nav:\n" + "\n".join(
        unreached)


def test_doctest_sessions_become_pycon_blocks_wherever_they_sit(tmp_path):
    """The site's griffe extension fences each session where a docstring holds it."""
    import griffe

    package = tmp_path / "fnattn"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent('''
        """Package.

        >>> 1 + 1
        2

        >>> print("a")  # doctest: +ELLIPSIS
        a

        Example:

          >>> x = 3
          >>> x
          3

        ```python
        >>> kept = "already fenced"
        ```
        """

        def f(a):
            """Adds one.

            >>> f(1)
            2

            Args:
              a: a number.

                >>> f(a=2)
                3

            Returns:
              ``a + 1``.

            >>> f(0)
            1
            """
            return a + 1
        '''))
    extensions = griffe.load_extensions(
        *(os.path.join(ROOT, e) for e in
          _config()["plugins"][-1]["mkdocstrings"]["handlers"]["python"]["options"]["extensions"]))
    pkg = griffe.load("fnattn", search_paths=[str(tmp_path)], try_relative_path=False,
                      extensions=extensions, docstring_parser="google")
    doc = pkg.docstring.value
    # Runs split by blank lines join into one block; directives are dropped.
    assert '```pycon\n>>> 1 + 1\n2\n\n>>> print("a")\na\n```\n\nExample:' in doc
    assert "Example:\n\n  ```pycon\n  >>> x = 3\n  >>> x\n  3\n  ```" in doc  # keeps its indent
    assert '```python\n>>> kept = "already fenced"\n```' in doc and doc.count("```pycon") == 2
    sections = pkg["f"].docstring.parse("google", warn_missing_types=False)
    kinds = [s.kind.value for s in sections]
    assert kinds == ["text", "parameters", "returns", "text"], kinds
    assert sections[0].value.endswith("```pycon\n>>> f(1)\n2\n```")
    assert sections[1].value[0].description.endswith("```pycon\n>>> f(a=2)\n3\n```")
    assert sections[3].value == "```pycon\n>>> f(0)\n1\n```"
