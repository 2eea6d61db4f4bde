"""Build llama.cpp's llama-server from source and keep a build that runs on this CPU.

`scripts/build_llama_server` downloads and unpacks the source (the llama-cpp-python
sdist), then runs `python -m service.bench.llama_build --src SRC --dest DEST`, which:

1. builds the *native* variant (`-DGGML_NATIVE=ON`: `-march=native`) in DEST/cmake-build;
2. checks the binary with one real request (`check_server`): started on 127.0.0.1 on a
   free port with the default SmolLM2 GGUF, one greedy completion of a few tokens, then
   stopped. It fails when the server exits (e.g. SIGILL, exit code -4), never becomes
   healthy, or does not answer;
3. when that fails, builds the *portable* variant in DEST/cmake-portable
   (`-DGGML_NATIVE=OFF` and every x86 extension named from /proc/cpuinfo:
   `portable_flags`, AMX off) and checks it the same way;
4. copies the first build that passed into DEST/bin with BUILD.json (the build kept, its
   cmake flags, and each check's result), and says which it kept and why. Exit status 1
   when no build passed (nothing is copied then).

Why: on a Sapphire Rapids VM (AVX-512, AMX) the native build died with SIGILL at its
first request, while one with GGML_NATIVE=OFF, AVX2, FMA, F16C, AVX-512, VNNI, VBMI and
BF16 on and AMX off served (issue 22). The decision (`keep_build`) takes the builder and
the check as functions, so it is tested with fakes.

`python -m service.bench.llama_build --check BINARY` only checks a binary.
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from service.bench.llama_server import LlamaServerProcess
from service.bench.server_process import exit_text

EXES = ("llama-server", "llama-quantize")
NATIVE = ("-DGGML_NATIVE=ON",)
# cmake flags of every variant: CPU only, static, no web UI assets (fetched from a model
# hub otherwise), no HTTPS or curl
COMMON = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
          "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF")
# GGML_* x86 options of ggml/CMakeLists.txt and the /proc/cpuinfo flags each needs: the
# option's compiler flags (ggml-cpu/CMakeLists.txt) must all be instructions this CPU has.
# GGML_AVX512 adds -mavx512f/cd/vl/dq/bw.
X86_OPTIONS = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 4


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: the `flags` line of /proc/cpuinfo (or of the text given),
    e.g. {"avx2", "fma", "f16c", ...}; empty where there is none (not Linux x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def portable_flags(flags: frozenset[str], machine: str | None = None) -> tuple[str, ...]:
    """cmake flags of the portable build: GGML_NATIVE off, each x86 option on exactly when
    the CPU has every instruction it compiles for, AMX off (its tile state needs kernel
    permission that a VM may not grant). E.g. a Zen 3: SSE4.2, AVX, AVX2, FMA, F16C, BMI2
    on, AVX-512 off. On another architecture: GGML_NATIVE off and ggml's own defaults."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "i386"):
        return ("-DGGML_NATIVE=OFF",)
    return ("-DGGML_NATIVE=OFF",
            *(f"-D{name}={'ON' if all(f in flags for f in needs) else 'OFF'}"
              for name, needs in X86_OPTIONS),
            *AMX_OFF)


@dataclass(frozen=True)
class Variant:
    """One way to build: its name, its cmake flags (beyond COMMON), its build folder name."""

    name: str
    cmake_flags: tuple[str, ...]
    build_dir: str


def default_variants(flags: frozenset[str] | None = None) -> tuple[Variant, ...]:
    """native first (the fastest where it runs), then portable. The native folder keeps the
    name the script always used, so a build made before the check existed is reused."""
    return (Variant("native", NATIVE, "cmake-build"),
            Variant("portable", portable_flags(cpu_flags() if flags is None else flags),
                    "cmake-portable"))


@dataclass(frozen=True)
class Check:
    """The result of one real request to a built binary. returncode: the server's, when
    it exited (negative: killed by that signal), else None."""

    ok: bool
    detail: str
    returncode: int | None = None


