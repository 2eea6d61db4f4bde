"""Every kernel compiles to a CUDA binary (sm_80, sm_90) on this machine.

The interpreter runs kernels but does not compile them; this catches what
only the compiler rejects (loop-carried type changes, dot shapes, constexpr
misuse) without a GPU. Triton ships its own ptxas, so no CUDA toolkit is
needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels  # noqa: E402,F401  (loads the submodules)

if "nvidia" not in triton.backends.backends:
    pytest.skip("triton's NVIDIA backend is not installed", allow_module_level=True)


ROOT = Path(__file__).resolve().parents[2]


def _module(name: str):
    return sys.modules[f"kernels.{name}"]  # kernels.<name> the attribute may be a function


def _attention_case(dtype: str, ieee: bool, block_m: int) -> tuple:
    ptrs = {n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    ints = {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr", "work_seq_ptr", "work_tile_ptr")}
    strides = {n: "i32" for n in ("q_tok_stride", "q_head_stride", "out_tok_stride", "out_head_stride",
                                  "cache_block_stride", "cache_row_stride", "cache_head_stride", "block_table_stride")}
    consts = {"GROUP": 3, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_D": 64, "IEEE": ieee}
    signature = {**ptrs, **ints, "scale_log2": "fp32", **strides}
    return "paged_attention", "_paged_attention_kernel", signature, consts


CASES = {
    "attention-fp16-decode": _attention_case("fp16", False, 16),
    "attention-bf16-prefill": _attention_case("bf16", False, 64),
    "attention-fp32-ieee": _attention_case("fp32", True, 16),
    "store_kv": (
        "kv_store", "_store_kv_kernel",
        {"k_ptr": "*fp16", "v_ptr": "*fp16", "k_cache_ptr": "*fp16", "v_cache_ptr": "*fp16", "slot_ptr": "*i64",
         "k_tok_stride": "i32", "k_head_stride": "i32", "v_tok_stride": "i32", "v_head_stride": "i32",
         "num_kv_heads": "i32"},
        {"HEAD_DIM": 64, "BLOCK_H": 4, "BLOCK_D": 64},
    ),
    "rms_norm-fused": (
        "rms_norm", "_rms_norm_kernel",
        {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
         "new_residual_ptr": "*bf16", "x_row_stride": "i32", "residual_row_stride": "i32", "out_row_stride": "i32",
         "new_residual_row_stride": "i32", "hidden": "i32", "eps": "fp32"},
        {"HAS_RESIDUAL": True, "BLOCK": 1024},
    ),
    "rotary": (
        "rotary", "_rotary_kernel",
        {"x_ptr": "*fp16", "out_ptr": "*fp16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "x_tok_stride": "i32",
         "x_head_stride": "i32", "out_tok_stride": "i32", "out_head_stride": "i32", "cos_stride": "i32",
         "sin_stride": "i32", "num_heads": "i32"},
        {"HALF": 32, "BLOCK_H": 16, "BLOCK_HALF": 32},
    ),
    "silu_and_mul": (
        "activation", "_silu_and_mul_kernel",
        {"x_ptr": "*fp16", "out_ptr": "*fp16", "x_row_stride": "i32", "out_row_stride": "i32", "inter": "i32"},
        {"BLOCK": 1024},
    ),
}


ARCHS = (80, 90)


def compile_case(case: str, arch: int) -> str | None:
    """Compile one case; None on success, else the error text. Needs
    TRITON_INTERPRET unset for the whole process (triton decorates its own
    standard library at import time), hence the subprocess below."""
    module, fn_name, signature, consts = CASES[case]
    jitted = triton.jit(getattr(_module(module), fn_name))
    names = list(jitted.arg_names)
    if names != list(signature) + list(consts):
        return f"test table out of date: kernel parameters are {names}"
    full_signature = {**signature, **{name: "constexpr" for name in consts}}
    constexprs = {(names.index(name),): value for name, value in consts.items()}
    try:
        compiled = triton.compile(ASTSource(fn=jitted, signature=full_signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32))
    except Exception as exc:  # reported to the test, which fails with it
        return f"{type(exc).__name__}: {exc}"[-3000:]
    return None if compiled.asm.get("cubin") else "no cubin produced"


@pytest.fixture(scope="module")
def compile_results() -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_compiles_for_cuda(compile_results, case, arch) -> None:
    error = compile_results[f"{case}@sm_{arch}"]
    assert error is None, error


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET")
    print(json.dumps({f"{c}@sm_{a}": compile_case(c, a) for c in sorted(CASES) for a in ARCHS}))
