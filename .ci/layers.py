#!/usr/bin/env python3
"""Checks the layering rules of the book's "Layers, and the rules that keep
them" (docs/src/internals/layers.md) against the code: every `crate::X` path in non-test code of `src/`
is an edge from the file's top-level module to X. Fails on an import cycle
between top-level modules, on an edge a rule forbids, on SQL outside the
store's two backends (src/store/sqlite/, src/store/postgres/) and
src/queue/embedded/ and src/queue/postgres/, on a write of a message's status, its
events or its webhook calls outside the lifecycle's two files, and on a
match of the store's backend outside src/store/mod.rs, on a question of
which engine the store is (`.sqlite()`, `.postgres()`, `is_shared()`) above
src/store/, on sqlx used for the
SQLite file (rusqlite is its one driver), and on a function of non-test
code over 100 lines, and on a file of non-test code over 1,000 lines of code
(blank and comment lines not counted). Standard library only:
`python3 .ci/layers.py`."""

import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"

# (from, to) pairs that must not exist; "queue.embedded" is the embedded
# queue's folder, which may use the store's SQLite writer.
FORBIDDEN = {
    "store": {"api", "accept", "queue", "consumer", "scheduler", "receipts", "webhooks", "tenants", "limits", "providers", "app"},
    "providers": {"queue", "store"},
    "queue": {"api", "consumer"},
    "consumer": {"api"},
    "message": {"store", "api"},
    "model": {"store", "api"},
    "config": {"tenants", "store", "limits", "api", "accept", "queue", "consumer", "providers"},
    "limits": {"store"},
    "webhooks": {"api"},
}
SQL = re.compile(r'"[^"\n]*\b(SELECT\s|INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE (TABLE|INDEX))')
# A message's status and its events are written only by the store's
# lifecycle, one file per backend (issue 45); webhook endpoints read the
# events, and only a failed call gets a row of its own (store/webhooks.rs).
LIFECYCLE = re.compile(r'"[^"\n]*\b(UPDATE messages( AS m)? SET status|INSERT INTO (message_events|messages)\b)')
LIFECYCLE_FILES = ("store/sqlite/lifecycle.rs", "store/postgres/lifecycle.rs")
BACKEND = re.compile(r"\bDb::(Sqlite|Postgres)\b")
# The store is one interface (`store::Backend`, and the hot path's
# `HotPath`) with two implementations, each holding all of its own SQL
# (issue 45): only the handle's own file asks which engine it is.
BACKEND_FILES = ("store/mod.rs",)
# Nothing above the store asks which engine it is (issue 69): it asks the
# topic that cares, and a queue living in a store gets its engine's handle
# from the store (`Db::embedded_engine`, `Db::lanes_engine`).
ENGINE_ASKED = re.compile(r"\.(sqlite|postgres|is_shared)\(\)")
SQL_FOLDERS = ("store/sqlite/", "store/postgres/", "queue/embedded/", "queue/postgres/")
PATH = re.compile(r"\bcrate::([a-z_]+)")
# sqlx reaches PostgreSQL only; the SQLite file has one driver (issue 45).
SQLX_SQLITE = re.compile(r"\bsqlx::(sqlite|Sqlite)")
FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(async\s+)?(const\s+)?fn\s+(\w+)")
MAX_FN_LINES = 100
# Lines of code (not blank, not comment) of one file's non-test code.
MAX_FILE_LINES = 1000


def long_functions(code):
    """(name, first line, lines) of each function of `code` over
    MAX_FN_LINES, its body found by counting braces outside strings."""
    lines = code.splitlines()
    found = []
    for start, line in enumerate(lines):
        match = FN.match(line)
        if not match:
            continue
        depth, opened, end = 0, False, start
        for end in range(start, len(lines)):
            text = re.sub(r'"(\\.|[^"\\])*"', '""', lines[end])
            text = re.sub(r"'(\\.|[^'\\])'", "''", text)
            for ch in text:
                if ch == "{":
                    depth, opened = depth + 1, True
                elif ch == "}":
                    depth -= 1
            if (opened and depth <= 0) or (not opened and text.rstrip().endswith(";")):
                break
        if end - start + 1 > MAX_FN_LINES:
            found.append((match.group(5), start + 1, end - start + 1))
    return found


def code_of(path):
    """The file's non-test code, comments dropped."""
    if path.name in ("tests.rs",) or path.name.endswith("_tests.rs") or "test_servers" in path.parts:
        return ""
    text = path.read_text()
    cut = text.find("#[cfg(test)]\nmod tests")
    if cut < 0:
        cut = text.find("#[cfg(test)]\npub(crate) mod tests")
    if cut >= 0:
        text = text[:cut]
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def module_of(path):
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".rs")


def main():
    edges = {}
    problems = []
    for path in sorted(SRC.rglob("*.rs")):
        rel = path.relative_to(SRC).as_posix()
        code = code_of(path)
        if not code:
            continue
        here = module_of(path)
        for target in set(PATH.findall(code)):
            if target != here and target not in ("lib", "main"):
                edges.setdefault(here, set()).add(target)
        if SQL.search(code) and not rel.startswith(SQL_FOLDERS):
            problems.append(f"SQL outside the store's two backends and the queues in them (queue/embedded/, queue/postgres/): src/{rel}")
        if LIFECYCLE.search(code) and rel not in LIFECYCLE_FILES:
            problems.append(f"a message's status or events written outside the lifecycle: src/{rel}")
        if BACKEND.search(code) and rel not in BACKEND_FILES:
            problems.append(f"the store's backend matched outside store/mod.rs: src/{rel}")
        if ENGINE_ASKED.search(code) and not rel.startswith("store/"):
            problems.append(f"the store's engine asked above the store: src/{rel}")
        if SQLX_SQLITE.search(code):
            problems.append(f"sqlx used for the SQLite file (rusqlite is its driver): src/{rel}")
        lines_of_code = sum(1 for line in code.splitlines() if line.strip())
        if lines_of_code > MAX_FILE_LINES:
            problems.append(f"src/{rel} has {lines_of_code} lines of code (over {MAX_FILE_LINES})")
        for name, line, length in long_functions(code):
            problems.append(f"fn {name} is {length} lines (over {MAX_FN_LINES}): src/{rel}:{line}")
    for source, targets in FORBIDDEN.items():
        for target in sorted(edges.get(source, set()) & targets):
            problems.append(f"{source} must not reach {target}")
    # Cycles between top-level modules (depth-first search).
    state = {}
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                problems.append("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    for problem in problems:
        print(problem)
    print(f"layers: {len(edges)} modules, {sum(len(t) for t in edges.values())} edges, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
