"""`python -m tests.seamed_server serve ...`: the real server with test seams, for the tests that must make a failure
happen at a known point. The product has no seams of its own: this launcher puts test-only subclasses in place of
the engine and the SSD store, then runs ``server.cli.main`` as ``mlx-lane`` would. Each seam is read from the
environment of the test that starts the server (tests/serverproc.py uses this launcher when one is set):

    MLX_LANE_TEST_TOKEN_DELAY=<seconds>  the lane pauses after handing over each token, so a test can SIGTERM or
                                         kill the server while streams are surely in flight
    MLX_LANE_TEST_WRITE_DELAY=<seconds>  every SSD write pauses between the temp file's fsync and its rename, so a
                                         test can kill -9 the server while a `*.tmp` exists
    MLX_LANE_TEST_DISK_FULL=<path>       while <path> exists every SSD write fails with ENOSPC, as on a full disk;
                                         delete it and the space is back
    MLX_LANE_TEST_RETRY_BACKOFF=<s,...>  the SSD writer's waits between the attempts of a failing write (the
                                         product's are 0.1, 0.5 and 2 s): as many attempts, without the test
                                         sleeping through 2.6 s of them for every write it makes fail
    MLX_LANE_FAULT_MARKER=<text>         a prompt containing <text> makes its admission raise inside the lane (a
                                         500 for that request; the lane serves on)
    MLX_LANE_DEVICE_LOSS_MARKER=<text>   a prompt containing <text> makes its admission raise the error MLX raised on an
                                         H100 once CUDA's context was poisoned ("... an illegal memory access was
                                         encountered"): the lane's device-loss path (server.lane.device_loss)
    MLX_LANE_OOM_MARKER=<text>           the process's first prefill of a prompt containing <text> raises CUDA's out-of-memory
                                         error (the lane sends the prompt back to its queue: server.lane.device_loss)
    MLX_LANE_TEST_RECORD=<dir>           every response under /v1/ is recorded in <dir> as it leaves, for the
                                         suite's check of each body and event against the published API schemas
                                         (tests/recorder.py; tests/conftest.py sets it for every test server)
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time

SEAMS = ("MLX_LANE_TEST_TOKEN_DELAY", "MLX_LANE_TEST_WRITE_DELAY", "MLX_LANE_TEST_DISK_FULL", "MLX_LANE_FAULT_MARKER",
         "MLX_LANE_DEVICE_LOSS_MARKER", "MLX_LANE_OOM_MARKER", "MLX_LANE_TEST_RECORD", "MLX_LANE_TEST_RETRY_BACKOFF")

log = logging.getLogger("mlx_lane.test_seams")


def wanted(env) -> bool:
    """Does this environment ask for any seam?"""
    return any(env.get(name) for name in SEAMS)


def install(env=os.environ) -> None:
    """Put the seams the environment asks for in place (before ``server.serve.build_state`` runs)."""
    import cache.ssd_store as ssd_store
    import server.engine.engine as engine_module
    from server.lane.events import Delta

    delay = float(env.get("MLX_LANE_TEST_TOKEN_DELAY") or 0)
    marker = env.get("MLX_LANE_FAULT_MARKER")
    lost_marker = env.get("MLX_LANE_DEVICE_LOSS_MARKER")
    oom_marker = env.get("MLX_LANE_OOM_MARKER")
    oom_done: set = set()
    write_delay = float(env.get("MLX_LANE_TEST_WRITE_DELAY") or 0)
    full_flag = env.get("MLX_LANE_TEST_DISK_FULL")
    if env.get("MLX_LANE_TEST_RECORD"):
        _record(env["MLX_LANE_TEST_RECORD"])
    base_engine = engine_module.Engine

    class SeamedEngine(base_engine):
        def admit(self, seq):
            if marker and marker in seq.target.tokenizer.decode(seq.prompt):
                raise RuntimeError("injected fault (MLX_LANE_FAULT_MARKER)")
            if lost_marker and lost_marker in seq.target.tokenizer.decode(seq.prompt):
                raise RuntimeError("cudaMallocManaged(&data, size) failed: an illegal memory access was encountered")
            admitted = super().admit(seq)
            if delay:
                seq.sink = _slowed(seq.sink, delay, Delta)
            return admitted

        def prefill(self, chunks, store_now):
            for seq, _ in chunks:
                if oom_marker and not oom_done and oom_marker in seq.target.tokenizer.decode(seq.prompt):
                    oom_done.add(seq.id)
                    raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
            return super().prefill(chunks, store_now)

    if delay or marker or lost_marker or oom_marker:
        engine_module.Engine = SeamedEngine
        log.warning("test seams: token delay %.2fs, fault marker %r, device-loss marker %r, out-of-memory marker %r",
                    delay, marker, lost_marker, oom_marker)

    backoff = env.get("MLX_LANE_TEST_RETRY_BACKOFF")
    if backoff:
        import cache.durability as durability

        waits = tuple(float(b) for b in backoff.split(","))
        base_coordinator = durability.DurabilityCoordinator

        class SeamedCoordinator(base_coordinator):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("retry_backoff", waits)
                super().__init__(*args, **kwargs)

        durability.DurabilityCoordinator = SeamedCoordinator
        log.warning("test seams: ssd write retries after %s s", waits)

    if write_delay or full_flag:
        base_store = ssd_store.SSDStore

        def before_rename() -> None:
            if write_delay:
                time.sleep(write_delay)
            if full_flag and os.path.exists(full_flag):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (MLX_LANE_TEST_DISK_FULL)")

        class SeamedStore(base_store):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("before_rename", before_rename)
                super().__init__(*args, **kwargs)

        ssd_store.SSDStore = SeamedStore
        log.warning("test seams: ssd writes delayed %.1fs, failing while %s exists", write_delay, full_flag)


def _record(folder: str) -> None:
    """The app's whole middleware stack (its error pages included) inside tests.recorder's recorder."""
    import server.http.app as app_module
    from tests.recorder import record_app

    base_create = app_module.create_app

    def create_app(state):
        app = base_create(state)
        build = app.build_middleware_stack
        app.build_middleware_stack = lambda: record_app(build(), folder)
        return app

    app_module.create_app = create_app


def _slowed(sink, delay_s: float, delta_type):
    """The lane sleeps after handing over each token (the scheduler sees cancellations next tick)."""

    def slow_sink(event) -> None:
        sink(event)
        if isinstance(event, delta_type):
            time.sleep(delay_s)

    return slow_sink


if __name__ == "__main__":
    install()
    from server.cli import main

    sys.exit(main())
