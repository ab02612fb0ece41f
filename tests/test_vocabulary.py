"""One name per thing in the exchange vocabulary: each collective has one home and one
import path (jaxcomm.collectives over a pytree, jaxcomm.buckets' ``bucketed_*`` over a
list), and the library reaches none through the old re-exports of jaxcomm.exchange."""

import ast
import importlib
import pathlib
import pkgutil
import warnings

import pytest

import jaxcomm
from jaxcomm import buckets, collectives, exchange, ledger

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLLECTIVES = ("psum", "pmean", "all_gather", "all_to_all", "psum_scatter", "ppermute", "agree")
BUCKETED = ("psum", "pmax", "pmean", "psum_scatter", "all_to_all", "all_gather")


def _modules():
    for info in pkgutil.walk_packages(jaxcomm.__path__, "jaxcomm."):
        if info.name != "jaxcomm.flax":  # the optional flax integration
            yield importlib.import_module(info.name)


def test_each_collective_is_defined_once_in_the_library():
    homes = {name: set() for name in COLLECTIVES + tuple(f"bucketed_{b}" for b in BUCKETED)}
    for mod in _modules():
        for name in homes:
            obj = vars(mod).get(name)
            if obj is not None and getattr(obj, "__module__", None) == mod.__name__:
                homes[name].add(mod.__name__)
    for name in COLLECTIVES:
        assert homes[name] == {"jaxcomm.collectives"}, (name, homes[name])
    for name in BUCKETED:
        assert homes[f"bucketed_{name}"] == {"jaxcomm.buckets"}, (name, homes[name])
        assert not hasattr(buckets, name), f"buckets.{name}: the list version is bucketed_{name}"


def _old_paths(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``exchange.<moved name>`` and ``from jaxcomm.exchange import <moved name>`` in code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("exchange", "_xc")
            and node.attr in exchange._MOVED
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: exchange.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "jaxcomm.exchange":
            for alias in node.names:
                if alias.name in exchange._MOVED:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: import {alias.name}")
    return found


def test_no_module_reaches_a_collective_through_exchange():
    files = sorted((ROOT / "jaxcomm").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    found = [hit for path in files if path.name != "test_vocabulary.py" for hit in _old_paths(path)]
    assert not found, "\n".join(found)


def test_the_old_path_finder_finds_old_paths(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from jaxcomm import exchange\nfrom jaxcomm.exchange import psum\nexchange.agree\n"
    )
    found = _old_paths(probe, tmp_path)
    assert found == ["probe.py:2: import psum", "probe.py:3: exchange.agree"]


@pytest.mark.parametrize(
    "name, home",
    [
        ("psum", collectives),
        ("all_gather", collectives),
        ("recording", ledger),
        ("Collective", ledger),
    ],
)
def test_the_old_exchange_paths_warn_and_name_the_home(name, home):
    with pytest.warns(DeprecationWarning, match=f"import it from {home.__name__}"):
        obj = getattr(exchange, name)
    assert obj is getattr(home, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            exchange.no_such_name  # noqa: B018
