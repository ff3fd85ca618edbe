#!/usr/bin/env python3
"""make include-graph: the include graph of the C modules under src/, and
the checks that keep it a layering.

A module is a .c file and its .h (src/worker/purge.c and src/worker/purge.h are
worker/purge); module A depends on module B when A's .c or .h includes B's
header ("worker/purge.h", found under src/).  Prints one line per module, with
the modules it includes, and fails (exit 1) when:

  - modules include one another in a cycle (printed), or
  - a header declares an extern that no file but its module's .c uses
    (make it static there), or one that its module does not define.

--quiet prints only the failures; --dot prints the graph for Graphviz.
"""
import os
import re
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'src')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def module_of(path):
    return os.path.splitext(os.path.relpath(path, SRC))[0]


def sources():
    for root, _, files in os.walk(SRC):
        for name in sorted(files):
            if name.endswith(('.c', '.h')):
                yield os.path.join(root, name)


def strip_comments(text):
    return re.sub(r'/\*.*?\*/', ' ', text, flags=re.S)


def graph(files):
    edges = {}
    for path in files:
        module = module_of(path)
        edges.setdefault(module, set())
        with open(path) as f:
            text = strip_comments(f.read())
        for header in INCLUDE.findall(text):
            for base in (os.path.dirname(path), SRC):
                target = os.path.normpath(os.path.join(base, header))
                if os.path.isfile(target):
                    if module_of(target) != module:
                        edges[module].add(module_of(target))
                    break
    return edges


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


EXTERN = re.compile(r'^extern\s+(?!"C")[^;(]*?\b(\w+)\s*(\(|\[|;)', re.M)


def exports(files):
    """Externs declared in a header that only their module's .c uses, or that
    no .c of their module defines."""
    texts = {}
    for path in files:
        with open(path) as f:
            texts[path] = strip_comments(f.read())
    problems = []
    for header in (p for p in files if p.endswith('.h')):
        definer = header[:-2] + '.c'
        for name, _ in EXTERN.findall(texts[header]):
            word = re.compile(r'\b%s\b' % re.escape(name))
            users = [p for p in files if p.endswith('.c') and word.search(texts[p])]
            if definer not in texts or definer not in users:
                problems.append('%s declares %s, which %s does not define'
                                % (os.path.relpath(header, SRC), name,
                                   os.path.relpath(definer, SRC)))
            elif users == [definer]:
                problems.append('%s exports %s, which only %s uses: make it static'
                                % (os.path.relpath(header, SRC), name,
                                   os.path.relpath(definer, SRC)))
    return problems


def main(args):
    files = sorted(sources())
    edges = graph(files)
    if '--dot' in args:
        print('digraph idempotency {')
        for module in sorted(edges):
            for target in sorted(edges[module]):
                print('  "%s" -> "%s";' % (module, target))
        print('}')
        return 0
    if '--quiet' not in args:
        for module in sorted(edges):
            print('%-22s -> %s' % (module, ', '.join(sorted(edges[module])) or '(none)'))
    failures = ['include cycle: ' + ' <-> '.join(c) for c in cycles(edges)]
    failures += exports(files)
    for failure in failures:
        print('include-graph: ' + failure, file=sys.stderr)
    if not failures and '--quiet' not in args:
        print('no cycles; every extern is used beyond its module')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
