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


def test_an_output_folder_that_is_a_file_and_a_config_that_is_a_folder_say_so(tmp_path):
    """What the message names is what is wrong: a file where a folder is asked for (it said 'cannot
    write there (File exists)'), a folder where a config file is asked for (it said 'does not exist')."""
    import pytest

    from lintrans._io import writable_folder
    from lintrans.config import read_file
    from lintrans.train.config import resolve_config_path

    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"--out .*f is a file; it must be a folder"):
        writable_folder(f, "--out")
    with pytest.raises(FileNotFoundError, match="is a folder, not a file"):
        resolve_config_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="is a folder, not a file"):
        read_file(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_file(tmp_path / "missing.toml")
    assert writable_folder(tmp_path / "new" / "deeper", "--out").is_dir()
