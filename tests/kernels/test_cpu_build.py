"""kernels.cpu_build: the shared g++ build of our C++ kernels (cache, errors, loading)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from collections.abc import Iterator

import pytest

from kernels import cpu_build
from kernels.cpu_build import CppKernel, KernelBuildError, KernelLibrary

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")

SOURCE = 'extern "C" int conveyor_answer(int x) { return 2 * x + 0; }\n'


@pytest.fixture
def kernel(tmp_path, monkeypatch) -> CppKernel:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "answer.cpp"
    src.write_text(SOURCE)
    return CppKernel("answer", src, ("-O2", "-fPIC", "-fopenmp"))


def _setup(lib: ctypes.CDLL) -> None:
    lib.conveyor_answer.argtypes = [ctypes.c_int]
    lib.conveyor_answer.restype = ctypes.c_int


@needs_gxx
def test_build_is_cached(kernel, tmp_path) -> None:
    first = cpu_build.build(kernel, "g++")
    assert first.parent == tmp_path / "cache" / "kernels" and first.exists()
    assert first.name.startswith("answer-") and first.suffix == ".so"
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build(kernel, "g++") == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp file left
    assert first.stat().st_mode & 0o777 == 0o644  # others sharing the cache can load it


@needs_gxx
def test_a_quoted_header_is_part_of_the_build_key(tmp_path, monkeypatch) -> None:
    # kernels/csrc/half.h is shared by three sources: editing it must rebuild them all
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "two.h").write_text("constexpr int kTwo = 2;\n")
    src = tmp_path / "answer.cpp"
    src.write_text('#include "two.h"\n' + SOURCE.replace("2 * x", "kTwo * x"))
    kernel = CppKernel("answer", src, ("-O2", "-fPIC", "-fopenmp"))
    first = cpu_build.build(kernel, "g++")
    (tmp_path / "two.h").write_text("constexpr int kTwo = 3;\n")
    second = cpu_build.build(kernel, "g++")
    assert second != first and second.exists()
    lib = ctypes.CDLL(str(second))
    _setup(lib)
    assert lib.conveyor_answer(5) == 15
    (tmp_path / "two.h").unlink()
    with pytest.raises(KernelBuildError, match="cannot read"):
        cpu_build.build(kernel, "g++")


@needs_gxx
def test_other_flags_are_another_build(kernel) -> None:
    a = cpu_build.build(kernel, "g++")
    b = cpu_build.build(CppKernel("answer", kernel.source, ("-O1", "-fPIC")), "g++")
    assert a != b and a.exists() and b.exists()


@needs_gxx
def test_cxx_may_carry_a_wrapper_or_arguments(kernel) -> None:
    assert cpu_build.build(kernel, "env g++").exists()  # e.g. CXX="ccache g++"


def test_missing_compiler_is_a_build_error(kernel) -> None:
    with pytest.raises(KernelBuildError, match="not found"):
        cpu_build.build(kernel, "no-such-c++-compiler")


@needs_gxx
def test_unwritable_cache_dir_is_a_build_error(kernel, tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(blocker))  # kernels/ cannot be made under it
    with pytest.raises(KernelBuildError, match="CONVEYOR_CACHE_DIR"):
        cpu_build.build(kernel, "g++")


@needs_gxx
def test_compile_error_is_a_build_error(kernel, tmp_path) -> None:
    kernel.source.write_text('extern "C" int conveyor_answer( {\n')
    with pytest.raises(KernelBuildError, match="failed"):
        cpu_build.build(kernel, "g++")
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []  # nothing half-written kept


@needs_gxx
def test_library_loads_once_and_remembers_failure(kernel, tmp_path) -> None:
    lib = KernelLibrary(kernel, _setup)
    assert lib.problem() is None
    assert lib.load() is lib.load() and lib.load().conveyor_answer(21) == 42
    broken = KernelLibrary(CppKernel("broken", tmp_path / "missing.cpp", ("-fPIC",)), _setup)
    assert "cannot read" in (broken.problem() or "")
    with pytest.raises(KernelBuildError, match="cannot read"):
        broken.load()


def test_a_build_needing_absent_cpu_features_does_not_run(kernel) -> None:
    impossible = CppKernel("answer", kernel.source, ("-fPIC",),
                           requires=frozenset({"no_such_cpu_feature"}))
    assert not impossible.runs_here()
    lib = KernelLibrary(impossible, _setup)
    with pytest.raises(KernelBuildError, match="no_such_cpu_feature"):
        lib.load()


def test_cpu_flags_read_from_cpuinfo() -> None:
    flags = cpu_build.cpu_flags()
    assert isinstance(flags, frozenset)
    import platform
    if platform.machine() == "x86_64" and flags:
        assert "sse2" in flags  # every x86-64 CPU


def test_a_remembered_failure_keeps_no_caller_alive(kernel) -> None:
    # Re-raising one stored exception grew its traceback by every caller's frames, which
    # kept each caller's locals (whole model runners) alive: 24 GB into the test suite.
    import gc
    import weakref

    lib = KernelLibrary(CppKernel("absent", kernel.source, kernel.cxx_flags,
                                  frozenset({"no-such-cpu-flag"})), _setup)

    class Owner:
        pass

    def caller(owner: Owner) -> None:
        with pytest.raises(KernelBuildError, match="no-such-cpu-flag"):
            lib.load()

    refs = []
    for _ in range(3):
        owner = Owner()
        refs.append(weakref.ref(owner))
        caller(owner)
        del owner
    gc.collect()
    assert all(r() is None for r in refs)
    assert lib.problem() is not None


@contextlib.contextmanager
def uncapped_env() -> Iterator[None]:
    """The cap variables unset inside (the tests set them by hand), restored after. Not
    monkeypatch: cpu_flags() is cached per process, and the cache must be cleared after the
    variables are back (the suite may run capped)."""
    saved = {v: os.environ.pop(v, None) for v in ("ATEN_CPU_CAPABILITY", *cpu_build.ONEDNN_CAP_VARS)}
    cpu_build.cpu_flags.cache_clear()
    try:
        yield
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None)
            if value is not None:
                os.environ[var] = value
        cpu_build.cpu_flags.cache_clear()


HAS_AVX512 = ('extern "C" int conveyor_avx512() {\n#ifdef __AVX512F__\n  return 1;\n'
              '#else\n  return 0;\n#endif\n}\n')


@needs_gxx
def test_an_avx2_cap_hides_the_flags_above_it_and_builds_without_them(tmp_path,
                                                                      monkeypatch) -> None:
    # ATEN_CPU_CAPABILITY=avx2 runs the AVX2 code paths on a newer CPU (README: Tests)
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "isa.cpp"
    src.write_text(HAS_AVX512)
    native = CppKernel("isa", src, ("-O2", "-march=native", "-fPIC"))
    wide = CppKernel("isa512", src, ("-O2", "-mavx512f", "-fPIC"),
                     requires=frozenset({"avx512f"}))

    def avx512_in(kernel: CppKernel) -> int:
        lib = ctypes.CDLL(str(cpu_build.build(kernel, "g++")))
        return lib.conveyor_avx512()

    with uncapped_env():
        real = cpu_build.cpu_flags()
        assert cpu_build.isa_cap() is None and cpu_build.cap_flags(native) == ()
        assert avx512_in(native) == int("avx512f" in real)  # -march=native: what the CPU has
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
        cpu_build.cpu_flags.cache_clear()
        capped = cpu_build.cpu_flags()
        assert cpu_build.isa_cap() == "avx2"
        assert capped == {f for f in real if not f.startswith(("avx512", "amx", "avx_vnni"))}
        assert "-mno-avx512f" in cpu_build.cap_flags(native)
        assert cpu_build.cap_flags(wide) == () and not wide.runs_here()
        assert avx512_in(native) == 0  # another build (its own key), without AVX-512


HAS_VNNI = ('extern "C" int conveyor_vnni() {\n#if defined(__AVX512VNNI__)\n  return 1;\n'
            '#elif defined(CONVEYOR_ISA_CAP_AVX512_CORE)\n  return -1;\n#else\n  return 0;\n'
            '#endif\n}\n')


@needs_gxx
def test_an_avx512_core_cap_hides_vnni_bf16_and_amx_and_builds_without_them(
        tmp_path, monkeypatch) -> None:
    # ONEDNN_MAX_CPU_ISA=AVX512_CORE runs an AVX-512 CPU's code paths without VNNI, as on a
    # Skylake-SP (README: Tests)
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "vnni.cpp"
    src.write_text(HAS_VNNI)
    native = CppKernel("vnni", src, ("-O2", "-march=native", "-fPIC"))
    core = CppKernel("core", src, ("-O2", "-mavx512f", "-fPIC"),
                     requires=frozenset({"avx512f", "avx512bw"}))
    vnni = CppKernel("vnni512", src, ("-O2", "-mavx512f", "-mavx512vnni", "-fPIC"),
                     requires=frozenset({"avx512f", "avx512_vnni"}))

    def vnni_in(kernel: CppKernel) -> int:
        return ctypes.CDLL(str(cpu_build.build(kernel, "g++"))).conveyor_vnni()

    with uncapped_env():
        real = cpu_build.cpu_flags()
        assert cpu_build.isa_cap() is None
        assert vnni_in(native) == int("avx512_vnni" in real)
        for var in cpu_build.ONEDNN_CAP_VARS:  # either spelling, any case
            os.environ[var] = "avx512_core"
            cpu_build.cpu_flags.cache_clear()
            assert cpu_build.isa_cap() == "avx512"
            os.environ.pop(var)
        os.environ["DNNL_MAX_CPU_ISA"] = "AVX512_CORE"
        cpu_build.cpu_flags.cache_clear()
        capped = cpu_build.cpu_flags()
        kept = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
        assert capped == {f for f in real if not (f.startswith(("amx", "avx_vnni")) or
                                                 (f.startswith("avx512") and f not in kept))}
        assert {"avx2", "fma"} & real <= capped
        assert "-mno-avx512vnni" in cpu_build.cap_flags(native)
        assert "-DCONVEYOR_ISA_CAP_AVX512_CORE" in cpu_build.cap_flags(core)
        assert cpu_build.cap_flags(vnni) == () and not vnni.runs_here()
        assert vnni_in(native) == -1  # another build (its own key): no VNNI, the cap defined
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"  # the lower cap wins
        cpu_build.cpu_flags.cache_clear()
        assert cpu_build.isa_cap() == "avx2"
        assert not any(f.startswith("avx512") for f in cpu_build.cpu_flags())
