"""The comparison helpers the other tests rely on can fail: each planted difference is caught."""

import pytest
from dp_testing import assert_json_close

ROW = {"step": 3, "train_loss": None, "epsilon": 1.25, "note": "x", "vals": [1.0, None, True]}


def test_json_close_accepts_float_rounding():
    assert_json_close(dict(ROW, epsilon=1.25 * (1 + 1e-7)), ROW, rtol=1e-5)


@pytest.mark.parametrize("planted", [
    {"epsilon": 1.26}, {"train_loss": 0.0}, {"note": "y"}, {"step": 3.0}, {"vals": [1.0, None]},
    {"vals": [1.0, None, 1]}, {"extra": 1},
])
def test_json_close_catches_each_planted_difference(planted):
    with pytest.raises(AssertionError):
        assert_json_close(dict(ROW, **planted), ROW, rtol=1e-5)
