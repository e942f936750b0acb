#!/usr/bin/env python3
"""Checks the module dependency graph of src/: no import cycle between files, and the layers.

    python3 .ci/layers.py               # check src/ of this repository
    python3 .ci/layers.py --verbose     # also print every edge and every rule
    python3 .ci/layers.py --self-test   # run the script on small synthetic trees
    python3 .ci/layers.py --src DIR --rules FILE

Every `.rs` file reached from `src/lib.rs` by `mod` declarations (honouring `#[path]`; a file
no `mod` reaches is mapped by its path and reported) is one node, named by its module path
(`crate`, `crate::wheel`, `crate::redis::store`). Inline modules (`mod sync { .. }`) belong to
the file that holds them. Items under `#[cfg(test)]` (the `mod tests` blocks, test-only fields
and `mod` declarations), comments, doc comments and string literals (raw strings included, so
Lua text does not count) are skipped.

An edge A -> B is a reference in file A to module B or an item in B: a `use` (grouped trees,
`self`, `super`, `crate`, renames and globs) or a path in code (`crate::delivery::f()`,
`super::persistent::now_ms()`, `link::passing(..)` after `use super::link`). A path is
resolved to the longest prefix that is a module, and a name that module only imports or
re-exports (`pub use store::Op` in `redis/mod.rs`) is followed to the module that defines it,
so `super::Op` from `redis/flusher.rs` is an edge to `redis::store`, not to `redis`. A name
that cannot be followed (defined in the module, or a glob) counts as an edge to that module.
A `mod` declaration is no edge, and neither is a `pub use` of the module's own descendants
(a `mod.rs` that declares and re-exports its children is in no cycle).

It fails (exit 1) on any cycle, printing one concrete cycle per strongly connected component
and every edge inside it with its file and line, and on any broken layer rule (RULES below,
or --rules FILE in the same syntax). Otherwise it prints one OK line (exit 0).
Standard library only.
"""

import argparse
import os
import re
import sys
import tempfile
from collections import defaultdict, deque

# The layer rules. One rule a line: `FROM... !-> TO...`: no file module at or under a FROM path
# may reference one at or under a TO path (references inside a module's own TO part are
# allowed). `crate::a::{b,c}` stands for `crate::a::b crate::a::c`. A (FROM, TO) pair takes
# effect only while both name modules that exist, so one table serves the layout before the
# moves of issue 23 and the one after: rename the paths here when the layout changes.
RULES = """
# The layers, lowest first: the wheel (pure data structure), the timer engine, the Redis layer.
crate::wheel   !-> crate::engine crate::redis crate::http crate::postgres
crate::engine  !-> crate::redis crate::http crate::postgres
# The PostgreSQL store implements the persistent engine's store trait: it may use the Redis
# layer's persistence role (the engine, the trait, the rows), never the queue; nothing in the
# Redis layer uses it.
crate::redis    !-> crate::postgres
crate::postgres !-> crate::redis::queue crate::http
# The HTTP seams sit on the engine's futures, beside the Redis layer, and neither uses the other.
crate::http    !-> crate::redis
crate::redis   !-> crate::http

# The Redis layer's two roles import nothing from each other, and the shared parts at its root
# (connection, key names, envelope, wall clock, the blocking bridge, the store error) import
# neither role.
crate::redis::persist !-> crate::redis::queue
crate::redis::queue   !-> crate::redis::persist
crate::redis::{link,layout,envelope,wall_clock,blocking,store_error,when,payload,trace_context} !-> crate::redis::persist crate::redis::queue

"""

# --------------------------------------------------------------------------------------------
# Lexer: identifiers, punctuation (`::` as one token), literals; comments dropped.


class Tok:
    __slots__ = ("kind", "v", "line")

    def __init__(self, kind, v, line):
        self.kind, self.v, self.line = kind, v, line

    def __repr__(self):
        return "%s:%r@%d" % (self.kind, self.v, self.line)


_ident = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_number = re.compile(r"[0-9][0-9A-Za-z_]*(\.[0-9][0-9A-Za-z_]*)?")


