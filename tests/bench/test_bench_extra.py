"""`conveyor bench` without the bench extra says how to install it instead of a traceback."""

from __future__ import annotations

import importlib.util

from service import cli


def test_bench_without_the_extra_tells_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["bench", "--workload", "uniform"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[bench]'" in err and "matplotlib" in err


def test_the_server_runtime_does_not_import_the_bench_packages():
    import subprocess
    import sys

    code = ("import sys, service.front.server, service.engine.engine, service.cli; "
            "print(sorted(m for m in ('matplotlib', 'tqdm.std', 'service.bench.cli') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
