"""SamplingParams' n choices: each runs as a request of its own, whose seed differs from the
others' and stays in int64."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams, wrap_int64


def test_seeds_of_choices_stay_in_int64():
    assert wrap_int64(2**63 - 1 + 1) == -(2**63)
    assert wrap_int64(5) == 5 and wrap_int64(-(2**63)) == -(2**63)
    assert SamplingParams(seed=2**63 - 1, n=2).for_choice(1).seed == -(2**63)


def test_a_choice_is_one_request_with_a_seed_of_its_own():
    params = SamplingParams(seed=7, n=3, temperature=0.5)
    choices = [params.for_choice(j) for j in range(params.n)]
    assert [c.seed for c in choices] == [7, 8, 9] and {c.n for c in choices} == {1}
    assert {c.temperature for c in choices} == {0.5}
    assert SamplingParams(n=2).for_choice(1).seed is None


def test_n_below_one_is_refused_by_name():
    with pytest.raises(InvalidRequestError, match="n: must be an integer >= 1"):
        SamplingParams(n=0)