def lex(src):
    toks = []
    i, n, line = 0, len(src), 1
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += src[i] == "\n"
                    i += 1
        elif c in "rbc" and _raw_string_at(src, i):
            j = i + 1 if c == "r" else i + 2
            hashes = 0
            while src[j] == "#":
                hashes, j = hashes + 1, j + 1
            end = src.find('"' + "#" * hashes, j + 1)
            end = n if end < 0 else end + 1 + hashes
            toks.append(Tok("lit", src[i:end], line))
            line += src.count("\n", i, end)
            i = end
        elif c == '"' or (c in "bc" and src.startswith('"', i + 1)):
            j = i + 1 if c == '"' else i + 2
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            toks.append(Tok("lit", src[i : j + 1], line))
            line += src.count("\n", i, j + 1)
            i = j + 1
        elif c == "'" or (c == "b" and src.startswith("'", i + 1)):
            q = i if c == "'" else i + 1
            if src.startswith("\\", q + 1):  # '\n', '\u{1F600}', b'\''
                j = q + 2
                while j < n and src[j] != "'":
                    j += 2 if src[j] == "\\" else 1
                toks.append(Tok("lit", src[i : j + 1], line))
                i = j + 1
            elif q + 2 < n and src[q + 2] == "'":  # 'a'
                toks.append(Tok("lit", src[i : q + 3], line))
                i = q + 3
            else:  # a lifetime or a label
                m = _ident.match(src, q + 1)
                end = m.end() if m else q + 1
                toks.append(Tok("life", src[i:end], line))
                i = end
        elif c == "r" and src.startswith("r#", i) and _ident.match(src, i + 2):
            m = _ident.match(src, i + 2)  # a raw identifier
            toks.append(Tok("id", m.group(), line))
            i = m.end()
        elif c.isalpha() or c == "_":
            m = _ident.match(src, i)
            toks.append(Tok("id", m.group(), line))
            i = m.end()
        elif c.isdigit():
            m = _number.match(src, i)
            toks.append(Tok("lit", m.group(), line))
            i = m.end()
        elif c == "$" and src.startswith("$crate", i):
            toks.append(Tok("id", "crate", line))  # `$crate::x` in a macro is `crate::x`
            i += 6
        elif src.startswith("::", i):
            toks.append(Tok("p", "::", line))
            i += 2
        else:
            toks.append(Tok("p", c, line))
            i += 1
    return toks


def _raw_string_at(src, i):
    j = i + 1 if src[i] == "r" else i + 2
    if src[i] != "r" and not src.startswith("r", i + 1):
        return False
    while j < len(src) and src[j] == "#":
        j += 1
    return j < len(src) and src[j] == '"'


# --------------------------------------------------------------------------------------------
# Parser: the parts of a file that matter here.

OPEN, CLOSE = {"(", "[", "{"}, {")", "]", "}"}
BLOCK_ITEMS = {"fn", "mod", "impl", "struct", "enum", "trait", "union", "macro_rules"}
SEMI_ITEMS = {"use", "let", "const", "static", "type"}
DEF_KEYWORDS = {"fn", "struct", "enum", "trait", "type", "const", "static", "union"}
PATH_STARTS = {"crate", "super", "self"}


def is_p(t, v):
    return t.kind == "p" and t.v == v


def matching(toks, i):
    """Index of the bracket closing the one at toks[i]."""
    depth = 0
    for k in range(i, len(toks)):
        t = toks[k]
        if t.kind == "p" and t.v in OPEN:
            depth += 1
        elif t.kind == "p" and t.v in CLOSE:
            depth -= 1
            if depth == 0:
                return k
    return len(toks) - 1


def is_test_cfg(body):
    """True for the tokens of `cfg(test)` or `cfg(all(.., test, ..))`."""
    vs = [t.v for t in body]
    if vs[:2] != ["cfg", "("]:
        return False
    pred = vs[2:-1]
    if pred == ["test"]:
        return True
    if pred[:2] == ["all", "("]:
        args, depth, cur = [], 0, []
        for v in pred[2:-1]:
            if v in OPEN:
                depth += 1
            elif v in CLOSE:
                depth -= 1
            if v == "," and depth == 0:
                args.append(cur)
                cur = []
            else:
                cur.append(v)
        args.append(cur)
        return ["test"] in args
    return False


def skip_item(toks, i):
    """Index just past the item or statement starting at toks[i] (a `#[cfg(test)]` one)."""
    n, j = len(toks), i
    while j < n:  # visibility and qualifiers
        v = toks[j].v
        if v == "pub":
            j += 1
            if j < n and is_p(toks[j], "("):
                j = matching(toks, j) + 1
        elif v in ("unsafe", "async", "default"):
            j += 1
        elif v == "extern" and j + 1 < n and toks[j + 1].kind == "lit":
            j += 2
        elif v == "const" and j + 1 < n and toks[j + 1].v in ("fn", "unsafe", "async", "extern"):
            j += 1
        else:
            break
    head = toks[j].v if j < n else ""
    mode = "semi" if head in SEMI_ITEMS else "block" if head in BLOCK_ITEMS else "expr"
    depth = 0
    for k in range(j, n):
        t = toks[k]
        if t.kind != "p":
            continue
        if t.v in OPEN:
            depth += 1
        elif t.v in CLOSE:
            if depth == 0:
                return k  # the end of the enclosing block: leave it
            depth -= 1
            if depth == 0 and t.v == "}" and (mode == "block" or is_p(toks[j], "{")):
                return k + 1
        elif depth == 0 and t.v == ";":
            return k + 1
        elif depth == 0 and t.v == "," and mode == "expr":
            return k + 1
    return n