def check_server(binary: str | Path, model: str | Path, *, threads: int = 1,
                 start_timeout_s: float = 120.0, request_timeout_s: float = 60.0) -> Check:
    """Start `binary` on `model` (one slot, 256 tokens of context, a free port on
    127.0.0.1), send one greedy completion of CHECK_TOKENS tokens, and stop it.

    ok when it answered with at least one token and was still running afterwards. Never
    raises for the server's faults: a crash (with its signal), a start that fails or
    times out, no answer or a wrong answer are a failed Check naming the cause.
    """
    server = LlamaServerProcess(binary, model, n_parallel=1, slot_ctx=256, threads=threads,
                                start_timeout_s=start_timeout_s)
    try:
        try:
            server.start()
        except RuntimeError as e:  # its message has the log's tail
            return Check(False, f"did not start: {str(e).strip()}", server.exited())
        except OSError as e:  # not executable, wrong format
            return Check(False, f"could not be run: {e}")
        t0 = time.perf_counter()
        body = json.dumps({"prompt": CHECK_PROMPT, "max_tokens": CHECK_TOKENS,
                           "temperature": 0.0, "cache_prompt": False}).encode()
        req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=request_timeout_s) as resp:
                reply = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return Check(False, f"answered HTTP {e.code}: {e.read()[:300]!r}", server.exited())
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            rc = server.exited(wait_s=2.0)
            if rc is not None:
                tail = server.log_tail(10).rstrip()
                return Check(False, f"died at its first request: {exit_text(rc)}"
                                    + (f"\n{tail}" if tail else ""), rc)
            return Check(False, f"no answer to its first request within "
                                f"{request_timeout_s:g} s: {type(e).__name__}: {e}")
        took = time.perf_counter() - t0
        rc = server.exited(wait_s=0.2)
        if rc is not None:
            return Check(False, f"answered, then died: {exit_text(rc)}", rc)
        tokens = (reply.get("usage") or {}).get("completion_tokens")
        if not isinstance(tokens, int) or tokens < 1:
            return Check(False, f"answered without tokens: {str(reply)[:300]}")
        text = (reply.get("choices") or [{}])[0].get("text", "")
        return Check(True, f"served a {tokens}-token completion ({text!r}) in {took:.2f} s")
    finally:
        server.close()


class BuildError(RuntimeError):
    """A cmake configure or build step failed."""


@dataclass
class Attempt:
    """One variant tried: its name and flags, and what its build and check gave."""

    variant: str
    cmake_flags: list[str]
    ok: bool
    detail: str
    returncode: int | None = None
    build_s: float | None = None


@dataclass
class Outcome:
    """What `keep_build` decided: the variant kept (None: none passed), its bin folder,
    every attempt in order, and why in one sentence."""

    kept: str | None
    bin_dir: Path | None
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def reason(self) -> str:
        if self.kept is None:
            return "no build passed its check: " + "; ".join(
                f"{a.variant}: {a.detail.splitlines()[0]}" for a in self.attempts)
        last = self.attempts[-1]
        why = "; ".join(f"the {a.variant} build failed its check ({a.detail.splitlines()[0]})"
                        for a in self.attempts[:-1])
        return (f"kept the {self.kept} build: {last.detail}"
                + (f", after {why}" if why else ""))

    def to_json(self) -> dict:
        return {"kept": self.kept, "reason": self.reason,
                "attempts": [asdict(a) for a in self.attempts]}


def keep_build(variants: Sequence[Variant], build: Callable[[Variant], Path],
               check: Callable[[Path], Check],
               say: Callable[[str], None] = lambda _: None) -> Outcome:
    """Build and check each variant in order until one passes; the first that passes is
    kept (later ones are not built). build(variant) returns the folder holding its
    llama-server or raises BuildError; check(binary) gives its Check."""
    outcome = Outcome(None, None)
    for v in variants:
        say(f"building the {v.name} variant ({' '.join(v.cmake_flags)}) ...")
        t0 = time.perf_counter()
        try:
            bin_dir = build(v)
        except BuildError as e:
            outcome.attempts.append(Attempt(v.name, list(v.cmake_flags), False,
                                            f"build failed: {e}"))
            say(f"the {v.name} build failed: {e}")
            continue
        took = round(time.perf_counter() - t0, 1)
        say(f"checking the {v.name} build with one real request ...")
        result = check(bin_dir / "llama-server")
        outcome.attempts.append(Attempt(v.name, list(v.cmake_flags), result.ok, result.detail,
                                        result.returncode, took))
        say(f"the {v.name} build {'passed' if result.ok else 'FAILED'} its check: "
            f"{result.detail}")
        if result.ok:
            outcome.kept, outcome.bin_dir = v.name, bin_dir
            break
    return outcome


