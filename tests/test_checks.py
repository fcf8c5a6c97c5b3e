"""lintrans.checks: the shared argument checks every error message comes from."""
import pytest

from lintrans.checks import check_choice


@pytest.mark.parametrize("value, hint", [
    ("gated_deltanet", " (did you mean 'gated-deltanet'?)"),  # _ for -
    ("Softmax", " (did you mean 'softmax'?)"),                # case
    ("sofmax", " (did you mean 'softmax'?)"),                 # a typo
    ("zzz", ""),                                              # nothing close: no guess
    (3, ""),                                                  # not a string
])
def test_check_choice_names_the_allowed_values_and_a_close_one(value, hint):
    allowed = ["softmax", "linear", "gated-deltanet"]
    with pytest.raises(ValueError) as e:
        check_choice("attention", value, allowed)
    assert str(e.value) == f"attention must be one of {allowed}, got {value!r}{hint}"


def test_check_choice_accepts_allowed_values_and_unhashable_ones_fail_cleanly():
    check_choice("form", "chunked", {"chunked": 1, "recurrent": 2})
    with pytest.raises(ValueError, match=r"form must be one of \['chunked'\], got \[1\]"):
        check_choice("form", [1], {"chunked"})
