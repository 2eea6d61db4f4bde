"""The long-prompt prefill benchmark (service.bench.long_prefill) on the real model: one
prompt in the default's chunks, every chunk's step split into attention and linear layers,
each variant's prefill attention as named. Figures are not checked (no timing in tests)."""

from __future__ import annotations

import pytest

from kernels import prefill_attention_cpu as pac
from service.bench.long_prefill import run

pytestmark = pytest.mark.model


def test_chunks_and_shares_of_each_variant(served_model) -> None:
    variants = ["cpp", "sdpa"] + (["cpp-bf16"] if pac.bf16_dot_available() else [])
    report = run(["--prompt-len", "1100", "--rounds", "1", "--variants", ",".join(variants)],
                 loaded=served_model)
    for v in variants:
        r = report["results"][v]
        assert r["prefill_attention"] == v
        assert [(c["tokens"], c["context"]) for c in r["chunks"]] == [(512, 512), (512, 1024),
                                                                      (76, 1100)]
        for c in r["chunks"]:
            assert 0 < c["attention_ms"] and 0 < c["linear_ms"]
            assert c["attention_ms"] + c["linear_ms"] <= c["step_ms"]
            assert 0 < c["attention_share"] < 1
    with pytest.raises(ValueError, match="--variants"):
        run(["--variants", "flash"], loaded=served_model)
