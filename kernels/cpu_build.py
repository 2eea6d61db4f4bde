"""Build and load our small C++ CPU kernels: g++ on first use, cached per machine, ctypes.

Every C++ kernel of ours (``kernels/csrc/*.cpp``) goes through here. A build is
compiled with the system C++ compiler (``$CXX``, default ``g++``; a wrapper or
arguments such as ``ccache g++`` are fine) into ``$CONVEYOR_CACHE_DIR/kernels``
(default ``$XDG_CACHE_HOME/conveyor/kernels``, i.e. ``~/.cache/conveyor/kernels``)
under a name hashed from the source and the headers it includes with quotes, the flags,
the compiler's version and the CPU's flags, and loaded with ctypes (no torch headers: a
build takes seconds).
Libraries link ``-fopenmp``: the ``libgomp.so.1`` torch has already loaded has the
same soname, so torch and the kernels share one OpenMP thread pool.

One source may be built several times with different flags (e.g. an AVX2 and an
AVX-512 variant, each with explicit ``-m`` flags), each a ``CppKernel`` of its own.
``ATEN_CPU_CAPABILITY=avx2`` caps the builds and the flags they are chosen by as an AVX2
CPU's, ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` as an AVX-512 CPU's without VNNI (``isa_cap``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LINK_FLAGS = ("-shared", "-fopenmp")


class KernelBuildError(RuntimeError):
    """A C++ kernel could not be compiled or loaded (no compiler, a compile error, ...)."""


def cache_dir() -> Path:
    """Where builds (and measured kernel choices) are cached: $CONVEYOR_CACHE_DIR/kernels."""
    root = os.environ.get("CONVEYOR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "conveyor")
    return Path(root) / "kernels"


CAP_VAR = "ATEN_CPU_CAPABILITY"
"""torch's own cap on its vector kernels; ``avx2`` there caps our builds too (``isa_cap``)."""
ONEDNN_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's cap (two spellings); ``AVX512_CORE`` there caps our builds too (``isa_cap``)."""
_AVX512_CORE = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
# The flags a cap adds (GCC 11 knows them all; -mno-avx512fp16 would need GCC 12, and only
# _Float16 arithmetic, which our kernels do without F16C alone, could emit AVX512-FP16).
_CAP_FLAGS = {
    "avx2": ("-mno-avx512f", "-mno-amx-tile", "-mno-avxvnni"),
    "avx512": ("-mno-avx512vnni", "-mno-avx512bf16", "-mno-avx512vbmi", "-mno-avx512vbmi2",
               "-mno-avx512ifma", "-mno-avx512bitalg", "-mno-avx512vpopcntdq",
               "-mno-amx-tile", "-mno-avxvnni", "-DCONVEYOR_ISA_CAP_AVX512_CORE"),
}


def isa_cap() -> str | None:
    """The CPU class the environment asks to run as, or None (the CPU as it is):

    - "avx2": an AVX2-only CPU (``ATEN_CPU_CAPABILITY=avx2``, as torch reads it);
    - "avx512": an AVX-512 CPU without VNNI, BF16 or AMX, i.e. Skylake-SP's AVX-512 F, CD,
      BW, DQ and VL alone (``ONEDNN_MAX_CPU_ISA`` or ``DNNL_MAX_CPU_ISA`` = ``AVX512_CORE``,
      oneDNN's name for that class), when there is no avx2 cap.

    Under a cap ``cpu_flags()`` hides the flags that CPU class lacks (AVX-512, AMX and
    AVX-VNNI for avx2; every AVX-512 extension past F/CD/BW/DQ/VL, AMX and AVX-VNNI for
    avx512), so only the builds such a CPU runs are chosen, and every build whose
    ``requires`` names none of them is compiled with ``cap_flags`` after its own flags
    (``-march=native`` then emits no such code; under avx512 the define
    ``CONVEYOR_ISA_CAP_AVX512_CORE`` also turns off the kernels' run-time VNNI paths). With
    torch's and the other libraries' caps as well (``ONEDNN_MAX_CPU_ISA=AVX2``,
    ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``; for avx512
    ``ATEN_CPU_CAPABILITY=avx512``, ``FBGEMM_ENABLE_INSTRUCTIONS=AVX512``), the whole process
    runs the code paths of the older CPU on a newer one (their speed is still that newer
    core's and bus's). Lower caps ("default", "avx") leave our builds as they are.
    """
    if os.environ.get(CAP_VAR, "").strip().lower() == "avx2":
        return "avx2"
    onednn = next((os.environ[v] for v in ONEDNN_CAP_VARS if os.environ.get(v)), "")
    return "avx512" if onednn.strip().upper() == "AVX512_CORE" else None


def _above_cap(flag: str, cap: str | None) -> bool:
    """Whether a CPU of the class `cap` lacks the CPU flag `flag` (never without a cap)."""
    if cap is None:
        return False
    if flag.startswith(("amx", "avx_vnni")):
        return True
    return flag.startswith("avx512") and (cap == "avx2" or flag not in _AVX512_CORE)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo, e.g. "avx2", "avx512f"); empty when
    unknown. The kernel lists only what the OS enables (no AVX-512 without its XSAVE state).
    Under ``isa_cap()``, without the flags that CPU class lacks. Read once a process."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    cap = isa_cap()
    return frozenset(f for f in flags if not _above_cap(f, cap))


