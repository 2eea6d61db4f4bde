"""Imports flow one way (protocol <- service.core <- service.worker <- service front <- cli /
bench): the pure core and the wire protocol load with nothing but the standard library and
msgspec, so a subprocess that makes every other import fail can still load them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, pkgutil, sys
ALLOWED = set(sys.stdlib_module_names) | {"msgspec", "service", "protocol"}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ALLOWED:
            raise ImportError(f"blocked import of {name}")
sys.meta_path.insert(0, Blocker())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_core_and_protocol_need_only_msgspec():
    code = """
import pkgutil, importlib
import service, service.core, protocol.messages, protocol.errors, protocol.codec
import service.engine.request_input
for m in pkgutil.iter_modules(service.core.__path__):
    importlib.import_module("service.core." + m.name)
from service.core.engine_core import EngineCore
from service.core.null_runner import NullRunner
from service.core.config import EngineConfig
from service.core.request import Request
from protocol import SamplingParams
core = EngineCore(EngineConfig(), NullRunner())
core.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2)))
while core.has_unfinished():
    core.step()
for banned in ("torch", "websockets", "structlog", "numpy", "transformers"):
    assert banned not in sys.modules, banned
print("ok")
"""
    proc = _run(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("module", ["torch", "websockets"])
def test_the_blocker_really_blocks(module):
    proc = _run(f"import {module}")
    assert proc.returncode != 0 and "blocked import" in proc.stderr
