"""experiments/'s modules import each other without a cycle, and none outgrows LIMIT lines.

The cycle check reads every import of every module under experiments/,
imports inside functions included (the AST helpers of ``tests.test_imports``):
a cycle hidden by a function-level import is still a cycle. The layers it
keeps: a bench's tables (``experiments.bench.<name>_report``) sit below both
the bench that runs it (which regenerates the tables when it is done) and
``experiments.studies.tables`` (which renders every study's tables).
"""

from tests.test_imports import EXPERIMENTS, ROOT, find_cycle, imported, modules

#: The most lines a module of experiments/ may have (DESIGN.md: split a module by concern
#: into smaller ones rather than letting it sprawl).
LIMIT = 500
#: Modules allowed over LIMIT for now (path from the repository root -> why).
OVER_LIMIT: dict[str, str] = {}


def experiments_graph() -> dict[str, set[str]]:
    mods = modules(EXPERIMENTS)
    return {name: imported(path, set(mods)) for name, path in mods.items()}


def oversized(limit: int = LIMIT) -> dict[str, int]:
    """Path (from the repository root) -> line count of each experiments/ module over ``limit``."""
    out = {}
    for path in sorted(EXPERIMENTS.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out[path.relative_to(ROOT).as_posix()] = lines
    return out


def test_the_graph_sees_function_level_imports_in_experiments():
    graph = experiments_graph()
    # module level: the tables import each bench's report module
    assert "experiments.bench.auto_report" in graph["experiments.studies.tables"]
    # inside a function: the peers bench imports its torch side only where torch is needed
    assert "experiments.bench.peers_agree" in graph["experiments.bench.peers"]
    # the cut: the benches regenerate the tables, the tables never import a bench's runner
    assert "experiments.studies.tables" in graph["experiments.bench.auto"]
    assert "experiments.bench.auto" not in graph["experiments.studies.tables"]
    assert "experiments.bench.step_parts" not in graph["experiments.studies.tables"]


def test_experiments_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(experiments_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_size_check_finds_long_modules():
    long = oversized(100)  # a limit both of these are over
    assert "experiments/bench/auto.py" in long and "experiments/train.py" in long
    assert all(n > 100 for n in long.values())


def test_no_experiments_module_is_over_the_limit():
    over = oversized()
    unexpected = {p: n for p, n in over.items() if p not in OVER_LIMIT}
    assert not unexpected, f"over {LIMIT} lines (split by concern): {unexpected}"
    stale = [p for p in OVER_LIMIT if p not in over]
    assert not stale, f"within {LIMIT} lines now or gone: drop from OVER_LIMIT: {stale}"
