"""Factory docstrings say the rule, the bytes, the arguments and the paper, and stay short
(issue 43): implementation notes go to comments, the class or the module docstring."""

import inspect

import pytest

from jaxcomm import methods

MAX_FACTORY_DOC_LINES = 30


def problems(fn) -> list[str]:
    """What the docstring of the factory ``fn`` lacks, or ``[]``."""
    doc = inspect.getdoc(fn) or ""
    found = []
    if len(doc.splitlines()) > MAX_FACTORY_DOC_LINES:
        found.append(f"{len(doc.splitlines())} lines > {MAX_FACTORY_DOC_LINES}")
    if inspect.signature(fn).parameters and "\nArgs:\n" not in doc:
        found.append("no Args:")
    for section in ("Returns:", "Example"):
        if f"\n{section}" not in doc:
            found.append(f"no {section}")
    return found


@pytest.mark.parametrize("name", methods.names())
def test_a_factory_docstring_is_short_with_args_returns_and_an_example(name):
    assert problems(methods.get(name)) == [], name


def test_the_check_finds_a_long_docstring_and_missing_sections():
    def long(x):
        pass

    long.__doc__ = "Summary.\n\nArgs:\n  x: x.\n\nReturns:\n  y.\n\nExample:\n  >>> long(1)\n"
    assert problems(long) == []
    long.__doc__ += "\n".join(["more"] * MAX_FACTORY_DOC_LINES)
    assert problems(long) == [f"{len(inspect.getdoc(long).splitlines())} lines > 30"]
    long.__doc__ = "Summary."
    assert problems(long) == ["no Args:", "no Returns:", "no Example"]
