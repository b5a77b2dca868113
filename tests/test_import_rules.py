"""The package's import rules (WORKSPACE.md, "Layout"): no cycles, models below the DP stack and the mesh,
host-side privacy code without JAX, a lazy public surface, and no library import of `experiments`.

The graph is read from the source (every `import` of a jaxdp module, at module level or inside a
function, plus the implicit import of each parent package), so a lazy import that closes a cycle counts.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxdp"

# What the models may import: each other and the core (layers, the tape they record on, terms, shard helpers).
MODELS_MAY_IMPORT = ("jaxdp.models", "jaxdp.core")
# Host-side privacy code (accounting, sampling, seeds, ChaCha20): NumPy only.
WITHOUT_JAX = ("jaxdp.accounting.accountant", "jaxdp.accounting.calibration", "jaxdp.accounting.budget",
               "jaxdp.sampling.poisson", "jaxdp.sampling.binomial", "jaxdp.noise.seeds", "jaxdp.noise.chacha")
# What importing a model must not load.
NOT_WITH_A_MODEL = ("jaxdp.clipping", "jaxdp.noise", "jaxdp.pallas", "jaxdp.sharding", "jaxdp.training",
                    "jaxdp.finetune")
# The packages' directions (WORKSPACE.md, "Import rules"): package -> the jaxdp packages it may import.
# `pallas` -> `noise`: the ChaCha20 kernel's reference twin is `jaxdp.noise.chacha`, and `noise` -> `pallas`
# dispatches to that kernel on a GPU (at module level there is no cycle: `test_no_import_cycles`).
MAY_IMPORT = {
    "core": set(),
    "accounting": set(),
    "data": set(),
    "models": {"core"},
    "pallas": {"core", "noise"},
    "noise": {"core", "pallas"},
    "sampling": {"noise"},
    "clipping": {"core", "noise", "pallas"},
    # `analysis` -> `models`, `noise`, `pallas` (lazy): `throughput` builds DP steps, `kernels` times kernels.
    "analysis": {"clipping", "core", "models", "noise", "pallas"},
    "finetune": {"analysis", "core", "models", "clipping", "noise", "sharding"},
    "sharding": {"core", "models", "clipping", "noise", "pallas", "analysis"},
    "auditing": {"accounting", "clipping", "core", "noise", "sampling", "training"},
    "training": {"accounting", "analysis", "clipping", "core", "data", "finetune", "models", "noise", "sampling",
                 "sharding"},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the jaxdp modules it imports}, lazy imports and parent packages included."""
    modules = _modules()

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    def with_parents(name):
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("jaxdp"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets |= with_parents(resolve(full if full in modules else node.module))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("jaxdp"):
                        targets |= with_parents(resolve(alias.name))
        graph[name] = targets - {name} - set(with_parents(name))  # a module's own parents run before it
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_models_import_neither_the_dp_stack_nor_the_mesh():
    graph = import_graph()
    bad = {m: sorted(t for t in targets if t != "jaxdp" and not t.startswith(MODELS_MAY_IMPORT))
           for m, targets in graph.items() if m.startswith("jaxdp.models")}
    assert {m: t for m, t in bad.items() if t} == {}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{package: the other jaxdp packages its modules import} (the top-level `jaxdp` and `jaxdp._*` left out)."""
    def package(name):
        parts = name.split(".")
        return parts[1] if len(parts) > 1 and not parts[1].startswith("_") else None

    out = {}
    for module, targets in graph.items():
        if package(module) is not None:
            out.setdefault(package(module), set()).update(
                p for p in map(package, targets) if p is not None and p != package(module))
    return out


def test_every_package_imports_only_what_its_direction_allows():
    packages = package_graph(import_graph())
    assert set(packages) == set(MAY_IMPORT), "a package was added or removed: give it a line in MAY_IMPORT"
    assert {p: sorted(t - MAY_IMPORT[p]) for p, t in packages.items() if t - MAY_IMPORT[p]} == {}


def test_the_direction_check_can_fail():
    assert package_graph({"jaxdp.core.nn": {"jaxdp", "jaxdp.clipping", "jaxdp.clipping.norms"}}) == {"core": {"clipping"}}


def test_no_library_module_imports_experiments():
    offenders = [str(f.relative_to(ROOT)) for f in PACKAGE.rglob("*.py")
                 if any(isinstance(n, (ast.Import, ast.ImportFrom)) and any(
                     (getattr(n, "module", None) or a.name).startswith("experiments") for a in n.names)
                        for n in ast.walk(ast.parse(f.read_text())))]
    assert offenders == []


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(out.stdout.split())


def test_host_side_privacy_code_imports_no_jax():
    loaded = _loaded_after("import " + ", ".join(WITHOUT_JAX))
    assert "jax" not in loaded


def test_a_model_loads_without_the_dp_stack():
    loaded = _loaded_after("import jaxdp.models.gpt2, jaxdp.models.llama")
    assert sorted(m for m in loaded if m.startswith(NOT_WITH_A_MODEL)) == []


def test_a_command_line_parses_its_flags_before_jax_loads():
    """The jobs import `jaxdp.training.cli` first: a bad flag or --help answers without loading JAX."""
    loaded = _loaded_after("import jaxdp.training.cli")
    assert "jax" not in loaded and "jaxdp.training.loop" not in loaded


def test_the_public_surface():
    """Every public name resolves; the test oracle is not exported; `jaxdp.fused_clip` is the transform even
    after its module is imported (a function named like its module would be shadowed by it)."""
    import jaxdp
    import jaxdp.clipping.aggregation  # noqa: F401
    for name in jaxdp.__all__:
        assert getattr(jaxdp, name) is not None, name
    assert "reference" not in jaxdp.__all__ and callable(jaxdp.fused_clip)
    with pytest.raises(AttributeError):
        jaxdp.no_such_name  # noqa: B018


def test_no_docstring_or_comment_cites_a_review_or_a_commit():
    """Code text states contracts; review numbers, walkthroughs and commit hashes belong in WORKSPACE.md."""
    import re
    pattern = re.compile(r"(attacker )?reviews? \d+|walkthrough|\b[0-9a-f]{7}\b(?=[ ,:;)])|DESIGN\.md")
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def imported_test_modules(source: str, test_modules: set[str]) -> set[str]:
    """The names of `test_modules` that `source` imports: `import`, `from ... import` (at module level or in a
    function) or `importlib.import_module` / `__import__` of a literal name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value).split(".")[0])
    return found & test_modules


