#!/usr/bin/env python3
"""Lists the public items of a crate from its generated docs, one path a line, sorted.

    cargo doc --all-features --no-deps
    python3 .ci/public_items.py target/doc/delaywheel > /tmp/public_api.txt
    diff tests/public_api.txt /tmp/public_api.txt

It reads `all.html` (every item, by the path where it is documented) and each module page
reached from `index.html` (the modules themselves, and re-exports that rustdoc does not
inline), and prints their union. `--kinds` puts the kind before each path (`struct`,
`enum`, `fn`, `constant`, `trait`, `type`, `macro`, `mod`, `reexport`, ...). A path that only
one of the two sources lists is reported on stderr. Standard library only.
"""

import argparse
import html
import os
import re
import sys

# all.html: <h3 id="structs">Structs</h3><ul class="all-items"><li><a href="redis/struct.X.html">redis::X</a></li>
ALL_SECTION = re.compile(r'<h3 id="([^"]+)">.*?</h3>\s*<ul class="all-items">(.*?)</ul>', re.S)
ALL_ITEM = re.compile(r'<li><a href="([^"]+)">(.*?)</a></li>', re.S)
# A module page's item table: <dt><a class="struct" href="struct.X.html" title="struct krate::X">
MOD_ITEM = re.compile(r'<dt[^>]*><a class="(\w+)" href="([^"]+)" title="(\w+) ([^"]+)">')
# A re-export rustdoc did not inline: <dt id="reexport.Name"><code>pub use ...;</code></dt>
REEXPORT = re.compile(r'<dt id="reexport\.([A-Za-z0-9_]+)"')


def text(fragment):
    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()


def kind_of(href):
    base = os.path.basename(href)
    return base.split(".", 1)[0] if "." in base else "?"


def from_all(doc_dir, crate):
    items = {}
    with open(os.path.join(doc_dir, "all.html"), encoding="utf-8") as f:
        page = f.read()
    for _, body in ALL_SECTION.findall(page):
        for href, name in ALL_ITEM.findall(body):
            items["%s::%s" % (crate, text(name))] = kind_of(href)
    return items


def from_modules(doc_dir, crate):
    items, seen = {}, set()
    todo = [("", crate)]  # (directory relative to doc_dir, module path)
    while todo:
        rel, module = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        path = os.path.join(doc_dir, rel, "index.html")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            page = f.read()
        for kind, href, _, full in MOD_ITEM.findall(page):
            items[full] = kind
            if kind == "mod":
                todo.append((os.path.normpath(os.path.join(rel, os.path.dirname(href))), full))
        for name in REEXPORT.findall(page):
            items.setdefault("%s::%s" % (module, name), "reexport")
    return items


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "doc_dir",
        nargs="?",
        default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "doc", "delaywheel"),
        help="the crate's doc directory (default: $CARGO_TARGET_DIR/doc/delaywheel or target/doc/delaywheel)",
    )
    ap.add_argument("--kinds", action="store_true", help="print `kind path` instead of `path`")
    args = ap.parse_args(argv)
    doc_dir = args.doc_dir.rstrip("/")
    if not os.path.exists(os.path.join(doc_dir, "all.html")):
        sys.exit("public_items.py: no %s/all.html: run `cargo doc --all-features --no-deps` first" % doc_dir)
    crate = os.path.basename(doc_dir)
    listed, pages = from_all(doc_dir, crate), from_modules(doc_dir, crate)
    for path in sorted(set(listed) ^ set(pages)):
        if pages.get(path) not in ("mod", "reexport"):  # all.html lists no modules
            where = "all.html" if path in listed else "the module pages"
            print("public_items.py: %s is only in %s" % (path, where), file=sys.stderr)
    items = dict(pages)
    items.update(listed)
    for path in sorted(items):
        print("%s %s" % (items[path], path) if args.kinds else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