def cap_flags(kernel: CppKernel) -> tuple[str, ...]:
    """The compile flags `isa_cap()` adds to `kernel`'s own (none without a cap, or for a
    build that requires an instruction set above the cap: such a build never runs then)."""
    cap = isa_cap()
    if cap is None or any(_above_cap(r, cap) for r in kernel.requires):
        return ()
    return _CAP_FLAGS[cap]


@dataclass(frozen=True)
class CppKernel:
    """One build of a C++ source.

    name: the library's file stem in the cache (e.g. "quant_linear_cpu-avx2").
    source: the .cpp file. cxx_flags: compile flags (given to the compile step only:
    -ffast-math at link time would add crtfastmath.o, whose constructor sets
    flush-to-zero for the whole process). requires: CPU flags the build needs to run.
    """

    name: str
    source: Path
    cxx_flags: tuple[str, ...]
    requires: frozenset[str] = frozenset()

    def runs_here(self) -> bool:
        """Whether this CPU has every flag in `requires`."""
        return self.requires <= cpu_flags()


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path) -> bytes:
    """The source's bytes followed by those of the headers it includes with quotes
    (``#include "half.h"``, found beside it; one level): what a build's cache key hashes,
    so that editing a shared header rebuilds every kernel that includes it.

    Raises:
        OSError: the source or a quoted header cannot be read.
    """
    text = source.read_bytes()
    parts = [text]
    for name in _LOCAL_INCLUDE.findall(text):
        parts.append((source.parent / name.decode()).read_bytes())
    return b"\0".join(parts)


def build(kernel: CppKernel, cxx: str) -> Path:
    """Compile `kernel` unless a build for this source, flags, compiler and CPU is cached.

    cxx: the compiler command, possibly with a wrapper or arguments ("ccache g++").
    Returns the library's path. Raises KernelBuildError (not found, compile error,
    cache folder not writable).
    """
    words = shlex.split(cxx)
    found = shutil.which(words[0]) if words else None
    if found is None:
        raise KernelBuildError(f"C++ compiler {cxx!r} not found (set CXX or install g++)")
    compiler = [found, *words[1:]]
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e
    try:
        source = source_bytes(kernel.source)
    except OSError as e:
        raise KernelBuildError(f"cannot read {kernel.source}: {e}") from e
    cxx_flags = (*kernel.cxx_flags, *cap_flags(kernel))
    flags = " ".join(cxx_flags) + " | " + " ".join(LINK_FLAGS)
    key = hashlib.sha256(b"\0".join([source, flags.encode(), version.encode(),
                                     " ".join(sorted(cpu_flags())).encode()])).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"{kernel.name}-{key}.so"
    if target.exists():
        return target
    log.info("compiling the C++ kernel %s (once per machine and source; cached in %s)",
             kernel.name, out_dir)
    began = time.monotonic()
    # Build beside the target and rename: concurrent builders (several servers) never
    # load a half-written library.
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(f"cannot write the kernel build to {out_dir} ({e}); "
                               "set CONVEYOR_CACHE_DIR to a writable folder") from e
    obj = tmp[:-3] + ".o"
    try:
        for cmd in ([*compiler, *cxx_flags, "-c", str(kernel.source), "-o", obj],
                    [*compiler, *LINK_FLAGS, obj, "-o", tmp]):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise KernelBuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}): "
                                       f"{proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o644)  # mkstemp made it 0600: let others sharing the cache load it
        os.replace(tmp, target)
        log.info("compiled the C++ kernel %s in %.0f s", kernel.name, time.monotonic() - began)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building {kernel.source.name} failed: {e}") from e
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


class KernelLibrary:
    """A kernel built and loaded once per process, on first use; thread-safe.

    setup: declares the library's functions (argtypes, restype) once it has loaded.
    A failure is remembered: later calls raise it again without rebuilding.
    """

    def __init__(self, kernel: CppKernel, setup: Callable[[ctypes.CDLL], None]) -> None:
        self.kernel = kernel
        self._setup = setup
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._error: KernelBuildError | None = None

    def load(self) -> ctypes.CDLL:
        """Build (once per machine) and load the library.

        Raises:
            KernelBuildError: the CPU lacks a flag the build needs, no compiler, a
                compile error, or the library does not load.
        """
        with self._lock:
            if self._lib is not None:
                return self._lib
            if self._error is not None:
                # a new exception each time: re-raising the stored one would grow its
                # traceback by every caller's frames (and keep them, runners included, alive)
                raise KernelBuildError(str(self._error))
            try:
                if not self.kernel.runs_here():
                    missing = ", ".join(sorted(self.kernel.requires - cpu_flags()))
                    raise KernelBuildError(f"{self.kernel.name} needs CPU features this CPU "
                                           f"lacks: {missing}")
                path = build(self.kernel, os.environ.get("CXX", "g++"))
                lib = ctypes.CDLL(str(path))
                self._setup(lib)
            except KernelBuildError as e:
                self._error = KernelBuildError(str(e))  # no traceback: it would pin frames
                raise
            except (OSError, AttributeError) as e:
                self._error = KernelBuildError(f"loading {self.kernel.name} failed: {e}")
                raise KernelBuildError(str(self._error)) from e
            self._lib = lib
            return lib

    def problem(self) -> str | None:
        """Why the library cannot be built or loaded here, or None when it can (builds it)."""
        try:
            self.load()
        except KernelBuildError as e:
            return str(e)
        return None

    def reset(self, error: KernelBuildError | None = None) -> None:
        """Forget the loaded library (tests), or pretend the build failed with `error`."""
        with self._lock:
            self._lib, self._error = None, error