class UseLeaf:
    """One leaf of a `use` tree: `segs` as written, the name it binds, and the visibility."""

    __slots__ = ("scope", "segs", "name", "glob", "public", "line", "file")

    def __init__(self, scope, segs, name, glob, public, line, file):
        self.scope, self.segs, self.name, self.glob = scope, segs, name, glob
        self.public, self.line, self.file = public, line, file


def parse_use_tree(toks, i, prefix, out):
    """Parses the use tree at toks[i]; appends (segs, name, glob, line). Returns the next index."""
    segs = list(prefix)
    n = len(toks)
    while i < n:
        t = toks[i]
        if is_p(t, "::"):
            if not segs:
                segs.append("::")  # `use ::extern_crate::..`
            i += 1
        elif is_p(t, "*"):
            out.append((segs, None, True, t.line))
            return i + 1
        elif is_p(t, "{"):
            i += 1
            while i < n and not is_p(toks[i], "}"):
                i = parse_use_tree(toks, i, segs, out)
                if i < n and is_p(toks[i], ","):
                    i += 1
            return i + 1
        elif t.kind == "id":
            segs.append(t.v)
            i += 1
            if i < n and is_p(toks[i], "::"):
                continue
            name = t.v
            if name == "self":  # `a::{self}` is `a`
                segs.pop()
                name = segs[-1] if segs else None
            if i + 1 < n and toks[i].v == "as":
                name = toks[i + 1].v
                i += 2
            out.append((segs, None if name == "_" else name, False, t.line))
            return i
        else:
            return i
    return i


class FileInfo:
    def __init__(self, path, module):
        self.path = path  # relative to the src directory's parent, for messages
        self.module = module
        self.lines = []


