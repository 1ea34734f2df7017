"""Integration fixtures: the real default model behind a real uvicorn on a free port."""

from __future__ import annotations

import pytest

from tests.serverproc import ServerProc


@pytest.fixture(scope="session")
def default_model_dir():
    from models import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def server(default_model_dir):
    """One shared server for the read-mostly tests (cache on, small cap)."""
    srv = ServerProc("--model", "default", "--cache-bytes", "512M", "--keepalive", "1", "--embedding-model", "default",
                     "--warm-up", "behind")  # the default (test servers turn it off unless they name it)
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM:\n{srv.log()}"


@pytest.fixture()
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
