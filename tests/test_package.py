"""The package boundary: runtime dependencies are what jaxcomm/ imports; one private JAX name."""

import ast
import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[1]
# import name -> distribution name, where they differ
DIST = {"jax": "jax", "optax": "optax", "numpy": "numpy", "chex": "chex"}


# modules behind an optional extra, imported only when used: module -> extra
OPTIONAL = {"flax.py": "flax", "elastic.py": "ft", "ft_manager.py": "ft"}


def third_party_imports(files=None) -> set[str]:
    """Top-level modules imported in jaxcomm/ (lazy imports included), stdlib excluded.

    ``files``: the paths to read; default every module but the :data:`OPTIONAL` ones.
    """
    found = set()
    if files is None:
        files = [p for p in (ROOT / "jaxcomm").rglob("*.py") if p.name not in OPTIONAL]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "jaxcomm"}


def runtime_dependencies() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].lower() for d in deps}


def test_runtime_dependencies_are_exactly_what_jaxcomm_imports():
    imports = third_party_imports()
    assert imports == {"jax", "optax", "numpy"}
    assert runtime_dependencies() == {DIST[m] for m in imports}


def test_jaxcomm_flax_is_optional_and_imports_only_flax_beyond_the_core():
    (path,) = [p for p in (ROOT / "jaxcomm").rglob("flax.py")]
    assert third_party_imports([path]) - {"jax", "optax", "numpy"} == {"flax"}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("flax") for d in extras["optional-dependencies"]["flax"])
    import subprocess

    probe = "import jaxcomm, sys; assert 'flax' not in sys.modules; jaxcomm.flax.data_parallel"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_jaxcomm_elastic_imports_torch_and_torchft_only_when_used():
    paths = [ROOT / "jaxcomm" / "elastic.py", ROOT / "jaxcomm" / "ft_manager.py"]
    assert third_party_imports(paths) - {"jax", "optax", "numpy"} == {"torch", "torchft"}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ft = extras["optional-dependencies"]["ft"]
    assert any(d.startswith("torchft") for d in ft) and any(d.startswith("torch>") for d in ft)
    import subprocess

    probe = "import jaxcomm, sys; jaxcomm.ElasticDiLoCo; assert 'torch' not in sys.modules"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_experiments_only_packages_are_not_runtime_dependencies():
    assert not runtime_dependencies() & {"flax", "orbax-checkpoint", "absl-py", "matplotlib"}


def test_the_one_private_jax_name_jaxcomm_uses_still_exists():
    # jaxcomm.distributed.coordination_state: if this fails after a JAX upgrade, find the
    # coordination client's new home and widen the bound in pyproject.toml
    from jaxcomm import distributed

    state = distributed.coordination_state()
    for attr in ("client", "coordinator_address"):
        assert hasattr(state, attr), attr
    sources = [p.read_text() for p in (ROOT / "jaxcomm").rglob("*.py")]
    assert sum(s.count("from jax._src") for s in sources) == 1


def test_jax_version_is_bounded_above():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (jax_dep,) = [d for d in deps if d.startswith("jax")]
    assert "<" in jax_dep


def cross_module_private_names() -> list[str]:
    """``module._name`` uses and ``from jaxcomm... import _name`` across jaxcomm's modules."""
    hits = []
    for path in (ROOT / "jaxcomm").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = set()  # names bound to jaxcomm modules in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcomm"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        hits.append(f"{path.name}:{node.lineno} imports {node.module}.{a.name}")
                    modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                ours = [a for a in node.names if a.name.startswith("jaxcomm")]
                modules |= {a.asname or a.name.split(".")[0] for a in ours}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
            ):
                hits.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return hits


def test_no_module_reaches_another_modules_private_names():
    assert cross_module_private_names() == []


def body_lines(fn: ast.AST) -> int:
    """Source lines of a function's body: docstring excluded, nested functions not counted."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = {n for stmt in body for n in range(stmt.lineno, stmt.end_lineno + 1)}
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines -= set(range(node.lineno, node.end_lineno + 1))
    return len(lines)


def test_no_function_body_over_60_lines():
    long = []
    for path in (ROOT / "jaxcomm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := body_lines(node)) > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"split these into stages of ~30 lines: {long}"
