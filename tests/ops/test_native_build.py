"""The native kernels' build and load fail safe: the cache key separates CPUs, compilers and targets;
a library that does not load is rebuilt once; concurrent builds build once; a killed build's files
are cleaned up and old builds pruned; an allocation failure inside a kernel is a MemoryError; the
ctypes structs are checked against the C side; the bindings' preconditions raise, not assert.

Builds here run a stand-in compiler (a script that logs its call and copies the library this
session built), so that they take milliseconds and can be counted."""
import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lintrans._platform import cpu_identity, cpu_vector_features
from lintrans.ops import aft, linear_attention, native, sliding_window_attention
from lintrans.ops.native import aft as native_aft
from lintrans.ops.native import binding
from lintrans.ops.native import chunked as native_chunked
from lintrans.ops.native import sliding_window as native_sw

from native_paths import needs_native

ROOT = Path(__file__).resolve().parents[2]

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx fma avx2 bmi2
processor\t: 1
flags\t\t: something else entirely
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""


def test_cpu_identity_names_what_the_instructions_depend_on():
    x86 = cpu_identity(X86)
    assert "model name: AMD EPYC 7B13" in x86 and "flags: fpu sse sse2 avx fma avx2 bmi2" in x86
    assert "something else" not in x86  # the first processor's lines only
    assert cpu_identity(X86.replace("bmi2", "bmi2 avx512f")) != x86
    assert cpu_identity(X86.replace("model\t\t: 1", "model\t\t: 17")) != x86
    # ARM's cpuinfo has neither flags nor a model name: its Features and CPU part tell CPUs apart
    arm = cpu_identity(ARM)
    assert "Features: fp asimd" in arm and "CPU part: 0xd0c" in arm
    assert cpu_identity(ARM.replace("0xd0c", "0xd40")) != arm
    assert cpu_identity(ARM.replace(" asimddp", " asimddp sve")) != arm
    assert cpu_vector_features(X86) == "avx avx2 fma"
    assert cpu_vector_features(ARM) == "asimd"


def test_the_build_key_covers_cpu_target_compiler_and_torch(monkeypatch):
    monkeypatch.delenv("LINTRANS_NATIVE_MARCH", raising=False)
    base = native.library_path()
    monkeypatch.setattr(native, "cpu_identity", lambda: cpu_identity(X86))
    avx2 = native.library_path()
    monkeypatch.setattr(native, "cpu_identity", lambda: cpu_identity(X86.replace("bmi2", "bmi2 avx512f")))
    avx512 = native.library_path()
    monkeypatch.setattr(native, "cpu_identity", lambda: cpu_identity(ARM))
    arm = native.library_path()
    assert len({base, avx2, avx512, arm}) == 4
    monkeypatch.setenv("LINTRANS_NATIVE_MARCH", "x86-64-v3")
    assert native.library_path() != arm and "-march=x86-64-v3" in native.flags()
    monkeypatch.setattr(native, "_toolchain", lambda cxx: "another compiler, another libstdc++")
    assert native.library_path() not in (base, avx2, avx512, arm)
    monkeypatch.setattr(native, "_torch_lib", lambda: Path("/elsewhere/torch/lib"))
    assert "/elsewhere/torch/lib" in native.build_key()
    monkeypatch.setenv("LINTRANS_NATIVE_MARCH", "native; rm -rf /")
    with pytest.raises(ValueError, match="LINTRANS_NATIVE_MARCH"):
        native.flags()


