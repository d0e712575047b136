#!/usr/bin/env python3
"""Finds import circles between the top-level modules of a crate.

Usage: import-cycles.py [--allow A,B ...] CRATE_SRC [CRATE_SRC ...]

`--allow A,B` accepts a circle of exactly the modules A and B (a known one not yet untied);
any other circle, or a known one that grew, fails.

Every `crate::MODULE` path in a module's code (comments and test code left out: `*tests.rs`
files and what follows a `#[cfg(test)]` line) is an edge from that module to MODULE; `lib.rs` only
re-exports and is left out. Prints each circle (a strongly connected set of two or more
modules) with one edge that closes it, and exits 1 when there is any.
"""
import pathlib
import re
import sys

PATH = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)")
USE_GROUP = re.compile(r"\buse crate::\{([^;]*)\}", re.S)


def module_of(src: pathlib.Path, file: pathlib.Path) -> str:
    relative = file.relative_to(src)
    return relative.parts[0].removesuffix(".rs")


def production_text(file: pathlib.Path) -> str:
    if file.name.endswith("tests.rs"):
        return ""
    text = file.read_text()
    cut = text.find("#[cfg(test)]")
    text = text if cut < 0 else text[:cut]
    # Comments (doc links included) name modules without importing them.
    return re.sub(r"//[^\n]*", "", text)


def edges(src: pathlib.Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    modules = {module_of(src, file) for file in src.rglob("*.rs") if file.name != "lib.rs"}
    for file in sorted(src.rglob("*.rs")):
        if file == src / "lib.rs":
            continue
        source = module_of(src, file)
        text = production_text(file)
        targets = set(PATH.findall(text))
        for group in USE_GROUP.findall(text):
            targets.update(re.findall(r"(?:^|[,{\s])([a-z_][a-z0-9_]*)(?=::|\s*[,}]|\s*$)", group))
        graph.setdefault(source, set()).update(
            target for target in targets if target in modules and target != source
        )
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    arguments = sys.argv[1:]
    allowed: list[list[str]] = []
    while arguments[:1] == ["--allow"]:
        allowed.append(sorted(arguments[1].split(",")))
        arguments = arguments[2:]
    status = 0
    for argument in arguments:
        src = pathlib.Path(argument)
        graph = edges(src)
        found = circles(graph)
        for component in found:
            members = set(component)
            inner = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in members]
            known = component in allowed
            status |= 0 if known else 1
            label = "known import circle" if known else "import circle"
            print(f"{src}: {label} among {', '.join(component)}: {'; '.join(inner)}")
        if not found:
            print(f"{src}: no import circles among {len(graph)} modules")
    return status


if __name__ == "__main__":
    sys.exit(main())
