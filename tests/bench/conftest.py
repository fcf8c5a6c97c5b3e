"""The benchmark tests check what the commands do and write, never how fast: the matmul probe and the
peak measurement (a second of matmuls each, per record) are replaced by fixed numbers, except in the
tests of the probe itself."""
import pytest

PROBE = {"matmul_gflops_best": 100.0, "matmul_gflops_median": 90.0, "matmul_slowest_over_fastest": 1.5}


@pytest.fixture(autouse=True)
def no_matmul_probe(request, monkeypatch):
    if "matmul_probe" in request.node.name:
        return
    from lintrans.bench import machine

    monkeypatch.setattr(machine, "matmul_probe", lambda *a, **k: dict(PROBE))
    monkeypatch.setattr(machine, "matmul_peak_flops", lambda *a, **k: 1e11)
