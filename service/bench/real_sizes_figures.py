"""The figures of `scripts/bench --real-sizes`, their ratios and the printed table (pure).

One row per (file, server), each from one fresh server process:

    load s        process start -> GET /health answers 200
    ITL p50 ms    one user: the median gap between streamed tokens of a few sequential
                  requests
    1-user tok/s  one user: output tokens / the run's duration (sequential requests,
                  prefill and the gaps between requests included)
    N-conc tok/s  every request of the concurrent phase at once: output tokens / duration
    TTFT Nt ms    one long prompt never sent before (no prefix-cache hit), time to its
                  first token
    VmHWM MiB     the server process's peak resident set over the whole run, read from
                  /proc/PID/status just before it is stopped; it counts file-backed pages
                  mapped in (a memory-mapped GGUF) as well as anonymous memory

and per file one ratio row, Conveyor / llama-server (above 1 is better for tok/s, worse
for the times and the memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

# (key, column head, digits after the point); heads name the phases' sizes
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("load_s", "load s", 2),
    ("itl_p50_ms", "ITL p50 ms", 2),
    ("one_user_tok_s", "1-user tok/s", 1),
    ("concurrent_tok_s", "{concurrent}-conc tok/s", 1),
    ("long_ttft_ms", "TTFT {long}t ms", 1),
    ("vmhwm_mib", "VmHWM MiB", 1),
)


@dataclass(frozen=True)
class Figures:
    """One (file, server) row; a figure is None when it was not measured (the server
    failed before that phase, or every request of it failed)."""

    load_s: float | None = None
    itl_p50_ms: float | None = None
    one_user_tok_s: float | None = None
    concurrent_tok_s: float | None = None
    long_ttft_ms: float | None = None
    vmhwm_mib: float | None = None

    def to_json(self) -> dict[str, float | None]:
        return asdict(self)


@dataclass(frozen=True)
class Row:
    """file: its name; server: "conveyor" or "llama-server"; failure: None, or what went
    wrong (the row is then marked FAILED and its missing figures say so)."""

    file: str
    server: str
    figures: Figures
    failure: str | None = None


def parse_vmhwm(status: str) -> int:
    """Bytes of the `VmHWM:` line of a /proc/PID/status text (the kernel writes kB,
    meaning KiB). E.g. "VmHWM:\\t  123456 kB" -> 126418944.

    Raises ValueError when the line is missing or malformed (e.g. a kernel thread).
    """
    for line in status.splitlines():
        key, sep, value = line.partition(":")
        if sep and key == "VmHWM":
            parts = value.split()
            if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
                raise ValueError(f"malformed VmHWM line {line!r}")
            return int(parts[0]) * 1024
    raise ValueError("no VmHWM line in the status text")


def ratios(conveyor: Figures, llama: Figures) -> dict[str, float | None]:
    """Conveyor / llama-server per figure; None where either is missing or llama's is 0."""
    out: dict[str, float | None] = {}
    for key, _, _ in COLUMNS:
        a, b = getattr(conveyor, key), getattr(llama, key)
        out[key] = None if a is None or not b else a / b
    return out


def file_ratios(rows: Sequence[Row]) -> dict[str, dict[str, float | None]]:
    """{file: ratios} for every file that has both a conveyor and a llama-server row."""
    by = {(r.file, r.server): r.figures for r in rows}
    files = dict.fromkeys(r.file for r in rows)
    return {f: ratios(by[f, "conveyor"], by[f, "llama-server"]) for f in files
            if (f, "conveyor") in by and (f, "llama-server") in by}


def _cell(value: float | None, digits: int, failed: bool) -> str:
    if value is None:
        return "FAILED" if failed else "-"
    return f"{value:.{digits}f}"


def format_table(rows: Sequence[Row], *, concurrent: int = 8, long_prompt: int = 2000) -> str:
    """The text table: a row per (file, server) in the given order, a ratio row
    ("x conveyor/llama") after each file's rows, and a line per failure. `concurrent`
    and `long_prompt` name the phases' sizes in the heads ("8-conc tok/s", "TTFT 2000t ms").

    E.g.
        file             server          load s  ITL p50 ms ...
        smol.gguf        conveyor          3.10       12.00 ...
        smol.gguf        llama-server      0.40        6.00 ...
        smol.gguf        conveyor/llama   x7.75       x2.00 ...
    """
    ratio_of = file_ratios(rows)
    heads = [head.format(concurrent=concurrent, long=long_prompt) for _, head, _ in COLUMNS]
    name_w = max(16, *(len(r.file) + 2 for r in rows)) if rows else 16
    width = max(len(head) for head in heads) + 2
    lines = [f"{'file':<{name_w}}{'server':<16}" + "".join(head.rjust(width) for head in heads)]
    for i, row in enumerate(rows):
        lines.append(f"{row.file:<{name_w}}{row.server + (' FAILED' if row.failure else ''):<16}"
                     + "".join(_cell(getattr(row.figures, k), d, bool(row.failure)).rjust(width)
                               for k, _, d in COLUMNS))
        last_of_file = i + 1 == len(rows) or rows[i + 1].file != row.file
        if last_of_file and row.file in ratio_of:
            r = ratio_of[row.file]
            lines.append(f"{row.file:<{name_w}}{'conveyor/llama':<16}"
                         + "".join(("-" if r[k] is None else f"x{r[k]:.2f}").rjust(width)
                                   for k, _, _ in COLUMNS))
    for row in rows:
        if row.failure:
            lines.append(f"{row.file} {row.server} FAILED: {row.failure}")
    return "\n".join(lines)
