"""jaxcomm.options: the factories' common keyword options, taken through ``take``.

Each converted factory takes exactly the options in :data:`TAKES`, with
exactly the defaults there (a hand-written table of what the factories took
before issue 43): a changed default or an option gained or lost fails here.
"""

import re
import sys

import jax
import pytest

import jaxcomm
from jaxcomm import methods, options
from jaxcomm.options import DEFAULTS, Options, take

AUTO = DEFAULTS["bucket_bytes"]
REQUIRED = "required"  # key: no default, the factory refuses to build without one

# factory -> (codec arguments needed to build it, {option: default it resolves to})
TAKES = {
    "allreduce": ({}, {"axis_name": None, "bucket_bytes": AUTO}),
    "cast": (
        {},
        {
            "axis_name": None,
            "error_feedback": False,
            "min_size": 1024,
            "state_dtype": None,
            "bucket_bytes": AUTO,
            "exchange": "auto",
        },
    ),
    **{
        name: (
            {},
            {
                "axis_name": None,
                "key": key,
                "error_feedback": False,
                "min_size": 1024,
                "state_dtype": None,
                "bucket_bytes": AUTO,
                "exchange": "auto",
            },
        )
        for name, key in (("int8", None), ("qsgd", REQUIRED), ("terngrad", REQUIRED))
    },
    **{
        name: (
            {},
            {
                "axis_name": None,
                "error_feedback": True,
                "min_size": 1024,
                "state_dtype": None,
                "bucket_bytes": AUTO,
                "exchange": "auto",
            },
        )
        for name in ("onebit", "ef_sign")
    },
    "sign_majority": (
        {},
        {"axis_name": None, "min_size": 1024, "state_dtype": None, "bucket_bytes": AUTO},
    ),
    "twobit": (
        {},
        {
            "axis_name": None,
            "min_size": 1024,
            "state_dtype": None,
            "bucket_bytes": AUTO,
            "exchange": "auto",
        },
    ),
    "randomk": (
        {"ratio": 0.1},
        {
            "key": REQUIRED,
            "axis_name": None,
            "error_feedback": True,
            "min_size": 1024,
            "state_dtype": None,
            "bucket_bytes": AUTO,
        },
    ),
    "threshold": (
        {"ratio": 0.1},
        {
            "axis_name": None,
            "error_feedback": True,
            "min_size": 1024,
            "state_dtype": None,
            "bucket_bytes": AUTO,
        },
    ),
    "topk": (
        {"ratio": 0.1},
        {
            "axis_name": None,
            "error_feedback": True,
            "scope": "leaf",
            "min_size": 1024,
            "state_dtype": None,
            "bucket_bytes": AUTO,
        },
    ),
    **{
        name: ({}, {"axis_name": None, "exchange": "auto", "min_size": 1024, "bucket_bytes": AUTO})
        for name in ("onebit_adam", "zero_one_adam")
    },
}
KEY = jax.random.key(0)


class _Taken(Exception):
    """Raised by the spy on ``take``: the factory stops once its options are resolved."""


def resolved(name: str, **given) -> tuple[str, dict]:
    """``(factory name passed to take, the options take resolved)`` for ``jaxcomm.<name>``."""
    factory = getattr(jaxcomm, name)
    module = sys.modules[factory.__module__]
    seen = {}

    def spy(factory_name, options, names, **defaults):
        seen["out"] = (factory_name, take(factory_name, options, names, **defaults))
        raise _Taken

    real = module.take
    module.take = spy
    try:
        with pytest.raises(_Taken):
            factory(**TAKES[name][0], **given)
    finally:
        module.take = real
    return seen["out"]


def build(name: str, **given):
    args, takes = TAKES[name]
    key = {"key": KEY} if takes.get("key") == REQUIRED else {}
    return getattr(jaxcomm, name)(**args, **key, **given)


def test_the_table_covers_the_factories_that_take_options_and_only_known_options():
    assert all(set(t) <= set(DEFAULTS) for _, t in TAKES.values())
    assert set(DEFAULTS) == set(Options.__annotations__)
    for name in TAKES:
        assert name in methods.names(), name


@pytest.mark.parametrize("name", sorted(TAKES))
def test_resolved_defaults_are_the_factorys_own(name):
    factory_name, got = resolved(name)
    want = {k: (None if v == REQUIRED else v) for k, v in TAKES[name][1].items()}
    assert factory_name == name
    assert got == want


