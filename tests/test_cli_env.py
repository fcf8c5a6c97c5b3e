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
