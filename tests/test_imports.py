"""The house's import rules, read from the source (ast): inside `ultraep_jax/` the imports run
one way (the graph of its modules, and of its parts: subpackages and top-level modules, has no
cycle); each public name is found where it is listed; experiments/ and models/ import only what
the library exports (`ultraep_jax`, `ultraep_jax.config`, `ultraep_jax.tools`), nothing private
and nothing from tests/; experiments/ is one shared part (`experiments.lab`) and programs that
are leaves over it: no program imports another, the shared part imports none; inside a folder
too, a program (a module with a ``main``) reaches no other program through its imports, a
module that is neither lab nor a program serves one program, and no module of experiments/
imports another one's private (underscored) names."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "ultraep_jax"


def module_name(path: pathlib.Path) -> str:
    """The dotted name of the module at ``path`` (relative to the repository root)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: pathlib.Path) -> list[str]:
    """Every dotted name the file at ``path`` imports (anywhere in it, functions included):
    ``import a.b`` gives "a.b"; ``from a.b import c`` gives "a.b.c" (a module or a name in a.b);
    relative imports are resolved against the file's package."""
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(above + ([node.module] if node.module else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def library_modules() -> dict[str, pathlib.Path]:
    """Every module of the package, by dotted name."""
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imported_homes(path: pathlib.Path) -> dict[str, str]:
    """Each name the file at ``path`` imports with ``from module import name`` (anywhere in it:
    the root package imports Flax's names on first use, in a function), with its module."""
    return {
        alias.asname or alias.name: node.module
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def module_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """The import graph of ``modules`` (by dotted name): module -> the modules of ``modules`` it
    imports (``from a import b`` counts as importing module a.b when there is one, else a)."""
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imported_names(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def library_graph() -> dict[str, set[str]]:
    """The import graph of the package's modules (`module_graph`)."""
    return module_graph(library_modules())


def part(module: str) -> str:
    """The part of the package a module belongs to: its subpackage or top-level module."""
    return ".".join(module.split(".")[:2])


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


#: The library modules that experiments/ and models/ may import names from.
EXPORTS = (PACKAGE, f"{PACKAGE}.config", f"{PACKAGE}.tools")

#: A Python import in any text (the shell scripts' inline Python): "from a.b import c, d" or
#: "import a.b".
_TEXT_IMPORT = re.compile(r"\bfrom\s+([\w.]+)\s+import\s+([\w, ]+)|\bimport\s+([\w.]+)")


def text_imported_names(text: str) -> list[str]:
    """The dotted names a text's Python import lines import (as `imported_names` gives them)."""
    names = []
    for module, items, plain in _TEXT_IMPORT.findall(text):
        if plain:
            names.append(plain)
        else:
            names += [f"{module}.{item.strip()}" for item in items.split(",") if item.strip()]
    return names


def unexported(name: str) -> bool:
    """Whether importing the dotted ``name`` reaches past what the library exports: a library
    module other than `EXPORTS`, or a private name (leading underscore) of one; or tests/."""
    if name == "tests" or name.startswith("tests."):
        return True
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return False
    if name in EXPORTS:
        return False
    module, _, attr = name.rpartition(".")
    return module not in EXPORTS or attr.startswith("_")


def program_imports() -> list[tuple[str, str]]:
    """(file, dotted name) of every import in experiments/ and models/: Python files by ast,
    shell scripts by their inline Python's import lines."""
    found = []
    for folder in ("experiments", "models"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix == ".py":
                names = imported_names(path)
            elif path.suffix == ".sh":
                names = text_imported_names(path.read_text())
            else:
                continue
            found += [(str(path.relative_to(ROOT)), name) for name in names]
    return found


def test_unexported_knows_the_exports():
    assert not unexported("ultraep_jax.MoE")
    assert not unexported("ultraep_jax.config.BalancerConfig")
    assert not unexported("ultraep_jax.tools.check_int")
    assert not unexported("numpy.asarray")
    assert unexported("ultraep_jax._ops.check_int")
    assert unexported("ultraep_jax._native")
    assert unexported("ultraep_jax.planning.native")
    assert unexported("ultraep_jax.replicas.relay")
    assert unexported("ultraep_jax.tools._HOMES")
    assert unexported("tests.references.oracle.random_cases")
    assert text_imported_names("x = 1; from ultraep_jax import _native, tools\nimport a.b") == [
        "ultraep_jax._native",
        "ultraep_jax.tools",
        "a.b",
    ]


def test_programs_import_only_what_the_library_exports():
    found = program_imports()
    assert any(name == "ultraep_jax.tools.check_int" for _, name in found)  # the scan sees them
    bad = [f"{path}: {name}" for path, name in found if unexported(name)]
    assert not bad, "import the library's exports (ultraep_jax.tools): " + "; ".join(bad)


def test_cycle_finds_a_cycle_and_accepts_a_dag():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_library_graph_sees_the_known_edges():
    graph = library_graph()
    assert "ultraep_jax.base.layout" in graph["ultraep_jax.config.balancer"]
    assert "ultraep_jax.dispatch.reroute" in graph["ultraep_jax.dispatch.counts"]
    assert "ultraep_jax.layer" in graph["ultraep_jax"]  # MoE, imported on first use


def test_library_modules_import_one_way():
    assert cycle(library_graph()) is None


def test_library_parts_import_one_way():
    parts: dict[str, set[str]] = {}
    for module, imported in library_graph().items():
        edges = parts.setdefault(part(module), set())
        edges |= {part(m) for m in imported} - {part(module)}
    assert cycle(parts) is None


def test_public_names_resolve_to_their_homes():
    import importlib

    import ultraep_jax

    # with force_balanced, TopKSoftmax and ClampedSwiGLU (gpt-oss), export
    assert len(ultraep_jax.__all__) == len(set(ultraep_jax.__all__)) == 23
    homes = imported_homes(ROOT / PACKAGE / "__init__.py")
    modules = library_modules()
    for name in ultraep_jax.__all__:
        home = homes[name]  # every public name is imported from its home, by name
        if f"{home}.{name}" in modules:  # a submodule (remat, dispatch.reroute)
            expected = importlib.import_module(f"{home}.{name}")
        else:
            expected = getattr(importlib.import_module(home), name)
        assert getattr(ultraep_jax, name) is expected, name
        assert name in dir(ultraep_jax)


#: experiments/'s shared part: what several programs use. Every other part of experiments/ (a
#: subpackage or a top-level module: bench, gpu, planner, replay, serve, sim, stepmodel_programs,
#: train, hf_fixtures) is a program, a leaf over it.
LAB = "experiments.lab"


def experiments_part(module: str) -> str:
    """The part of experiments/ a module belongs to: a program (``experiments.sim``,
    ``experiments.hf_fixtures``) or the shared part's own parts (``experiments.lab.stepmodel``,
    ``experiments.lab.cli``)."""
    depth = 3 if module == LAB or module.startswith(LAB + ".") else 2
    return ".".join(module.split(".")[:depth])


def experiments_parts_graph() -> dict[str, set[str]]:
    """The import graph of experiments/'s parts (`experiments_part`): part -> the other parts it
    imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        own = experiments_part(module_name(path))
        edges = graph.setdefault(own, set())
        for name in imported_names(path):
            if name.startswith("experiments."):
                edges.add(experiments_part(name))
        edges.discard(own)
    return graph


def is_program(part_name: str) -> bool:
    """Whether a part of experiments/ is a program (anything outside `LAB` but the package)."""
    return part_name not in ("experiments", LAB) and not part_name.startswith(LAB + ".")


def program_violations(graph: dict[str, set[str]]) -> list[str]:
    """The edges that break the leaves rule: a program importing another program, or the shared
    part importing a program."""
    return sorted(f"{a} -> {b}" for a, edges in graph.items() for b in edges if is_program(b))


def test_program_violations_sees_a_program_importing_another():
    assert program_violations({"experiments.serve": {"experiments.lab.training"}}) == []
    assert program_violations({"experiments.serve": {"experiments.train"}}) == [
        "experiments.serve -> experiments.train"
    ]
    assert program_violations({"experiments.lab.loads": {"experiments.sim"}}) == [
        "experiments.lab.loads -> experiments.sim"
    ]
    assert experiments_part("experiments.lab.training.config.TrainConfig") == (
        "experiments.lab.training"
    )
    assert experiments_part("experiments.stepmodel_programs.wholestep") == (
        "experiments.stepmodel_programs"
    )


def test_programs_are_leaves_over_the_lab():
    """Each program imports experiments.lab (and models/, ultraep_jax), never another program;
    experiments.lab imports no program."""
    graph = experiments_parts_graph()
    programs = sorted(p for p in graph if is_program(p))
    assert {"experiments.train", "experiments.serve", "experiments.sim"} <= set(programs)
    assert "experiments.lab.training" in graph["experiments.serve"]  # the scan sees the edges
    assert not program_violations(graph), "import experiments.lab instead: " + "; ".join(
        program_violations(graph)
    )


def test_step_model_is_the_model_alone():
    """experiments/lab/stepmodel/ has no flags and no ``main`` and imports no program (its
    programs, experiments.stepmodel_programs, nor sim, replay, bench or planner)."""
    for path in sorted((ROOT / "experiments" / "lab" / "stepmodel").glob("*.py")):
        names = imported_names(path)
        assert "absl.flags" not in names and "absl.app" not in names, path
        programs = [n for n in names if n.startswith("experiments.")]
        assert not any(is_program(experiments_part(n)) for n in programs), (path, names)
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), path


def test_experiments_parts_import_one_way():
    graph = experiments_parts_graph()
    assert "experiments.lab.stepmodel" in graph["experiments.sim"]  # the scan sees the edges
    assert cycle(graph) is None, cycle(graph)


def test_modules_import_no_test_module():
    """What several test files share lives in tests/helpers/ or tests/references/: no file
    imports a test module (``tests.**.test_*``)."""
    found = [
        (str(path.relative_to(ROOT)), name)
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for name in imported_names(path)
        if name.startswith("tests.") and any(p.startswith("test_") for p in name.split("."))
    ]
    assert not found, found


# -- Programs as leaves, module by module ------------------------------------------------------


def defines_main(source: str) -> bool:
    """Whether a module's ``source`` defines ``main`` at its top level: a program, the module
    ``python -m`` runs (a package's ``__main__.py`` imports its program's ``main``, defining
    none)."""
    return any(
        isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(source).body
    )


def experiments_modules() -> dict[str, pathlib.Path]:
    """Every module of experiments/, by dotted name."""
    return {module_name(p): p for p in sorted((ROOT / "experiments").rglob("*.py"))}


def programs_of(modules: dict[str, pathlib.Path]) -> set[str]:
    """The programs among ``modules``: those that define ``main`` (`defines_main`)."""
    return {name for name, path in modules.items() if defines_main(path.read_text())}


def reached(graph: dict[str, set[str]], start: str, programs: set[str]) -> set[str]:
    """The modules ``start``'s imports reach, directly or through modules that are not programs
    (a program reached is not entered)."""
    seen: set[str] = set()
    stack = sorted(graph.get(start, ()))
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        if module not in programs:
            stack += sorted(graph.get(module, ()))
    return seen


def programs_reached(graph: dict[str, set[str]], programs: set[str]) -> list[str]:
    """``"a -> b"`` for each program a whose imports reach another program b (`reached`)."""
    return sorted(
        f"{a} -> {b}" for a in programs for b in reached(graph, a, programs) & programs if b != a
    )


def shared_helpers(graph: dict[str, set[str]], programs: set[str]) -> dict[str, list[str]]:
    """``{module: [programs]}`` of each module outside `LAB` that is no program and that more
    than one program reaches: code two programs share, which belongs in the shared part."""
    users: dict[str, list[str]] = {}
    for program in sorted(programs):
        for module in reached(graph, program, programs) - programs:
            if not experiments_part(module).startswith(LAB):
                users.setdefault(module, []).append(program)
    return {module: found for module, found in sorted(users.items()) if len(found) > 1}


def private_names_used(source: str) -> list[str]:
    """The private names (a part with a leading underscore, not a dunder) of experiments/ that
    ``source`` uses: imported (``from experiments.a import _b``), or read off an imported
    module (``from experiments import a`` then ``a._b``)."""

    def private(name: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in name.split("."))

    tree = ast.parse(source)
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("experiments"):
            for alias in node.names:
                found += [f"{node.module}.{alias.name}"] if private(alias.name) else []
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("experiments") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules and private(node.attr):
                found.append(f"{modules[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_defines_main_sees_a_program():
    assert defines_main("import sys\n\ndef main(argv):\n    return 0\n")
    assert not defines_main("from experiments.train.main import main\n\nmain([])\n")
    assert not defines_main("class A:\n    def main(self):\n        pass\n")
    assert not defines_main("def run():\n    def main():\n        pass\n")


def test_programs_reached_sees_a_program_importing_another():
    """On a made-up graph: a program importing another directly, or through a helper of its own,
    is seen; one that imports the lab and its own helpers is not."""
    programs = {"experiments.x.a", "experiments.x.b", "experiments.y.c"}
    graph = {
        "experiments.x.a": {"experiments.x.a_report", "experiments.lab.cli"},
        "experiments.x.a_report": {"experiments.x.b"},  # a reaches b through its report
        "experiments.x.b": {"experiments.lab.cli", "experiments.x.b_rest"},
        "experiments.y.c": {"experiments.x.b"},
        "experiments.lab.cli": set(),
    }
    assert programs_reached(graph, programs) == [
        "experiments.x.a -> experiments.x.b",
        "experiments.y.c -> experiments.x.b",
    ]
    assert reached(graph, "experiments.y.c", programs) == {"experiments.x.b"}  # not entered
    graph["experiments.x.a_report"] = set()
    graph["experiments.y.c"] = {"experiments.lab.cli"}
    assert programs_reached(graph, programs) == []


def test_shared_helpers_sees_a_helper_of_two_programs():
    programs = {"experiments.x.a", "experiments.x.b"}
    graph = {
        "experiments.x.a": {"experiments.x.common", "experiments.lab.cli"},
        "experiments.x.b": {"experiments.x.common", "experiments.lab.cli"},
        "experiments.x.common": set(),
        "experiments.lab.cli": set(),
    }
    assert shared_helpers(graph, programs) == {
        "experiments.x.common": ["experiments.x.a", "experiments.x.b"]
    }
    graph["experiments.x.b"] = {"experiments.lab.cli"}
    assert shared_helpers(graph, programs) == {}


def test_private_names_used_sees_both_ways_in():
    source = (
        "from experiments.gpu.exchange import AXIS, _compare\n"
        "from experiments.bench import moe\n"
        "import experiments.lab.cli as cli\n"
        "x = moe._build(1) + moe.run() + cli._DEFINE + moe.__doc__\n"
    )
    assert private_names_used(source) == [
        "experiments.bench.moe._build",
        "experiments.gpu.exchange._compare",
        "experiments.lab.cli._DEFINE",
    ]
    assert private_names_used("from experiments.lab import cli\ncli.define_json_out()\n") == []


def test_no_program_reaches_another_program():
    """A program (a module with a ``main``: bench.moe, bench.breakeven, ...) imports the lab, its
    own helpers, models and the library, never another program, even in the same folder:
    breakeven and rates borrowed bench.moe's flags and layer, step_pair bench.step's."""
    modules = experiments_modules()
    graph, programs = module_graph(modules), programs_of(modules)
    assert {"experiments.bench.moe", "experiments.train.main", "experiments.sim.main"} <= programs
    assert "experiments.bench.__init__" not in programs and "experiments.train" not in programs
    assert "experiments.bench.step_report" in graph["experiments.bench.step"]  # the scan sees
    found = programs_reached(graph, programs)
    assert not found, "take the shared part from experiments.lab: " + "; ".join(found)


def test_a_helper_serves_one_program():
    """A module that is neither in experiments.lab nor a program (a program's report, its
    setup) is reached by one program only: code two programs share lives in the lab."""
    modules = experiments_modules()
    graph, programs = module_graph(modules), programs_of(modules)
    found = shared_helpers(graph, programs)
    assert not found, "move to experiments.lab: " + "; ".join(
        f"{module} ({', '.join(users)})" for module, users in found.items()
    )


def test_experiments_import_no_private_name():
    """A file split in two imported the other half's private names (lab/loads/drift.py from
    workloads.py, gpu/exchange_child.py from gpu/exchange.py), programs the private helpers of
    another (bench.breakeven and bench.rates bench.moe's): what crosses a module is public."""
    found = {
        str(path.relative_to(ROOT)): names
        for path in experiments_modules().values()
        if (names := private_names_used(path.read_text()))
    }
    assert not found, found


def test_experiments_modules_import_one_way():
    """Module by module, experiments/'s imports have no cycle (bench/memory.py and its report
    imported each other)."""
    assert cycle(module_graph(experiments_modules())) is None, cycle(
        module_graph(experiments_modules())
    )