def cmake_build(src: Path, dest: Path, variant: Variant, jobs: int) -> Path:
    """Configure and build llama-server and llama-quantize of `variant` (niced) in
    dest/variant.build_dir; returns its bin folder. Raises BuildError."""
    out = dest / variant.build_dir
    steps = (["cmake", "-S", str(src), "-B", str(out), *COMMON, *variant.cmake_flags],
             ["cmake", "--build", str(out), "--config", "Release", "-j", str(jobs),
              "--target", *EXES])
    for argv in steps:
        try:  # cmake's output goes to our stderr: the script's log
            subprocess.run(["nice", "-n", "10", *argv], check=True, stdout=sys.stderr)
        except (subprocess.CalledProcessError, OSError) as e:
            raise BuildError(f"{' '.join(argv[:3])} ...: {e}") from None
    return out / "bin"


def install(outcome: Outcome, dest: Path, version: str) -> Path:
    """Copy the kept build's executables into dest/bin with LLAMA_CPP_PYTHON_VERSION and
    BUILD.json (Outcome.to_json); returns dest/bin."""
    assert outcome.bin_dir is not None, "nothing to install: no build passed"
    bin_dir = dest / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for exe in EXES:
        tmp = bin_dir / f".{exe}.tmp"
        shutil.copy2(outcome.bin_dir / exe, tmp)
        tmp.replace(bin_dir / exe)
    (bin_dir / "LLAMA_CPP_PYTHON_VERSION").write_text(version + "\n")
    (bin_dir / "BUILD.json").write_text(json.dumps(
        {**outcome.to_json(), "llama_cpp_python_version": version,
         "machine": platform.machine()}, indent=1) + "\n")
    return bin_dir


def _say(text: str) -> None:
    print(f"build_llama_server: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.bench.llama_build",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, help="the unpacked llama.cpp source")
    p.add_argument("--dest", type=Path, help="build folder (bin/ is written there)")
    p.add_argument("--version", default="unknown", help="llama-cpp-python version built")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    p.add_argument("--variants", default="native,portable",
                   help="variants to try in order (native, portable)")
    p.add_argument("--model", default=None, help="GGUF for the check (default: the SmolLM2 one)")
    p.add_argument("--threads", type=int, default=2, help="-t of the checked server")
    p.add_argument("--check", type=Path, metavar="BINARY", default=None,
                   help="only check this llama-server binary")
    a = p.parse_args(argv)
    from service.worker.loader import default_model_path

    model = a.model or default_model_path()

    def check(binary: Path) -> Check:
        return check_server(binary, model, threads=a.threads)

    if a.check is not None:
        result = check(a.check)
        _say(f"{a.check}: {'passed' if result.ok else 'FAILED'}: {result.detail}")
        return 0 if result.ok else 1
    if a.src is None or a.dest is None:
        p.error("--src and --dest are needed to build")
    by_name = {v.name: v for v in default_variants()}
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        p.error(f"--variants: one or more of {', '.join(by_name)}, got {a.variants!r}")
    outcome = keep_build([by_name[n] for n in names],
                         lambda v: cmake_build(a.src, a.dest, v, a.jobs), check, _say)
    if outcome.kept is None:
        _say(outcome.reason)
        return 1
    bin_dir = install(outcome, a.dest, a.version)
    _say(outcome.reason)
    _say(f"built from llama-cpp-python {a.version}'s vendored llama.cpp "
         f"({outcome.kept}; {bin_dir / 'BUILD.json'}):")
    for exe in EXES:
        print(bin_dir / exe, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
