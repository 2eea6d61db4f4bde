"""scripts/build_llama_server's decision (service.bench.llama_build): the portable cmake
flags from /proc/cpuinfo, the one-request check of a built binary, and the fallback from
a native build that dies (a fake that kills itself with SIGILL) to a portable one. No
compiler runs here: the builder is a fake that hands out fake binaries. The check of a
real built binary is in test_llama_server_real.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from service.bench.llama_build import (Check, Variant, check_server, cpu_flags, install,
                                       keep_build, main, portable_flags)

FAKE = Path(__file__).with_name("fake_llama_server.py")
NATIVE = Variant("native", ("-DGGML_NATIVE=ON",), "cmake-build")
PORTABLE = Variant("portable", ("-DGGML_NATIVE=OFF",), "cmake-portable")
ZEN3 = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 aes sha_ni")
SAPPHIRE_RAPIDS = (ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi "
                   "avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16")


def _flags(cmake: tuple[str, ...]) -> dict[str, str]:
    return dict(f[2:].split("=") for f in cmake)


def _exe(folder: Path, body: str, name: str = "llama-server") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def _serving(folder: Path, die_after: int | None = None) -> Path:
    """A stand-in llama-server (tests/bench/fake_llama_server.py); with die_after it is
    killed by SIGILL at that many POSTs + 1."""
    env = f"FAKE_LLAMA_DIE_AFTER={die_after} " if die_after is not None else ""
    return _exe(folder, f'{env}exec {sys.executable} {FAKE} "$@"')


def test_cpu_flags_come_from_the_flags_line() -> None:
    text = f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {ZEN3}\nbugs\t\t: spectre\n"
    assert cpu_flags(text) == frozenset(ZEN3.split())
    assert cpu_flags("processor : 0\n") == frozenset()


def test_portable_flags_name_what_the_cpu_has_and_switch_amx_off() -> None:
    zen3 = _flags(portable_flags(frozenset(ZEN3.split()), "x86_64"))
    assert zen3["GGML_NATIVE"] == "OFF"
    assert all(zen3[k] == "ON" for k in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX",
                                         "GGML_SSE42", "GGML_BMI2"))
    assert all(zen3[k] == "OFF" for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_VBMI",
                                          "GGML_AVX512_BF16", "GGML_AVX_VNNI", "GGML_AMX_TILE",
                                          "GGML_AMX_INT8", "GGML_AMX_BF16"))
    spr = _flags(portable_flags(frozenset(SAPPHIRE_RAPIDS.split()), "x86_64"))
    assert all(spr[k] == "ON" for k in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512",
                                        "GGML_AVX512_VNNI", "GGML_AVX512_VBMI",
                                        "GGML_AVX512_BF16"))
    assert all(spr[k] == "OFF" for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    # AVX-512F alone (no BW/VL, e.g. Knights Landing) cannot take -mavx512bw: off
    knl = _flags(portable_flags(frozenset((ZEN3 + " avx512f avx512cd").split()), "x86_64"))
    assert knl["GGML_AVX512"] == "OFF"
    assert portable_flags(frozenset(), "aarch64") == ("-DGGML_NATIVE=OFF",)


def test_check_passes_a_server_that_answers(tmp_path) -> None:
    result = check_server(_serving(tmp_path), "m.gguf", start_timeout_s=30)
    assert result.ok and result.returncode is None, result.detail
    assert "4-token completion" in result.detail


def test_check_names_sigill_at_the_first_request(tmp_path) -> None:
    result = check_server(_serving(tmp_path, die_after=0), "m.gguf", start_timeout_s=30)
    assert not result.ok and result.returncode == -4
    assert result.detail.startswith("died at its first request: killed by signal SIGILL "
                                    "(exit code -4)")


def test_check_names_a_crash_while_starting_and_a_server_that_never_answers(tmp_path) -> None:
    crash = check_server(_exe(tmp_path / "a", "kill -ILL $$"), "m.gguf", start_timeout_s=30)
    assert not crash.ok and crash.returncode == -4 and "SIGILL" in crash.detail
    assert crash.detail.startswith("did not start")
    # healthy, but the completion never comes back
    mute = _exe(tmp_path / "b", f'FAKE_LLAMA_MUTE=1 exec {sys.executable} {FAKE} "$@"')
    result = check_server(mute, "m.gguf", start_timeout_s=30, request_timeout_s=1)
    assert not result.ok and result.returncode is None
    assert result.detail.startswith("no answer to its first request within 1 s")
    missing = check_server(tmp_path / "nope", "m.gguf", start_timeout_s=5)
    assert not missing.ok and "could not be run" in missing.detail


def _builder(tmp_path: Path, binaries: dict[str, int | None | str], built: list[str]):
    """A fake cmake: variant name -> die_after for its stand-in binary (None: it serves;
    "error": the build fails)."""
    from service.bench.llama_build import BuildError

    def build(v: Variant) -> Path:
        built.append(v.name)
        if binaries[v.name] == "error":
            raise BuildError("cmake --build ...: exit status 2")
        folder = tmp_path / v.build_dir / "bin"
        _serving(folder, binaries[v.name])
        _exe(folder, "exit 0", "llama-quantize")
        return folder
    return build


def _check(binary: Path) -> Check:
    return check_server(binary, "m.gguf", start_timeout_s=30)


def test_a_native_build_that_dies_with_sigill_falls_back_to_the_portable_one(tmp_path) -> None:
    built: list[str] = []
    said: list[str] = []
    outcome = keep_build([NATIVE, PORTABLE], _builder(tmp_path, {"native": 0, "portable": None},
                                                      built), _check, said.append)
    assert built == ["native", "portable"]
    assert outcome.kept == "portable" and outcome.bin_dir == tmp_path / "cmake-portable" / "bin"
    native, portable = outcome.attempts
    assert (native.ok, native.returncode, portable.ok) == (False, -4, True)
    assert outcome.reason.startswith("kept the portable build: served a 4-token completion")
    assert ("after the native build failed its check (died at its first request: killed by "
            "signal SIGILL (exit code -4))") in outcome.reason
    assert any("native build FAILED its check" in s for s in said)
    dest = tmp_path / "dest"
    bin_dir = install(outcome, dest, "0.3.36")
    assert (bin_dir / "llama-server").read_text() == (outcome.bin_dir / "llama-server").read_text()
    assert (bin_dir / "llama-quantize").is_file()
    info = json.loads((bin_dir / "BUILD.json").read_text())
    assert info["kept"] == "portable" and info["reason"] == outcome.reason
    assert [a["variant"] for a in info["attempts"]] == ["native", "portable"]
    assert info["attempts"][0]["returncode"] == -4
    assert (bin_dir / "LLAMA_CPP_PYTHON_VERSION").read_text() == "0.3.36\n"


def test_a_native_build_that_serves_is_kept_and_portable_is_never_built(tmp_path) -> None:
    built: list[str] = []
    outcome = keep_build([NATIVE, PORTABLE], _builder(tmp_path, {"native": None, "portable": 0},
                                                      built), _check)
    assert built == ["native"] and outcome.kept == "native"
    assert outcome.reason.startswith("kept the native build: served")
    assert "after" not in outcome.reason


def test_a_failed_build_is_an_attempt_and_no_passing_build_keeps_nothing(tmp_path) -> None:
    built: list[str] = []
    outcome = keep_build([NATIVE, PORTABLE],
                         _builder(tmp_path, {"native": "error", "portable": None}, built), _check)
    assert built == ["native", "portable"] and outcome.kept == "portable"
    assert "build failed: cmake --build" in outcome.attempts[0].detail
    none = keep_build([NATIVE, PORTABLE], _builder(tmp_path / "x", {"native": 0, "portable": 0},
                                                   []), _check)
    assert none.kept is None and none.bin_dir is None
    assert none.reason.startswith("no build passed its check: native: died at its first "
                                  "request: killed by signal SIGILL")
    with pytest.raises(AssertionError):
        install(none, tmp_path / "dest", "0.3.36")


def test_check_only_command_exit_status(tmp_path, capsys) -> None:
    assert main(["--check", str(_serving(tmp_path / "ok")), "--model", "m.gguf"]) == 0
    assert main(["--check", str(_serving(tmp_path / "ill", die_after=0)),
                 "--model", "m.gguf"]) == 1
    err = capsys.readouterr().err
    assert "passed" in err and "FAILED: died at its first request: killed by signal SIGILL" in err
