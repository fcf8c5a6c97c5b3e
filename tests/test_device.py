"""resolve_device: the devices the CLIs accept, refused before any work with the setting's name."""
import pytest
import torch

from lintrans.device import resolve_device


def test_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")


@pytest.mark.parametrize("name", ["meta", "xpu", "cpu:3", "bogus", "cuda:x"])
def test_devices_the_studies_cannot_train_on_are_refused(name):
    with pytest.raises(ValueError, match=r"--device must be auto, cpu, cuda, cuda:N or mps"):
        resolve_device(name, what="--device")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_past_the_devices_is_refused():
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")