class Crate:
    """Modules, their bindings and the references of every file, parsed from a src directory."""

    def __init__(self, src_dir):
        self.src_dir = os.path.abspath(src_dir)
        self.base = os.path.dirname(self.src_dir)
        self.modules = {}  # path -> (file module path, inline?)
        self.children = defaultdict(set)
        self.defs = defaultdict(set)  # module -> names it defines
        self.bindings = defaultdict(dict)  # module -> name -> UseLeaf
        self.globs = defaultdict(list)  # module -> [UseLeaf]
        self.uses = []  # [UseLeaf]
        self.paths = []  # [(scope, segs, line, file)]
        self.idents = []  # [(scope, name, line, file)]: identifiers in code, not in paths
        self.files = {}  # file module path -> FileInfo
        self.notes = []
        self._load()

    # -- discovery ---------------------------------------------------------------------------

    def _load(self):
        root = os.path.join(self.src_dir, "lib.rs")
        if not os.path.exists(root):
            root = os.path.join(self.src_dir, "main.rs")
        queue = deque([(root, "crate")])
        seen, test_only = set(), set()
        while queue:
            path, module = queue.popleft()
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            if not os.path.exists(path):
                self.notes.append("module %s: no file %s" % (module, self._rel(path)))
                continue
            self.modules[module] = (module, False)
            for child_path, child_module, test in self._parse_file(path, module):
                if test:
                    test_only.add(os.path.realpath(child_path))
                else:
                    queue.append((child_path, child_module))
        # Files no `mod` reaches: mapped by their path (src/a/b.rs or src/a/b/mod.rs = a::b).
        for dirpath, _, names in sorted(os.walk(self.src_dir)):
            for name in sorted(names):
                path = os.path.join(dirpath, name)
                real = os.path.realpath(path)
                if not name.endswith(".rs") or real in seen or real in test_only:
                    continue
                rel = os.path.relpath(path, self.src_dir)[:-3].split(os.sep)
                if rel[0] == "bin" or rel in (["main"], ["lib"]):
                    continue
                if rel[-1] == "mod":
                    rel.pop()
                module = "::".join(["crate"] + rel)
                self.notes.append("%s: no `mod` reaches it; taken as %s" % (self._rel(path), module))
                seen.add(real)
                self.modules[module] = (module, False)
                for k in range(len(rel)):
                    self.children["::".join(["crate"] + rel[:k])].add(rel[k])
                self._parse_file(path, module)

    def _rel(self, path):
        return os.path.relpath(path, self.base)

    def _child_file(self, path, inline, name, attr_path):
        """The file of `mod name;` declared in `path` inside the inline modules `inline`."""
        d, base = os.path.split(path)
        mod_rs = base in ("lib.rs", "main.rs", "mod.rs")
        if attr_path is not None and not inline:
            return os.path.normpath(os.path.join(d, attr_path))
        mdir = d if mod_rs else os.path.join(d, base[:-3])
        mdir = os.path.join(mdir, *inline) if inline else mdir
        if attr_path is not None:
            return os.path.normpath(os.path.join(mdir, attr_path))
        flat = os.path.join(mdir, name + ".rs")
        return flat if os.path.exists(flat) else os.path.join(mdir, name, "mod.rs")

    # -- one file ----------------------------------------------------------------------------

    def _parse_file(self, path, module):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        info = FileInfo(self._rel(path), module)
        info.lines = text.split("\n")
        self.files[module] = info
        toks = lex(text)
        n = len(toks)
        declared = []  # (child file, child module, test-only)
        scopes = [(module, -1, [])]  # (module, brace depth it opened at, inline names)
        attrs = []  # outer attributes of the next item: lists of tokens
        depth = 0
        i = 0
        while i < n:
            t = toks[i]
            scope, _, inline = scopes[-1]
            if is_p(t, "#") and i + 1 < n and (is_p(toks[i + 1], "[") or is_p(toks[i + 1], "!")):
                inner = is_p(toks[i + 1], "!")
                j = i + 2 if inner else i + 1
                if j < n and is_p(toks[j], "["):
                    end = matching(toks, j)
                    body = toks[j + 1 : end]
                    if inner:
                        if is_test_cfg(body) and len(scopes) == 1:
                            return declared  # a test-only file
                    else:
                        attrs.append(body)
                    i = end + 1
                    continue
            if attrs and any(is_test_cfg(a) for a in attrs):
                k = i
                while k < n - 1 and toks[k].v in ("pub", "(", "crate", "super", "self", ")", "in"):
                    k += 1
                if toks[k].v == "mod" and k + 2 < n and is_p(toks[k + 2], ";"):
                    declared.append(
                        (self._child_file(path, inline, toks[k + 1].v, _path_attr(attrs)), None, True)
                    )
                attrs = []
                i = skip_item(toks, i)
                continue
            if t.kind == "id" and t.v == "pub":  # keeps the attributes for the item
                i += 1
                if i < n and is_p(toks[i], "("):
                    i = matching(toks, i) + 1  # `pub(in crate::a)` is no reference
                continue
            if t.kind == "id" and t.v == "mod" and i + 2 < n and toks[i + 1].kind == "id":
                name = toks[i + 1].v
                child = scope + "::" + name
                self.children[scope].add(name)
                if is_p(toks[i + 2], ";"):
                    declared.append((self._child_file(path, inline, name, _path_attr(attrs)), child, False))
                    i += 3
                elif is_p(toks[i + 2], "{"):
                    self.modules[child] = (module, True)
                    scopes.append((child, depth, inline + [name]))
                    depth += 1
                    i += 3
                else:
                    i += 2
                attrs = []
                continue
            attrs = []
            if t.kind == "id" and t.v == "use":
                public = toks[i - 1].v == "pub" or (
                    is_p(toks[i - 1], ")") and _pub_paren_before(toks, i - 1)
                )
                leaves = []
                i = parse_use_tree(toks, i + 1, [], leaves)
                for segs, name, glob, line in leaves:
                    leaf = UseLeaf(scope, segs, name, glob, public, line, info)
                    self.uses.append(leaf)
                    if glob:
                        self.globs[scope].append(leaf)
                    elif name is not None:
                        self.bindings[scope].setdefault(name, leaf)
                continue
            if t.kind == "id" and i + 1 < n and is_p(toks[i + 1], "::") and not (
                i > 0 and (is_p(toks[i - 1], "::") or is_p(toks[i - 1], "."))
            ):
                segs, k = [t.v], i + 1
                while k + 1 < n and is_p(toks[k], "::") and toks[k + 1].kind == "id":
                    segs.append(toks[k + 1].v)
                    k += 2
                self.paths.append((scope, segs, t.line, info))
                i = k
                continue
            if t.kind == "id" and not (i > 0 and is_p(toks[i - 1], ".")):
                self.idents.append((scope, t.v, t.line, info))
            if t.kind == "id" and t.v in DEF_KEYWORDS and i + 1 < n and toks[i + 1].kind == "id":
                self.defs[scope].add(toks[i + 1].v)
            elif t.kind == "id" and t.v == "macro_rules" and i + 2 < n:
                self.defs[scope].add(toks[i + 2].v)
            if is_p(t, "{"):
                depth += 1
            elif is_p(t, "}"):
                depth -= 1
                if len(scopes) > 1 and depth == scopes[-1][1]:
                    scopes.pop()
            i += 1
        return declared

    # -- resolution --------------------------------------------------------------------------

    def absolute(self, scope, segs):
        """`segs` as written in module `scope`, made absolute (a list starting with `crate`),
        or None for a path outside the crate."""
        if not segs or segs[0] == "::":
            return None
        if segs[0] == "crate":
            return list(segs)
        cur = scope.split("::")
        i = 0
        if segs[0] == "self":
            i = 1
        while i < len(segs) and segs[i] == "super":
            cur.pop()
            i += 1
            if not cur:
                return None
        if i:
            return cur + segs[i:]
        first = segs[0]
        if first in self.children[scope] or first in self.bindings[scope] or first in self.defs[scope]:
            return scope.split("::") + segs
        return None  # an extern crate, a std path, a type's associated item

    def resolve(self, abs_segs, guard=0):
        """The module that defines what `abs_segs` names (an absolute path), following imports
        and re-exports. None if it leads outside the crate."""
        cur, i = "crate", 1
        while i < len(abs_segs):
            seg = abs_segs[i]
            cand = cur + "::" + seg
            if cand in self.modules:
                cur, i = cand, i + 1
                continue
            if guard > 32 or seg in self.defs[cur]:
                return cur
            leaf = self.bindings[cur].get(seg)
            if leaf is not None:
                target = self.absolute(leaf.scope, leaf.segs)
                if target is None:
                    return cur  # re-exports something from outside the crate
                return self.resolve(target + abs_segs[i + 1 :], guard + 1)
            for g in self.globs[cur]:
                target = self.absolute(g.scope, g.segs)
                if target is None:
                    continue
                src = self.resolve(target, guard + 1)
                if src is not None and (
                    seg in self.defs[src] or seg in self.bindings[src] or seg in self.children[src]
                ):
                    return self.resolve(target + abs_segs[i:], guard + 1)
            return cur
        return cur

    def file_of(self, module):
        return self.modules[module][0]


