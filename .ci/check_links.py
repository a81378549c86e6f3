#!/usr/bin/env python3
"""Checks the links of the built book (`mdbook build docs`): every relative
`href` and `src` of its HTML must lead to a file, and every `#anchor` to an
element with that id in the page it names. A link that leaves the book's
output folder is resolved against the repository (docs/book lies as deep as
docs/src, so `../../bench/` means the repository's bench/). Links with a
scheme (https:, mailto:) are not followed. README.md's relative links,
which lead into docs/src/, must lead to files too. Standard library only:
`python3 .ci/check_links.py docs/book`."""

import html.parser
import pathlib
import re
import sys
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parent.parent


class Page(html.parser.HTMLParser):
    """The ids and the links of one HTML page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name") and (name == "id" or tag == "a"):
                self.ids.add(value)
            if (tag, name) in (("a", "href"), ("img", "src"), ("link", "href"), ("script", "src")):
                self.links.append(value)


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        page.feed(path.read_text(encoding="utf-8", errors="replace"))
        cache[path] = page
    return cache[path]


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    book = pathlib.Path(sys.argv[1]).resolve()
    if not (book / "index.html").is_file():
        print(f"{book} holds no built book (run `mdbook build docs` first)")
        return 2
    problems = []
    pages = sorted(book.rglob("*.html"))
    # mdBook's own pages: the print page repeats every chapter, and the
    # 404 page's links are written for wherever it is served from.
    pages = [page for page in pages if page.name not in ("print.html", "404.html", "toc.html")]
    checked = 0
    for page in pages:
        for link in parse(page).links:
            url = urllib.parse.urlsplit(link)
            if url.scheme or url.netloc or link.startswith("//"):
                continue
            checked += 1
            target = page
            if url.path:
                target = (page.parent / urllib.parse.unquote(url.path)).resolve()
                if target.is_dir():
                    index = target / "index.html"
                    target = index if index.is_file() else target
                if not target.exists():
                    problems.append(f"{page.relative_to(book)}: {link}: no such file")
                    continue
            if url.fragment and target.suffix == ".html":
                if urllib.parse.unquote(url.fragment) not in parse(target).ids:
                    problems.append(f"{page.relative_to(book)}: {link}: no #{url.fragment} in {target.name}")
    readme = ROOT / "README.md"
    for link in re.findall(r"\]\(([^)\s]+)\)", readme.read_text()):
        url = urllib.parse.urlsplit(link)
        if url.scheme or not url.path:
            continue
        checked += 1
        if not (ROOT / urllib.parse.unquote(url.path)).exists():
            problems.append(f"README.md: {link}: no such file")
    for problem in problems:
        print(problem)
    print(f"links: {len(pages)} pages, {checked} relative links, {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
