"""The whole suite's one shared hook: every body and SSE event a test server sends under /v1 is checked against the
published API schemas (tests/recorder.py records them, tests/conformance.py knows the schemas).

Every server the suite starts records (``MLX_LANE_TEST_RECORD``, set here, reaches them through the environment;
tests/seamed_server.py installs the recorder). After each test's call, and again after its teardown, what was
recorded since is checked: a rejection fails that test (an error at its teardown for what its fixtures' teardown
caused), naming the door, the request, the path in the body and the schema's rule. Whatever is left at the end
fails the session. Under pytest-xdist each worker records and checks its own servers; the controller sums their
counts for the summary line.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests import serverproc
from tests.recorder import ENV, Records

_RECORDS = pytest.StashKey[Records]()
_KEPT_LOGS: list[str] = []  # folders of test servers' logs a failing session (or worker) kept

# The suite runs TEST_WORKERS pytest processes on a machine of few cores (CI: 2), each driving its own servers: one
# OpenBLAS thread per process, theirs and the servers' (they inherit this environment). OpenBLAS's idle threads spin:
# on 2 cores four of the slowest files took 114 s instead of 129 s, and half the kernel time. A test or a user that
# sets these keeps its own.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _openblas_for_the_processes_this_one_starts() -> None:
    """OpenBLAS preloaded (models.runtime) for every process this one starts from here on: the pytest-xdist workers
    (started after this import), whose in-process MLX (the unit tests' models, mlx-lm's and mlx-vlm's greedy text in
    the oracles) otherwise runs on the wheel's reference BLAS, as the servers' do not (tests/serverproc.py preloads it
    for them). On 2 cores the unit tests took 41 s less CPU so (347 s -> 306 s), the default model's rotation test
    half its time. A process already running keeps its BLAS: a run without -n sees no change, and neither does a
    user's own LD_PRELOAD, which stays after it."""
    from models.runtime import blas_preload_env, find_openblas

    lib = find_openblas()
    if lib and lib not in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        os.environ.update(blas_preload_env(dict(os.environ), lib))


_openblas_for_the_processes_this_one_starts()

# Test servers start without the warm-up unless they name --warm-up (tests/serverproc.py says why)
serverproc.WARM_UP_UNLESS_NAMED = "off"
# ... and are forked from a process that has done their third-party imports (tests/forkserver.py; ~2 s of CPU a start
# on a 2-core CPU): MLX_LANE_TEST_FORK_SERVER=0 starts each in a fresh interpreter instead, as a user's
serverproc.FORK_SERVER = os.environ.get("MLX_LANE_TEST_FORK_SERVER", "1") != "0"


def pytest_configure(config):
    folder = tempfile.mkdtemp(prefix="mlx-lane-records-")
    os.environ[ENV] = folder
    config.stash[_RECORDS] = Records(folder)


def pytest_unconfigure(config):
    records = config.stash.get(_RECORDS, None)
    if records is not None:
        shutil.rmtree(records.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 4-layer random llama (hidden 128) with the default model's tokenizer and chat template, as an mlx-lm directory
    (tests/fixtures/tiny_models.py): for the tests of the server's mechanics (kill -9, SIGTERM, a full disk, a lost
    GPU, load, a cluster) whose forwards would otherwise be the default model's. On this 2-core CPU the default model
    costs ~0.14 s of CPU a decoded token (its 540 MB of float32 weights are read each step), this one ~0.013 s (mlx-lm's
    generate_step, 64 tokens, 2026-12-07). What the default model itself answers is tested by the rest of the suite."""
    from models import ensure_default_model
    from tests.fixtures.tiny_models import write_shardable_model

    return write_shardable_model(tmp_path_factory.mktemp("tiny-llama") / "llama", ensure_default_model(progress=False))


@pytest.fixture()
def api_records(request) -> Records:
    """The suite's records (for a test that checks its own answers at a point of its choosing)."""
    return request.config.stash[_RECORDS]


def _rejections(config) -> str:
    problems = config.stash[_RECORDS].drain()
    if not problems:
        return ""
    more = f"\n... and {len(problems) - 40} more" if len(problems) > 40 else ""
    return (f"{len(problems)} response(s) rejected by the published API schemas (tests/conformance.py):\n"
            + "\n".join(problems[:40]) + more)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    finally:
        text = _rejections(item.config)
        if text:
            raise AssertionError(text)  # the test's own failure, if any, stays chained as its context


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        text = _rejections(item.config)
        if text:
            raise AssertionError(text)


def pytest_sessionfinish(session, exitstatus):
    records = session.config.stash[_RECORDS]
    text = _rejections(session.config)
    if text:
        records.left += "after the last test: " + text
    _server_logs(session, failed=bool(exitstatus or session.testsfailed or records.left))
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its controller sums and reports (pytest_testnodedown)
        workeroutput["api_schemas"] = {"checked": dict(records.checked), "seconds": records.seconds,
                                       "left": records.left}
    elif records.left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _server_logs(session, failed: bool) -> None:
    """The test servers' logs (tests/serverproc.log_path) go with a passing session; a failing one keeps them and
    says where (a test's own failure message quotes its server's log already)."""
    folder = serverproc.log_dir()
    if folder is None:
        return
    if not failed:
        shutil.rmtree(folder, ignore_errors=True)
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its controller says it (pytest_testnodedown)
        workeroutput["server_logs"] = folder
    else:
        _KEPT_LOGS.append(folder)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker's checks, added to the summary (and its leftovers to the verdict)."""
    if getattr(node, "workeroutput", {}).get("server_logs"):
        _KEPT_LOGS.append(node.workeroutput["server_logs"])
    out = getattr(node, "workeroutput", {}).get("api_schemas")
    if out:
        records = node.config.stash[_RECORDS]
        records.checked.update(out["checked"])
        records.seconds += out["seconds"]
        records.left += out["left"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for folder in _KEPT_LOGS:
        terminalreporter.write_line(f"test servers' logs kept in {folder}")
    records = config.stash.get(_RECORDS, None)
    if records is None or not records.checked:
        return
    counts = ", ".join(f"{door} {n}" for door, n in sorted(records.checked.items()))
    terminalreporter.write_line(f"API schemas: {sum(records.checked.values())} bodies and events checked in "
                                f"{records.seconds:.1f}s ({counts})")
    if records.left:
        terminalreporter.write_line(records.left, red=True)