def _path_attr(attrs):
    for body in attrs:
        if len(body) >= 3 and body[0].v == "path" and body[1].v == "=" and body[2].kind == "lit":
            return body[2].v.strip('"')
    return None


def _pub_paren_before(toks, close):
    depth = 0
    for k in range(close, -1, -1):
        if is_p(toks[k], ")"):
            depth += 1
        elif is_p(toks[k], "("):
            depth -= 1
            if depth == 0:
                return k > 0 and toks[k - 1].v == "pub"
    return False


def is_descendant(module, ancestor):
    return module.startswith(ancestor + "::")


# --------------------------------------------------------------------------------------------
# The graph, its cycles and the layer rules.


class Ref:
    __slots__ = ("src", "dst", "file", "line")

    def __init__(self, src, dst, file, line):
        self.src, self.dst, self.file, self.line = src, dst, file, line

    def where(self):
        text = self.file.lines[self.line - 1].strip() if self.line <= len(self.file.lines) else ""
        if len(text) > 90:
            text = text[:87] + "..."
        return "%s:%d  %s" % (self.file.path, self.line, text)


def build_edges(crate):
    """{(A, B): [Ref]} between file modules, A != B."""
    edges = defaultdict(list)

    def add(scope, abs_segs, info, line):
        if abs_segs is None:
            return
        target = crate.resolve(abs_segs)
        if target is None:
            return
        a, b = crate.file_of(scope), crate.file_of(target)
        if a != b:
            edges[(a, b)].append(Ref(a, b, info, line))

    reexported = defaultdict(dict)  # scope -> name -> the absolute path it re-exports
    for leaf in crate.uses:
        abs_segs = crate.absolute(leaf.scope, leaf.segs)
        if abs_segs is None:
            continue
        target = crate.resolve(abs_segs)
        if leaf.public and target is not None and is_descendant(target, leaf.scope):
            # The module re-exports its own descendant's item: no edge by itself, but the
            # module's own code naming that item (`Iter` after `pub use iter::Iter`) is one.
            if leaf.name is not None:
                reexported[leaf.scope][leaf.name] = abs_segs
            continue
        add(leaf.scope, abs_segs, leaf.file, leaf.line)
    for scope, segs, line, info in crate.paths:
        add(scope, crate.absolute(scope, segs), info, line)
    for scope, name, line, info in crate.idents:
        if name in reexported.get(scope, ()):
            add(scope, reexported[scope][name], info, line)
    for key, refs in edges.items():
        refs.sort(key=lambda r: (r.file.path, r.line))
        seen = set()
        edges[key] = [r for r in refs if not ((r.file.path, r.line) in seen or seen.add((r.file.path, r.line)))]
    return dict(edges)


