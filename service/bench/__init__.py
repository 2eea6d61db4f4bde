"""`conveyor bench`: a load generator speaking PROTOCOL.md, with latency reports,
engine-option comparisons and in-process transformers peers (issue #6).

Entry point: `service.bench.cli.main(argv) -> int` (also `scripts/bench`).
"""
