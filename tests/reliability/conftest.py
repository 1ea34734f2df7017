"""Reliability fixtures: a live server with a small queue limit, on the tiny random llama (``tiny_llama_dir``,
tests/conftest.py): these tests load the server and its lane, not the model."""

from __future__ import annotations

import pytest

from tests.fixtures.tiny_models import MECHANICS_FLAGS
from tests.serverproc import ServerProc


@pytest.fixture(scope="session")
def default_model_dir():
    from models import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def rserver(tiny_llama_dir):
    srv = ServerProc("--model", str(tiny_llama_dir), *MECHANICS_FLAGS, "--cache-bytes", "256M", "--max-queue", "128",
                     "--max-body-bytes", "1M")
    yield srv
    code = srv.stop()
    assert code == 0, f"exit {code}:\n{srv.log()}"


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")
