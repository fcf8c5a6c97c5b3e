import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models on a shared 2-core machine: two torch threads fighting another process for the
    # cores made a quick study ~20x slower than one thread
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
