"""--load: fractions, capacity, arrival rates, goodput at the SLO, the table and the plot,
with fixed inputs (no server)."""

from __future__ import annotations

import pytest

from service.bench.arrivals import arrival_times
from service.bench.cli import main
from service.bench.load_sweep import (DEFAULT_LOAD_SLO, SweepPoint, arrival_rates, bound_share,
                                      capacity, format_sweep, load_label, parse_fractions,
                                      sweep_json)
from service.bench.metrics import Slo, compute_metrics
from service.bench.record import RequestRecord
from service.bench.request_spec import RequestSpec


def _rec(i: int, sent: float, first: float, last: float, tokens: int, done: float | None = None,
         error: str | None = None) -> RequestRecord:
    """A request whose `tokens` tokens arrive evenly from `first` to `last`."""
    step = (last - first) / max(tokens - 1, 1)
    return RequestRecord(index=i, request_id=f"b{i}", input_tokens=8, max_tokens=tokens,
                         scheduled_s=sent, sent_s=sent,
                         done_s=(last if done is None else done) if error is None else None,
                         delta_times_s=[first + k * step for k in range(tokens)],
                         delta_token_counts=[1] * tokens, error=error)


def _sweep_records() -> list[RequestRecord]:
    return [
        _rec(0, 0.0, 0.5, 2.5, 11),      # TTFT 500 ms, TPOT 200 ms: meets both (bounds inclusive)
        _rec(1, 1.0, 3.5, 4.5, 11),      # TTFT 2500 ms: misses TTFT
        _rec(2, 2.0, 2.2, 8.2, 11),      # TPOT 600 ms: misses TPOT
        _rec(3, 3.0, 3.1, 3.1, 1),       # one token: no TPOT, meets TTFT
        _rec(4, 4.0, 4.1, 4.1, 1, error="connection closed"),  # failed: never good
    ]


def test_goodput_by_hand() -> None:
    m = compute_metrics(_sweep_records(), Slo.parse(DEFAULT_LOAD_SLO))
    assert m.duration_s == pytest.approx(8.2)        # t = 0 to the last done
    assert m.goodput_requests_per_s == pytest.approx(2 / 8.2)         # b0 and b3
    assert m.goodput_output_tokens_per_s == pytest.approx(12 / 8.2)   # 11 + 1 tokens
    assert m.slo_attainment == pytest.approx(2 / 5)
    assert m.requests_per_s == pytest.approx(4 / 8.2)
    assert m.output_tokens_per_s == pytest.approx(34 / 8.2)


def test_fractions() -> None:
    assert parse_fractions("0.5,0.7,0.9") == (0.5, 0.7, 0.9)
    assert parse_fractions(" 1.2 ") == (1.2,)
    for bad in ("", "0.5,,0.7", "a", "0", "-0.5", "inf", "nan", "0.5,0.5"):
        with pytest.raises(ValueError, match="--load"):
            parse_fractions(bad)


def test_capacity_and_arrival_rates() -> None:
    closed = compute_metrics([_rec(0, 0.0, 1.0, 2.0, 3), _rec(1, 0.0, 1.0, 4.0, 3)])
    assert capacity(closed) == pytest.approx(0.5)    # 2 requests in 4 s
    assert arrival_rates(0.5, (0.5, 0.7, 0.9)) == pytest.approx([0.25, 0.35, 0.45])
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError):
            arrival_rates(bad, (0.5,))
    broken = compute_metrics([_rec(0, 0.0, 1.0, 2.0, 3), _rec(1, 0.0, 1.0, 2.0, 3, error="x")])
    with pytest.raises(ValueError, match="1 failed of 2"):
        capacity(broken)


def test_poisson_arrivals_at_the_derived_rate_are_seeded_and_have_that_mean() -> None:
    rate = arrival_rates(2.0, (0.5,))[0]             # 1 request/s
    times = arrival_times(4000, rate, 1.0, seed=3)
    assert times == arrival_times(4000, rate, 1.0, seed=3)
    assert times[-1] / (len(times) - 1) == pytest.approx(1.0, rel=0.05)


def test_bound_share() -> None:
    assert bound_share(73.2, 54.0, 1.14) == pytest.approx(73.2 / 54.0 / 1.14)
    assert bound_share(None, 54.0, 1.14) is None and bound_share(73.2, 0.0, 1.1) is None
    assert bound_share(73.2, 54.0, None) is None


def _points() -> list[SweepPoint]:
    slo = Slo.parse(DEFAULT_LOAD_SLO)
    recs = _sweep_records()
    good = compute_metrics(recs[:1], slo)
    mixed = compute_metrics(recs, slo)
    return [SweepPoint("batching=continuous", 0.5, 0.25, good),
            SweepPoint("batching=static", 0.5, 0.25, mixed),
            SweepPoint("batching=continuous", 0.9, 0.45, mixed)]