def test_the_products_choice_is_a_build_flag_and_part_of_the_key(monkeypatch):
    monkeypatch.delenv("LINTRANS_NATIVE_GEMM", raising=False)
    auto = native.library_path()
    assert "-DLINTRANS_BLAS_ONLY" not in native.flags()
    monkeypatch.setenv("LINTRANS_NATIVE_GEMM", "BLAS")
    assert "-DLINTRANS_BLAS_ONLY" in native.flags() and native.library_path() != auto
    monkeypatch.setenv("LINTRANS_NATIVE_GEMM", "mkl")
    with pytest.raises(ValueError, match="LINTRANS_NATIVE_GEMM=.*auto.*blas"):
        native.flags()


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    """A stand-in compiler that logs each build and copies this session's real library to its -o;
    the cache directory a fresh one in tmp_path. Yields (log file, real library, cache directory)."""
    if not native.available():
        pytest.skip("native kernels unavailable (no C++ compiler?)")
    monkeypatch.delenv("LINTRANS_NATIVE_MARCH", raising=False)
    real = native.build()
    log, cache = tmp_path / "builds.log", tmp_path / "cache"
    script = tmp_path / "fake-c++"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in
          --version) echo "fake c++ 1.0"; exit 0;;
          -print-file-name=*) echo "libstdc++.so"; exit 0;;
        esac
        echo "$$" >> "{log}"
        sleep "${{FAKE_CXX_SLEEP:-0}}"
        prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
        cp "${{FAKE_CXX_OUTPUT:-{real}}}" "$out"
        """))
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("LINTRANS_NATIVE_DIR", str(cache))
    return log, real, cache


def _builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_library_for_another_cpu_is_never_loaded(fake_cxx, monkeypatch):
    log, real, cache = fake_cxx
    monkeypatch.setattr(native, "cpu_identity", lambda: cpu_identity(X86.replace("bmi2", "bmi2 avx512f")))
    other = native.library_path()
    other.parent.mkdir(parents=True)
    other.write_bytes(b"built for a CPU with AVX-512: would die with SIGILL here")  # loading it would fail
    monkeypatch.setattr(native, "cpu_identity", lambda: cpu_identity(X86))
    lib = native.open_library()
    assert native.library_path() != other and _builds(log) == 1
    assert lib.lt_sizeof_ChunkedArgs() == ctypes.sizeof(native_chunked.ChunkedArgs)
    assert other.read_bytes().startswith(b"built for a CPU")  # left alone, never loaded


def test_a_library_that_does_not_load_is_rebuilt_once(fake_cxx):
    log, real, cache = fake_cxx
    path = native.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF truncated by a killed copy")
    lib = native.open_library()
    assert _builds(log) == 1 and path.read_bytes() == real.read_bytes()
    assert lib.lt_sizeof_AftArgs() == ctypes.sizeof(native_aft.AftArgs)
    assert native.open_library() is not None and _builds(log) == 1  # now it loads: no further build


def test_a_compiler_command_with_arguments_builds(fake_cxx, monkeypatch):
    """CXX="ccache g++" style: split as a shell would, not taken as one program's name."""
    log, real, cache = fake_cxx
    monkeypatch.setenv("CXX", f"env FAKE_CXX_SLEEP=0 {os.environ['CXX']}")
    assert native.compiler()[0] == "env"
    native.open_library()
    assert _builds(log) == 1


def test_kernels_turned_on_again_in_a_process_build_then(fake_cxx, monkeypatch):
    log, real, cache = fake_cxx
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("LINTRANS_NATIVE", "0")
    assert native.library() is None and _builds(log) == 0
    monkeypatch.setenv("LINTRANS_NATIVE", "1")
    assert native.library() is not None and _builds(log) == 1


@pytest.mark.parametrize("value, on", [("0", False), ("Off", False), ("no", False), ("1", True), (" TRUE ", True),
                                       ("", True)])
def test_the_switch_reads_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv("LINTRANS_NATIVE", value)
    assert native.enabled() is on


def test_an_unknown_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv("LINTRANS_NATIVE", "bogus")
    with pytest.raises(ValueError, match="LINTRANS_NATIVE='bogus': expected 1, true, yes or on"):
        native.enabled()


def test_a_rebuild_that_does_not_load_either_falls_back_after_one_try(fake_cxx, monkeypatch, tmp_path):
    log, real, cache = fake_cxx
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not a shared object")
    monkeypatch.setenv("FAKE_CXX_OUTPUT", str(junk))
    path = native.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared object either")
    with pytest.raises(OSError):
        native.open_library()
    assert _builds(log) == 1
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    with pytest.warns(RuntimeWarning, match="native CPU kernels unavailable"):
        assert native.library() is None
    assert _builds(log) == 2  # library() tried once more (a new process would too), then gave up


def test_two_processes_building_at_once_build_once(fake_cxx, monkeypatch):
    log, real, cache = fake_cxx
    env = {**os.environ, "FAKE_CXX_SLEEP": "1", "PYTHONPATH": str(ROOT)}
    code = "from lintrans.ops import native; print(native.build())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert paths == {str(native.library_path())}
    assert _builds(log) == 1
    assert Path(paths.pop()).read_bytes() == real.read_bytes()
    assert not list(cache.glob(f"{native.TMP_PREFIX}*"))