def test_no_test_file_imports_another_test_file():
    """Shared helpers live in tests/conftest.py, dp_testing.py (models, gradients) and job_testing.py (the jobs);
    a test file imported by another would bring its fixtures and module state along and tie the two together."""
    tests = {f.stem: f for f in sorted((ROOT / "tests").glob("test_*.py"))}
    found = {name: sorted(imported_test_modules(path.read_text(), set(tests) - {name})) for name, path in tests.items()}
    assert {name: imported for name, imported in found.items() if imported} == {}
    planted = ("from test_pretrain import tiny_config\n\ndef f():\n    import test_llama\n"
               "    importlib.import_module('test_finetune')\n    from dp_testing import lm_loss\n")
    assert imported_test_modules(planted, set(tests)) == {"test_pretrain", "test_llama", "test_finetune"}


MAX_PARAMETERS = 8  # ../shared/STYLE.md 13: what travels together is one named value, not a long argument list
# Functions still over the limit. The set only shrinks: one brought within it must leave the set too.
OVER_THE_LIMIT = {
    "jaxdp/clipping/aggregation.py:fused_clip",  # 9 with mechanism= (correlated noise): to group
}


def functions_over(limit: int, sources: dict[str, str]) -> dict[str, int]:
    """{"file:function": its parameter count} for the functions of `sources` ({file: source}) taking more
    than `limit` parameters: positional and keyword, `self` / `cls` and `*args` / `**kwargs` not counted."""
    found = {}
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                count = sum(x.arg not in ("self", "cls") for x in a.posonlyargs + a.args + a.kwonlyargs)
                if count > limit:
                    found[f"{name}:{node.name}"] = count
    return found


def test_no_library_function_takes_more_than_eight_parameters():
    sources = {f.relative_to(ROOT).as_posix(): f.read_text() for f in sorted(PACKAGE.rglob("*.py"))}
    assert set(functions_over(MAX_PARAMETERS, sources)) == OVER_THE_LIMIT
    planted = ("class A:\n    def f(self, a, b, c, d, e, f, g, h, *, i=0, **kw):\n        pass\n\n"
               "    async def g(cls, a, b, c, d, e, f, g, /, h, *args, **kw):\n        pass\n")
    assert functions_over(MAX_PARAMETERS, {"p.py": planted}) == {"p.py:f": 9}