def strongly_connected(nodes, succ):
    """Tarjan's algorithm, iterative. Components in a deterministic order."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return sorted(comps)


def shortest_cycle(start, succ, members):
    """The shortest cycle through `start` inside `members`, as a list of nodes ending at start."""
    prev = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(succ[v]):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if v != start else [start, start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def long_cycle(start, succ, members, budget=200000):
    """A cycle through `start` visiting as many members as a bounded search finds (all of them,
    in the small components of a crate), so that the printed cycle shows the whole tangle."""
    best = shortest_cycle(start, succ, members)
    path, on_path, steps = [start], {start}, [0]

    def dfs(v):
        nonlocal best
        steps[0] += 1
        if steps[0] > budget or len(best) - 1 == len(members):
            return
        for w in sorted(succ[v]):
            if w == start and len(path) + 1 > len(best):
                best = path + [start]
            elif w in members and w not in on_path:
                path.append(w)
                on_path.add(w)
                dfs(w)
                path.pop()
                on_path.discard(w)

    dfs(start)
    return best


def expand(word):
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    out = []
    for alt in m.group(1).split(","):
        out += expand(word[: m.start()] + alt.strip() + word[m.end() :])
    return out


def parse_rules(text):
    """[(from, to, line number)] pairs from the rule text."""
    pairs = []
    for num, raw in enumerate(text.split("\n"), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "!->" not in line:
            raise ValueError("rule line %d: expected `FROM... !-> TO...`: %s" % (num, raw))
        left, right = line.split("!->", 1)
        froms = [p for w in left.split() for p in expand(w)]
        tos = [p for w in right.split() for p in expand(w)]
        if not froms or not tos:
            raise ValueError("rule line %d: empty side: %s" % (num, raw))
        pairs += [(f, t, num) for f in froms for t in tos]
    return pairs


def under(module, prefix):
    return module == prefix or module.startswith(prefix + "::")


def check(src_dir, rules_text=RULES):
    """Analyses a src directory. Returns a dict with modules, edges, cycles, violations."""
    crate = Crate(src_dir)
    edges = build_edges(crate)
    nodes = sorted(crate.files)
    succ = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    cycles = []
    for comp in strongly_connected(nodes, succ):
        if len(comp) < 2:
            continue
        members = set(comp)
        path = long_cycle(comp[0], succ, members)
        inside = sorted((a, b) for (a, b) in edges if a in members and b in members)
        cycles.append({"members": comp, "path": path, "edges": inside})
    pairs = parse_rules(rules_text)
    exists = lambda p: any(under(m, p) for m in crate.modules)  # noqa: E731
    active = [(f, t, num) for f, t, num in pairs if exists(f) and exists(t)]
    violations = []
    for f, t, num in active:
        for (a, b), refs in sorted(edges.items()):
            if under(a, f) and under(b, t) and not under(a, t):
                violations.append((f, t, num, a, b, refs))
    return {
        "crate": crate,
        "modules": nodes,
        "edges": edges,
        "cycles": cycles,
        "pairs": pairs,
        "active": active,
        "violations": violations,
    }


def report(res, verbose=False, out=sys.stdout):
    crate, edges = res["crate"], res["edges"]
    w = out.write
    for note in crate.notes:
        w("note: %s\n" % note)
    if verbose:
        w("edges (%d):\n" % len(edges))
        for (a, b), refs in sorted(edges.items()):
            w("  %s -> %s    %s\n" % (a, b, refs[0].where()))
        w("rules (%d of %d pairs active):\n" % (len(res["active"]), len(res["pairs"])))
        act = set(res["active"])
        for p in res["pairs"]:
            w("  %s %s !-> %s\n" % ("active  " if p in act else "inactive", p[0], p[1]))
    for k, cyc in enumerate(res["cycles"], 1):
        w(
            "cycle %d of %d (%d modules: %s):\n  %s\n"
            % (
                k,
                len(res["cycles"]),
                len(cyc["members"]),
                ", ".join(cyc["members"]),
                " -> ".join(cyc["path"]),
            )
        )
        on_path = list(zip(cyc["path"], cyc["path"][1:]))
        for a, b in on_path:
            w("    %s -> %s\n        %s\n" % (a, b, _refs_text(edges[(a, b)])))
        rest = [e for e in cyc["edges"] if e not in on_path]
        if rest:
            w("  other edges inside this component:\n")
            for a, b in rest:
                w("    %s -> %s\n        %s\n" % (a, b, _refs_text(edges[(a, b)])))
    for f, t, num, a, b, refs in res["violations"]:
        w(
            "layer rule `%s !-> %s` (rule line %d) broken: %s -> %s\n        %s\n"
            % (f, t, num, a, b, _refs_text(refs))
        )
    summary = "%d modules, %d edges, %d of %d layer rule pairs active" % (
        len(res["modules"]),
        len(edges),
        len(res["active"]),
        len(res["pairs"]),
    )
    if res["cycles"] or res["violations"]:
        w(
            "layers: FAILED: %d import cycle(s), %d layer rule violation(s) (%s)\n"
            % (len(res["cycles"]), len(res["violations"]), summary)
        )
        return 1
    w("layers: OK: no import cycle, no layer rule broken (%s)\n" % summary)
    return 0


def _refs_text(refs):
    """The first reference with its text, then the lines of the others."""
    text = refs[0].where()
    if len(refs) > 1:
        lines = [str(r.line) for r in refs[1:]]
        if len(lines) > 8:
            lines = lines[:8] + ["..."]
        text += "\n        also at line%s %s" % ("s" if len(refs) > 2 else "", ", ".join(lines))
    return text


# --------------------------------------------------------------------------------------------
# Self test: small synthetic trees.


def _tree(files):
    root = tempfile.mkdtemp(prefix="layers-selftest-")
    for rel, text in files.items():
        path = os.path.join(root, "src", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return os.path.join(root, "src")


def self_test():
    import io
    import shutil

    failures = []

    def run(
        name, files, rules="", expect_cycles=(), expect_edges=(), absent_edges=(), violations=0, whole=False
    ):
        src = _tree(files)
        try:
            res = check(src, rules)
            buf = io.StringIO()
            code = report(res, out=buf)
            got = [set(c["members"]) for c in res["cycles"]]
            want = [set(c) for c in expect_cycles]
            problems = []
            if sorted(map(sorted, got)) != sorted(map(sorted, want)):
                problems.append("cycles %s, expected %s" % (got, want))
            for e in expect_edges:
                if e not in res["edges"]:
                    problems.append("missing edge %s -> %s" % e)
            for e in absent_edges:
                if e in res["edges"]:
                    problems.append("unexpected edge %s -> %s" % e)
            if len(res["violations"]) != violations:
                problems.append("%d violations, expected %d" % (len(res["violations"]), violations))
            if code != (1 if expect_cycles or violations else 0):
                problems.append("exit code %d" % code)
            for c in res["cycles"]:  # the printed path is a real cycle
                p = c["path"]
                if p[0] != p[-1] or any((a, b) not in res["edges"] for a, b in zip(p, p[1:])):
                    problems.append("bad cycle path %s" % p)
                if whole and sorted(p[:-1]) != c["members"]:
                    problems.append("cycle path %s misses members of %s" % (p, c["members"]))
            if problems:
                failures.append("%s: %s\n%s" % (name, "; ".join(problems), buf.getvalue()))
            print("self-test %-40s %s" % (name, "FAILED" if problems else "ok"))
        finally:
            shutil.rmtree(os.path.dirname(src))

    # A cycle through `super::`, as redis/persistent.rs -> flusher.rs -> store.rs -> persistent.rs:
    # the last edge is an inline `super::persistent::now_ms()`, and the first goes through the
    # parent's re-export (`super::Op` is `store::Op`).
    run(
        "cycle through super:: and a re-export",
        {
            "lib.rs": "pub mod redis;\n",
            "redis/mod.rs": "mod persistent;\nmod flusher;\nmod store;\n"
            "pub use store::{Op, Rows};\npub use persistent::now_ms;\n",
            "redis/persistent.rs": "use super::flusher::flush;\npub fn now_ms() -> u64 { 0 }\n",
            "redis/flusher.rs": "pub fn flush(op: super::Op) {}\n",
            "redis/store.rs": "pub enum Op { A }\npub struct Rows;\n"
            "fn f() { let _ = super::persistent::now_ms(); }\n",
        },
        expect_cycles=[["crate::redis::persistent", "crate::redis::flusher", "crate::redis::store"]],
        expect_edges=[
            ("crate::redis::flusher", "crate::redis::store"),
            ("crate::redis::store", "crate::redis::persistent"),
        ],
        absent_edges=[("crate::redis::flusher", "crate::redis"), ("crate::redis", "crate::redis::store")],
        whole=True,
    )
    # A cycle through an inline `crate::x::f()` path; the same text in comments, doc comments,
    # strings, raw strings and a test module does not count.
    run(
        "cycle through inline crate:: path",
        {
            "lib.rs": "mod delivery;\nmod timer;\nmod quiet;\n",
            "delivery.rs": "pub fn forget() {}\npub fn run() { let _ = crate::timer::Expiration::new(); }\n",
            "timer.rs": "pub struct Expiration;\nimpl Expiration { pub fn new() -> Self { Expiration } }\n"
            "fn f() { crate::delivery::forget(); }\n",
            "quiet.rs": "//! see crate::timer::Expiration\n/// uses [`crate::delivery::run`]\n"
            "/* crate::timer::x /* nested */ crate::delivery */\n"
            "const LUA: &str = r#\"redis.call('GET', \"crate::timer\") \"# ;\n"
            "const S: &str = \"crate::delivery::run\";\nconst C: char = '\"';\n"
            "fn g<'a>(x: &'a str) -> &'a str { x }\n"
            "#[cfg(test)]\nmod tests {\n    use crate::timer::Expiration;\n    use super::*;\n}\n",
        },
        expect_cycles=[["crate::delivery", "crate::timer"]],
        absent_edges=[("crate::quiet", "crate::timer"), ("crate::quiet", "crate::delivery")],
    )
    # A grouped use: `use crate::{a::{self, b::{C}}, d as e};` reaches a, a::b and d, and closes
    # a cycle d -> a::b -> d.
    run(
        "cycle through a grouped use",
        {
            "lib.rs": "mod a;\nmod d;\nmod user;\n",
            "a/mod.rs": "pub mod b;\n",
            "a/b.rs": "pub struct C;\nfn f() { super::super::d::g(); }\n",
            "d.rs": "pub fn g() {}\nuse crate::a::b::{self as bee};\nfn h(_: bee::C) {}\n",
            "user.rs": "use crate::{a::{self, b::{C}}, d as e};\nfn f(_: C) { e::g(); }\n",
        },
        expect_cycles=[["crate::a::b", "crate::d"]],
        expect_edges=[
            ("crate::user", "crate::a"),
            ("crate::user", "crate::a::b"),
            ("crate::user", "crate::d"),
        ],
    )
    # No cycle: a mod.rs that declares and re-exports its children, children that import the
    # parent's re-exports (resolved to the sibling that defines them), an inline module, a
    # `#[path]` module, a test-only `#[path]` module, a crate-root re-export, `pub(in ..)`.
    run(
        "no cycle, re-exports followed",
        {
            "lib.rs": "pub mod wheel;\nmod engine;\nmod sync { pub(crate) use std::sync::Arc; }\n"
            "pub use engine::Timer;\n#[path = \"odd/place.rs\"]\nmod placed;\n",
            "wheel/mod.rs": "mod keys;\nmod iter;\npub use keys::Key;\npub use iter::Iter;\n"
            "pub struct Wheel;\nuse keys::helper;\n",
            "wheel/keys.rs": "pub struct Key;\npub(crate) fn helper() {}\n",
            "wheel/iter.rs": "use super::{Key, Wheel};\npub struct Iter;\n",
            "engine.rs": "use crate::wheel::{Wheel, Key};\nuse super::sync::Arc;\npub struct Timer;\n"
            "pub(in crate::engine) fn f() {}\n"
            "#[cfg(test)]\n#[path = \"../tests/support.rs\"]\nmod support;\n",
            "odd/place.rs": "use crate::Timer;\n",
        },
        rules="crate::wheel !-> crate::engine\ncrate::nothing !-> crate::wheel\n",
        expect_edges=[
            ("crate::wheel::iter", "crate::wheel::keys"),
            ("crate::wheel::iter", "crate::wheel"),
            ("crate::wheel", "crate::wheel::keys"),
            ("crate::engine", "crate::wheel::keys"),
            ("crate::engine", "crate"),
            ("crate::placed", "crate::engine"),
        ],
        absent_edges=[("crate", "crate::engine"), ("crate::wheel", "crate::wheel::iter")],
    )
    # A parent whose own code names an item it re-exports from a child (`Iter` after
    # `pub use iter::Iter`), and a child that imports the parent's own item: a cycle.
    run(
        "parent code using a re-exported child item",
        {
            "lib.rs": "pub mod wheel;\n",
            "wheel/mod.rs": "mod iter;\npub use iter::Iter;\npub struct Wheel;\n"
            "impl Wheel { pub fn iter(&self) -> Iter<'_> { Iter { wheel: self } } }\n",
            "wheel/iter.rs": "use super::Wheel;\npub struct Iter<'a> { pub(super) wheel: &'a Wheel }\n",
        },
        expect_cycles=[["crate::wheel", "crate::wheel::iter"]],
    )
    # Layer rules: a wheel importing the engine breaks one; an inactive rule breaks nothing.
    run(
        "layer rule broken",
        {
            "lib.rs": "pub mod wheel;\npub mod engine;\npub mod redis;\n",
            "wheel.rs": "fn f() { crate::engine::g(); }\n",
            "engine.rs": "pub fn g() {}\n",
            "redis/mod.rs": "pub mod persist;\npub mod queue;\npub mod link;\n",
            "redis/persist.rs": "use super::link::Link;\n",
            "redis/queue.rs": "use super::link::Link;\nuse crate::redis::persist;\n",
            "redis/link.rs": "pub struct Link;\n",
        },
        rules=RULES,
        violations=2,
    )
    if failures:
        print("\n".join(failures))
        print("self-test: %d case(s) FAILED" % len(failures))
        return 1
    print("self-test: all cases passed")
    return 0


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=os.path.join(os.path.dirname(here), "src"))
    ap.add_argument("--rules", help="a rule file (`FROM... !-> TO...` lines) instead of RULES")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every edge and rule")
    ap.add_argument("--self-test", action="store_true", help="check the script on synthetic trees")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    rules = RULES
    if args.rules:
        with open(args.rules, encoding="utf-8") as f:
            rules = f.read()
    return report(check(args.src, rules), verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
