"""The structured-output benchmark (service.bench.structured_itl) against a real server of
the default model: both variants run, every stream streams, the free streams' ITL is
reported for each and the constrained ones are counted. Figures are not checked (no timing
in tests)."""

from __future__ import annotations

import json

import pytest

from service.bench.structured_itl import main

pytestmark = pytest.mark.model


def test_both_variants_run_and_are_reported(tmp_path, capsys) -> None:
    out = tmp_path / "itl.json"
    rc = main(["--streams", "3", "--constrained", "1", "--max-tokens", "12", "--rounds", "1",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    result = doc["result"]
    assert result["errors"] == [] and result["constrained_streams"] == 1
    assert all(v is not None and v > 0 for v in result["free_streams_itl_p50_ms"].values())
    assert result["ratio_mixed_over_free"] > 0
    assert result["constrained_valid"] == result["constrained_closed"]
    for variant, constrained in (("mixed", 1), ("free", 0)):
        (streams,) = doc["runs"][variant]
        assert len(streams) == 3 and sum(s["constrained"] for s in streams) == constrained
        assert all(s["tokens"] >= 2 for s in streams)
    assert all(s["tokens"] == 12 for s in doc["runs"]["free"][0])  # ignore_eos: exactly


def test_bad_counts_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--streams", "2", "--constrained", "2"])
