"""The llama-server peer against the real binary, when one was built
(scripts/build_llama_server, or $CONVEYOR_LLAMA_SERVER): a fresh server on the default
SmolLM2 GGUF, the bench's own client, the same token ids as the other peers; and the
one-request check scripts/build_llama_server makes of what it built. llama.cpp is a
benchmark peer only: without the binary these tests are skipped."""

from __future__ import annotations

import pytest

from service.bench.llama_build import check_server
from service.bench.llama_peer import LlamaPeerOptions, run_llama_peer
from service.bench.llama_server import find_llama_server
from service.bench.plan import LoadPlan
from service.bench.workloads import build_workload

BINARY = find_llama_server()

pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no llama-server binary: scripts/build_llama_server builds one "
                           "from source into build/llama.cpp/bin (or set CONVEYOR_LLAMA_SERVER)")


def test_real_llama_server_streams_exactly_the_tokens_asked_for(bench_tokenizer) -> None:
    specs = build_workload("medium", bench_tokenizer, num_requests=3, seed=5, scale=0.1)
    plan = LoadPlan(tuple(specs), (0.0, 0.0, 0.05), max_concurrency=2, warmup=1, timeout_s=120)
    run = run_llama_peer(plan, LlamaPeerOptions(binary=str(BINARY), threads=1,
                                                start_timeout_s=120),
                         max_num_seqs=8, progress=False)
    m = run.compute(None)
    assert m.failed == 0, [r.error for r in run.records]
    for rec, spec in zip(run.records, specs):
        assert rec.output_tokens == spec.max_tokens == rec.completion_tokens
        assert rec.prompt_tokens == spec.input_len  # the same token ids reached the model
        assert rec.finish_reason == "length" and rec.ttft_ms > 0
    t = run.target
    assert t["weight_type"] == "MOSTLY_Q4_1" and t["n_parallel"] == 2
    assert "-np" in t["argv"] and run.kind == "llama-server"


def test_the_build_check_passes_the_real_binary() -> None:
    from service.worker.loader import default_model_path

    result = check_server(BINARY, default_model_path(), threads=1)
    assert result.ok and result.returncode is None, result.detail
    assert result.detail.startswith("served a 4-token completion")
