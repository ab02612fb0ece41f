"""Every scheme of the what-if analysis names a jaxcomm factory that takes its keywords.

The schemes are a second list of method names beside the library's; a drifted name
(``majority_vote`` for ``jaxcomm.sign_majority``, QSGD's ``s`` for ``levels``) once
made ``--from_transforms`` skip the scheme with a printed line. Now it raises, and
this test builds every scheme.
"""

import dataclasses

import optax
import pytest

from experiments.bench import whatif_inputs


@pytest.mark.parametrize("scheme", whatif_inputs.SCHEMES, ids=lambda s: s.label)
def test_every_scheme_builds_its_transform(scheme):
    assert isinstance(whatif_inputs.build_transform(scheme), optax.GradientTransformation)


def test_a_drifted_name_or_keyword_is_an_error_naming_the_scheme():
    first = whatif_inputs.SCHEMES[0]
    with pytest.raises(ValueError, match="whatif scheme .*: unknown method .majority_vote."):
        whatif_inputs.build_transform(dataclasses.replace(first, factory="majority_vote"))
    qsgd = next(s for s in whatif_inputs.SCHEMES if s.factory == "qsgd")
    with pytest.raises(ValueError, match="QSGD"):
        whatif_inputs.build_transform(dataclasses.replace(qsgd, factory_kwargs={"s": 4}))