def test_a_killed_builds_files_are_removed_and_old_builds_pruned(fake_cxx):
    log, real, cache = fake_cxx
    cache.mkdir()
    stale = cache / f"{native.TMP_PREFIX}abc123.so"
    stale.write_bytes(b"half a library")
    now = time.time()
    old = []
    for i in range(native.KEEP_BUILDS + 3):
        p = cache / f"liblintrans-{i:016x}.so"
        p.write_bytes(b"an old build")
        os.utime(p, (now - 1000 * (i + 1), now - 1000 * (i + 1)))  # i = 0 the most recent
        old.append(p)
    built = native.build()
    assert built.exists() and not stale.exists()
    kept = sorted(p for p in cache.glob("liblintrans-*.so") if p != built)
    assert kept == sorted(old[:native.KEEP_BUILDS])


@needs_native
@pytest.mark.parametrize("op", ["chunked", "aft", "sliding_window"])
def test_an_allocation_failure_inside_a_kernel_is_a_memory_error(op):
    lib = native.library()
    q, k, v = (torch.randn(1, 70, 2, 8, requires_grad=True) for _ in range(3))
    run = {"chunked": lambda: linear_attention(q, k, v, chunk_size=16)[0],
           "aft": lambda: aft(q, k, v, variant="simple"),
           "sliding_window": lambda: sliding_window_attention(q, k, v, window=9)}[op]
    want = run()
    try:
        lib.lt_debug_fail_allocations(1)
        with pytest.raises(MemoryError, match="out of memory"):
            run()
        lib.lt_debug_fail_allocations(0)
        o = run()  # the failure left nothing behind
        torch.testing.assert_close(o, want, rtol=0, atol=0)
        grad_want = torch.autograd.grad(o.square().sum(), (q, k, v))
        o = run()
        lib.lt_debug_fail_allocations(1)  # backward's region fails now
        with pytest.raises(MemoryError):
            torch.autograd.grad(o.square().sum(), (q, k, v))
        lib.lt_debug_fail_allocations(0)
        for a, b in zip(torch.autograd.grad(run().square().sum(), (q, k, v)), grad_want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        lib.lt_debug_fail_allocations(0)


@needs_native
def test_struct_layouts_are_checked_against_the_c_side():
    lib = native.library()
    for struct in (native_chunked.ChunkedArgs, native_aft.AftArgs, native_sw.SlidingWindowArgs):
        binding.check_layout(lib, struct)  # the real ones match

    class ChunkedArgs(ctypes.Structure):  # a field short of the C struct
        _fields_ = native_chunked.ChunkedArgs._fields_[:-1]

    with pytest.raises(native.LayoutError, match="ChunkedArgs is .* bytes in the C\\+\\+ source but"):
        binding.check_layout(lib, ChunkedArgs)

    class NoSuchArgs(ctypes.Structure):
        _fields_ = [("x", ctypes.c_int64)]

    with pytest.raises(native.LayoutError, match="exports no lt_sizeof_NoSuchArgs"):
        binding.check_layout(lib, NoSuchArgs)


@needs_native
def test_the_bindings_check_their_preconditions_with_explicit_raises():
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    S0 = torch.zeros(1, 2, 4, 5)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        native_chunked.forward(q, k, v, None, S0, 0, "elu", True, 1.0, 1e-6)
    with pytest.raises(ValueError, match="q and k must be"):
        native_chunked.forward(q, k[:, :5], v, None, S0, 4, "elu", True, 1.0, 1e-6)
    with pytest.raises(ValueError, match="S0 must be"):
        native_chunked.forward(q, k, v, None, S0[..., :4], 4, "elu", True, 1.0, 1e-6)
    o, den, states, S_end = native_chunked.forward(q, k, v, None, S0, 4, "elu", True, 1.0, 1e-6)
    with pytest.raises(ValueError, match="states must be forward's"):  # chunk 1: 8 chunks, 2 saved states
        native_chunked.backward(q, k, v, None, o, den, states, torch.ones_like(o), S_end, 1, "elu", True, 1.0, 1e-6,
                                False)
    with pytest.raises(ValueError, match="ckpt must be forward's"):
        native_aft.backward(q, k, v, torch.zeros(1, 3, 64), torch.ones_like(q))
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        native_sw.forward(q, k, v, 0, 1.0)
    # the same under python -O, which strips assert statements
    code = ("import torch; from lintrans.ops.native import aft as a\n"
            "q = torch.randn(1, 8, 2, 4)\n"
            "try:\n    a.backward(q, q, q, torch.zeros(1, 3, 64), q)\nexcept ValueError as e:\n    print('raised', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.startswith("raised ckpt must be forward's"), out.stderr