@pytest.mark.parametrize("name", sorted(TAKES))
def test_a_given_option_wins_over_the_default(name):
    takes = TAKES[name][1]
    option = "min_size" if "min_size" in takes else "bucket_bytes"
    _, got = resolved(name, **{option: 7})
    assert got[option] == 7


@pytest.mark.parametrize(
    "name", sorted(n for n, (_, t) in TAKES.items() if t.get("key") == REQUIRED)
)
def test_a_required_key_is_still_required(name):
    with pytest.raises(TypeError, match=f"key: a PRNG key is required for {name}"):
        getattr(jaxcomm, name)(**TAKES[name][0])
    assert build(name) is not None


@pytest.mark.parametrize("name", sorted(TAKES))
def test_an_option_the_factory_does_not_take_is_refused_naming_it(name):
    takes = TAKES[name][1]
    for option in sorted(set(DEFAULTS) - set(takes)):
        value = KEY if option == "key" else DEFAULTS[option]
        with pytest.raises(
            TypeError, match=rf"jaxcomm\.{name}: unexpected argument\(s\) '{option}'"
        ):
            build(name, **{option: value})


@pytest.mark.parametrize("name", sorted(TAKES))
def test_a_misspelled_argument_is_refused_naming_the_factory(name):
    with pytest.raises(TypeError, match=rf"jaxcomm\.{name}: unexpected argument\(s\) 'ratoi'"):
        build(name, ratoi=0.01)


@pytest.mark.parametrize("name", sorted(TAKES))
def test_the_docstring_names_the_options_taken_on_one_options_entry(name):
    doc = " ".join(getattr(jaxcomm, name).__doc__.split())
    assert doc.count("**options:") == 1, name
    entry = doc.split("**options:")[1].split("see :class:`jaxcomm.options.Options`")[0]
    named = [w for w in re.findall(r"``(\w+)``", entry) if w in DEFAULTS]
    assert named == list(TAKES[name][1]), name


def test_the_issues_examples():
    with pytest.raises(TypeError, match=r"jaxcomm\.onebit: .*'key'.*axis_name, error_feedback"):
        jaxcomm.onebit(key=KEY)
    with pytest.raises(TypeError, match=r"jaxcomm\.topk: unexpected argument\(s\) 'ratoi'"):
        jaxcomm.topk(0.01, ratoi=0.1)


def test_methods_make_adds_a_key_only_where_the_options_take_one():
    assert methods.make("qsgd", levels=4) is not None  # key added
    assert methods.make("onebit") is not None  # no key: none added (else refused)
    with pytest.raises(TypeError, match=r"jaxcomm\.onebit: unexpected argument\(s\) 'ratoi'"):
        methods.make("onebit", ratoi=1)


# --- take ---------------------------------------------------------------------------


def test_take_returns_every_name_given_then_factory_default_then_defaults():
    got = take(
        "f", {"min_size": 3}, ("axis_name", "min_size", "error_feedback"), error_feedback=False
    )
    assert got == {"axis_name": None, "min_size": 3, "error_feedback": False}
    assert list(got) == ["axis_name", "min_size", "error_feedback"]  # in the order named
    assert take("f", {}, ()) == {}
    # a given value wins over the factory's default, None included
    assert take("f", {"error_feedback": True}, ("error_feedback",), error_feedback=False) == {
        "error_feedback": True
    }
    assert take("f", {"state_dtype": None}, ("state_dtype",), state_dtype=1) == {
        "state_dtype": None
    }


def test_take_refuses_unknown_names_sorted_with_what_it_takes():
    with pytest.raises(TypeError) as err:
        take("myfactory", {"zeta": 1, "key": 2, "min_size": 3}, ("axis_name", "min_size"))
    assert str(err.value) == (
        "jaxcomm.myfactory: unexpected argument(s) 'key', 'zeta'; besides its own arguments it "
        "takes the options axis_name, min_size (see jaxcomm.options.Options)"
    )
    # a TypeError that says what it refused, for callers that retry (methods.make's key)
    assert isinstance(err.value, options.UnknownOption)
    assert (err.value.factory, err.value.unknown) == ("myfactory", ["key", "zeta"])


def test_take_does_not_modify_what_the_caller_passed():
    given = {"min_size": 3}
    take("f", given, ("axis_name", "min_size"))
    assert given == {"min_size": 3}


def test_options_is_a_public_module():
    assert jaxcomm.options.take is take
    assert "options" in jaxcomm.__all__