def test_table_and_json() -> None:
    slo = Slo.parse(DEFAULT_LOAD_SLO)
    points = _points()
    doc = sweep_json(0.5, slo, points, 1.05)
    assert doc["capacity_requests_per_s"] == 0.5 and doc["closed_loop_bound_share"] == 1.05
    assert doc["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 200.0, "e2e_ms": None}
    first = doc["points"][0]
    assert first["label"] == "batching=continuous load=0.5" == load_label("batching=continuous", 0.5)
    assert first["SLO met %"] == pytest.approx(100.0)
    assert doc["points"][1]["goodput req/s"] == pytest.approx(2 / 8.2)
    text = format_sweep(0.5, slo, points, 1.05)
    assert "TTFT <= 2000 ms, TPOT <= 200 ms" in text and "0.5 (0.250/s)" in text
    static_row = next(line for line in text.splitlines()
                      if "batching=static" in line and "SLO met %" in line)
    assert static_row.split()[-2:] == ["40.00", "-"]  # measured at 0.5 only
    assert "105% of the flat-step bound" in text


def test_plot(tmp_path) -> None:
    from service.bench.plots import plot_load_sweep

    path = plot_load_sweep(_points(), Slo.parse(DEFAULT_LOAD_SLO), tmp_path / "load_sweep.png")
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize("argv", [
    ["--load", "0.5,x"],
    ["--load", "0.5", "--request-rate", "2"],
    ["--load", "0.5", "--url", "ws://127.0.0.1:1/v1/stream"],
    ["--load", "0.5", "--compare", "max_num_seqs=4,8"],
    ["--load", "0.5", "--compare", "batching=static,dynamic"],
])
def test_load_argument_errors_exit_2_before_anything_starts(argv, capsys) -> None:
    assert main(argv) == 2
    assert "--load" in capsys.readouterr().err


def test_one_invocation_runs_closed_loop_then_each_mode_at_each_load(tmp_path, monkeypatch,
                                                                    capsys) -> None:
    """The orchestration of --load through cli.main, with each `conveyor serve` run replaced
    by records made up from the plan it was given (no server, no model)."""
    import json

    import service.bench.cli as cli
    from service.bench.run_result import RunResult
    from service.bench.runner import new_records

    monkeypatch.setattr(cli, "load_tokenizer", lambda model: object())
    monkeypatch.setattr(cli, "build_workload",
                        lambda *a, **k: [RequestSpec(i, (1, 2, 3), 4 + i) for i in range(6)])
    calls = []

    def fake_run(a, label, args, plan, slo):
        calls.append((label, args, plan.arrivals))
        recs = new_records(plan)
        for r in recs:  # 0.5 s to the first token, then 10 ms a token
            r.sent_s = r.scheduled_s
            r.delta_times_s = [r.sent_s + 0.5 + 0.01 * k for k in range(r.max_tokens)]
            r.delta_token_counts = [1] * r.max_tokens
            r.done_s = r.delta_times_s[-1]
        if "static" in label:  # static batching misses the TTFT bound
            for r in recs:
                r.delta_times_s = [t + 2.0 for t in r.delta_times_s]
                r.done_s += 2.0
        return cli._finish(RunResult(label, "conveyor", recs, {"serve_args": args}), slo)

    monkeypatch.setattr(cli, "_server_run", fake_run)
    out, figs = tmp_path / "load.json", tmp_path / "figs"
    rc = main(["--load", "0.5,0.9", "--compare", "batching=continuous,static", "--seed", "3",
               "--json", str(out), "--plot", str(figs), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    labels = [c[0] for c in calls]
    assert labels == ["batching=continuous", "batching=static",
                      "batching=continuous load=0.5", "batching=static load=0.5",
                      "batching=continuous load=0.9", "batching=static load=0.9"]
    assert all(t == 0.0 for c in calls[:2] for t in c[2])          # closed loop first
    assert calls[2][2] == calls[3][2] != calls[4][2] == calls[5][2]  # same arrivals per load
    doc = json.loads(out.read_text())
    sweep = doc["load_sweep"]
    closed = doc["runs"][0]["metrics"]
    assert sweep["capacity_requests_per_s"] == pytest.approx(closed["requests_per_s"])
    rates = [p["rate_requests_per_s"] for p in sweep["points"]]
    assert rates == pytest.approx([0.5 * sweep["capacity_requests_per_s"]] * 2
                                  + [0.9 * sweep["capacity_requests_per_s"]] * 2)
    assert sweep["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 200.0, "e2e_ms": None}
    assert [p["SLO met %"] for p in sweep["points"]] == [100.0, 0.0, 100.0, 0.0]
    assert doc["comparison"]["labels"] == ["batching=continuous", "batching=static"]
    assert len(doc["runs"]) == 6 and "load sweep" in text
    share = doc["config"]["batching_bound"]["closed_loop_share"]
    tok = [r["metrics"]["output_tokens_per_s"] for r in doc["runs"][:2]]
    assert share == pytest.approx(tok[0] / tok[1] / doc["config"]["batching_bound"]["ratio"])
    assert sweep["closed_loop_bound_share"] == pytest.approx(share)
    assert "of the flat-step bound's ratio" in text
    assert (figs / "load_sweep.png").is_file()
