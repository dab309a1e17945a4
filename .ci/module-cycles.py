#!/usr/bin/env python3
"""Fails if the top-level modules of a crate import each other in a circle.

For each crate source directory given, every top-level module (a file or directory under
src/, its child modules folded into it) is a node, and a `crate::NAME` path in its non-test
code (everything before the first `#[cfg(test)]`) is an edge to module NAME. Strongly
connected components of more than one module are cycles. `cargo modules` draws the same graph
but needs a nightly-only build of rust-analyzer; this is what CI can run everywhere.

    python3 .ci/module-cycles.py daemon/src cli/src ...
"""
import os
import re
import sys


def graph(src):
    edges = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            top = os.path.relpath(path, src)[:-3].split(os.sep)[0]
            if top in ("lib", "main"):
                top = "crate"
            code = open(path, encoding="utf-8").read().split("#[cfg(test)]")[0]
            deps = set(re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", code)) - {top}
            edges.setdefault(top, set()).update(deps)
    return edges


def cycles(edges):
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main():
    bad = False
    for src in sys.argv[1:]:
        edges = graph(src)
        found = cycles(edges)
        print(f"{src}: {len(edges)} modules, {'cycles: ' + str(found) if found else 'no cycles'}")
        bad |= bool(found)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
