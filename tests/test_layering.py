"""Import walls between the packages, checked on the source (every `import` in every module,
those inside functions and under `TYPE_CHECKING` included), without importing anything.

- The HTTP side (`segserve.server.http`) talks to the engine through its client and events:
  it imports no `segserve.bank`, `segserve.server.runner` or `segserve.server.runtime`.
- Nothing below the HTTP side imports it: not the engine, the scheduler, the runner, the
  bank, the KV cache, the kernels or the settings.
- The sub-packages import each other without a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("server", "bank", "kv", "kernels", "config")

# Sub-packages whose import graph must stay acyclic (most specific first).
GROUPS = (
    "segserve.server.http", "segserve.server.engine", "segserve.server.scheduling",
    "segserve.server.runner", "segserve.server.chat", "segserve.bank", "segserve.kv",
    "segserve.kernels", "segserve.config",
)
BELOW_HTTP = (
    "segserve.server.engine", "segserve.server.scheduling", "segserve.server.runner",
    "segserve.bank", "segserve.kv", "segserve.kernels", "segserve.config",
)
HTTP_MAY_NOT = ("segserve.bank", "segserve.server.runner", "segserve.server.runtime")


def _modules() -> Iterator[tuple[str, Path]]:
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield "segserve." + ".".join(parts), path


def _imports(module: str, path: Path) -> set[str]:
    """Every module `module` names in an import (`from a import b` counts as `a.b` too,
    since `b` may be a submodule)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            out.add(origin)
            out.update(f"{origin}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("segserve.")}


def _under(module: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if module == p or module.startswith(p + ".")), None)


GRAPH = {m: _imports(m, p) for m, p in _modules()}


def test_the_walk_sees_the_packages() -> None:
    """The walls below are only as good as the walk: it must find the modules it guards."""
    for group in GROUPS:
        assert any(_under(m, (group,)) for m in GRAPH), group
    assert "segserve.server.engine.loop" in GRAPH["segserve.server.http.openai_api"] or any(
        _under(i, ("segserve.server.engine",)) for i in GRAPH["segserve.server.http.openai_api"]
    )


def test_http_reaches_no_bank_runner_or_runtime() -> None:
    bad = sorted(
        f"{m} imports {i}"
        for m, imports in GRAPH.items() if _under(m, ("segserve.server.http",))
        for i in imports if _under(i, HTTP_MAY_NOT)
    )
    assert not bad, "\n".join(bad)


def test_nothing_below_http_imports_it() -> None:
    bad = sorted(
        f"{m} imports {i}"
        for m, imports in GRAPH.items() if _under(m, BELOW_HTTP)
        for i in imports if _under(i, ("segserve.server.http",))
    )
    assert not bad, "\n".join(bad)


def _group_edges() -> dict[str, dict[str, str]]:
    """group -> {imported group: one module import that makes the edge}."""
    edges: dict[str, dict[str, str]] = {g: {} for g in GROUPS}
    for m, imports in GRAPH.items():
        src = _under(m, GROUPS)
        if src is None:
            continue
        for i in imports:
            dst = _under(i, GROUPS)
            if dst is not None and dst != src:
                edges[src].setdefault(dst, f"{m} -> {i}")
    return edges


def _cycle(edges: dict[str, dict[str, str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(g: str) -> list[str] | None:
        state[g] = 1
        stack.append(g)
        for nxt in sorted(edges[g]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[g] = 2
        return None

    for g in GROUPS:
        if g not in state and (found := visit(g)) is not None:
            return found
    return None


def test_no_import_cycle_between_subpackages() -> None:
    edges = _group_edges()
    cycle = _cycle(edges)
    why = [edges[a][b] for a, b in zip(cycle, cycle[1:], strict=False)] if cycle else []
    assert cycle is None, " -> ".join(cycle or []) + "\n" + "\n".join(why)


def test_the_cycle_check_can_fail() -> None:
    """A planted back edge is reported, with the import that makes it."""
    edges = _group_edges()
    edges["segserve.kv"]["segserve.server.http"] = "planted"
    edges["segserve.server.http"].setdefault("segserve.kv", "planted too")
    assert _cycle(edges) is not None


def test_light_engine_modules_do_not_load_the_runner() -> None:
    """The HTTP error mapping (imported by the connection guard before the CLI has kept
    mlx-lm from lowering the open-file limit) reaches the engine's errors without loading
    the engine package's heavy parts, the runner and mlx-lm."""
    import subprocess
    import sys

    code = (
        "import sys, segserve.server.http.errors, segserve.server.engine.errors, "
        "segserve.server.engine.state; "
        "print(sorted(m for m in ('mlx_lm', 'segserve.server.runner') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_settings_import_nothing_above_them() -> None:
    # config/ is read before anything else is built: it may import only itself.
    wrong = [(name, target) for name, path in _modules() if name.startswith("segserve.config")
             for target in _imports(name, path) if target.startswith("segserve.") and not target.startswith("segserve.config")]
    assert wrong == []


def test_the_request_vocabulary_needs_no_runner() -> None:
    """What a request carries and a token brings back (events, sampling parameters,
    log-probabilities) is defined without the runner: the HTTP side's view of the engine
    does not pull in the model code's modules."""
    for module in ("segserve.server.engine.events", "segserve.server.scheduling.params",
                   "segserve.server.scheduling.plan"):
        assert not any(_under(i, ("segserve.server.runner",)) for i in GRAPH[module]), module
