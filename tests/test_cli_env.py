"""The CLI's process settings: PyTorch's huge-page CPU allocation, unless the user chose."""
import os
import sys

import pytest

from lintrans.cli import use_huge_pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="THP is a Linux feature")
def test_cli_asks_for_huge_pages_unless_set(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # an explicit opt-out is kept
    use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_machine_info_records_the_allocation_setting(monkeypatch):
    from lintrans.bench.machine import machine_info

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    info = machine_info()
    assert info["thp_alloc"] == "1" and isinstance(info["transparent_hugepage"], str)


def test_check_number_names_the_argument_and_the_allowed_range():
    import pytest

    from lintrans.checks import check_number

    check_number("x", 3, integer=True, low=1)
    check_number("p", None, low=0, high=1, low_open=True, allow_none=True)
    for value, exc, message in ((True, TypeError, "x must be an int >= 1, got True"),
                                (2.0, TypeError, "x must be an int >= 1, got 2.0"),
                                (0, ValueError, "x must be an int >= 1, got 0")):
        with pytest.raises(exc, match=message):
            check_number("x", value, integer=True, low=1)
    for value in (0, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"p must be a number in \(0, 1\] or None"):
            check_number("p", value, low=0, high=1, low_open=True, allow_none=True)
