"""dflash_export.decoding.sampling and SamplingParams: the request's sampling settings are checked in one place, and the
adaptive-verification rule keeps exactly the draft prefix whose expected gain pays for its rows (closed forms)."""

import numpy as np
import pytest

from dflash_export.decoding.sampling import top_probability, verify_length
from dflash_export.engines.base import SamplingParams
from dflash_export.errors import DFlashError


def test_verify_length_keeps_the_prefix_worth_verifying():
    assert verify_length(np.array([0.9, 0.5, 0.9, 0.1]), 0.3) == 3     # cumulative 0.9, 0.45, 0.405 | 0.04
    assert verify_length(np.array([0.9, 0.5, 0.9, 0.1]), 0.42) == 2
    assert verify_length(np.array([0.2, 1.0]), 0.3) == 0
    assert verify_length(np.array([1.0, 1.0]), 0.3) == 2
    logits = np.array([[0.0, 0.0], [10.0, -10.0]])
    np.testing.assert_allclose(top_probability(logits), [0.5, 1 / (1 + np.exp(-20))], rtol=1e-6)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_new_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"seed": -3}, "seed"),
])
def test_sampling_params_are_checked_when_made_naming_the_request_field(kwargs, field):
    """A SamplingParams out of range cannot be made (the CLI, the Python API and the Triton model all make one)."""
    with pytest.raises(DFlashError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
    SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=0).check()  # the edges pass
