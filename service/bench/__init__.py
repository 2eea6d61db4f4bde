"""`conveyor bench`: a load generator speaking PROTOCOL.md, with latency reports,
engine-option comparisons and in-process peers; the soak harness; the engine-only,
int8-accuracy and scheduler-overhead benchmarks (issue #6).

Entry point: `service.bench.cli.main(argv) -> int` (also `scripts/bench`). Not part of
the server's runtime: its progress bars and plots need the `bench` extra
(`pip install -e '.[bench]'`, which scripts/_setup.sh installs).
"""

from __future__ import annotations

import importlib.util

BENCH_EXTRA = ("tqdm", "matplotlib")


def missing_extra() -> str | None:
    """Why `conveyor bench` cannot run here (the bench extra is not installed), or None."""
    missing = [m for m in BENCH_EXTRA if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"conveyor bench needs the bench extra ({', '.join(missing)} missing): "
            "pip install -e '.[bench]' (scripts/bench installs it)")
