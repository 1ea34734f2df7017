"""kill -9 during SSD writes, trial after trial on one cache directory, on a tiny random llama with the default model's
tokenizer (the ``tiny_llama_dir`` fixture, tests/conftest.py: what is checked is the files and the hits, not the text;
tests/integration/test_ssd_live.py kills the default model mid-write).

Each trial starts a server on the directory the previous trial's server was killed over, checks what the start-up
scan made of it, then sets up one kill point and sends SIGKILL:

  before-rename         MLX_LANE_TEST_WRITE_DELAY holds a new conversation's write between fsync and rename: a
                        complete, fsynced `*.tmp` that must never load;
  after-write           the kill lands right after /admin/cache/flush said every entry is durable: all must hit;
  mid-write             a new conversation's write (no delay): killed the moment its `*.tmp` appears, while the
                        file is being written or fsynced (or just after, on a fast disk: the landing is recorded);
  extend-before-rename  the next turn of a durable conversation held before rename: the old entry must survive
                        (a new file supersedes the old one only once it is durable);
  mid-generation        killed while another conversation streams (MLX_LANE_TEST_TOKEN_DELAY) and a new one's
                        write races on the writer thread.

At every restart: no `*.tmp` is left, the scan removed exactly the temp files and nothing else (0 bad entries
loaded, every complete file indexed), every entry known durable hits (cached_tokens = prompt - 1) with the same
greedy text, no restore fails. MLX_LANE_KILL_TRIALS sets the number of trials (default 3: the first three kinds;
`make soak` runs 10, each kind twice). Kills are driven by events (a file appears, a flush answers, a token
arrives), never by sleeping a guessed time.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.reliability.streams import start_stream
from tests.fixtures.tiny_models import MECHANICS_FLAGS
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

TRIALS = int(os.environ.get("MLX_LANE_KILL_TRIALS", "3"))
KINDS = ["before-rename", "after-write", "mid-write", "extend-before-rename", "mid-generation"]
SYSTEM = {"role": "system", "content": "You are a careful assistant for a software engineering team."}
TOPICS = ["a mutex", "a semaphore", "a deadlock", "a race condition", "a thread pool", "a spinlock", "a monitor",
          "a barrier", "a condition variable", "a read-write lock", "an atomic counter", "a lock-free queue",
          "a futex", "a memory fence", "a green thread"]
MAX_TOKENS = 4


@dataclass
class Conv:
    messages: list
    text: str  # the greedy answer first seen (a prefix of it for a stream cut by the kill)
    prompt_tokens: int
    state: str  # durable | not-renamed | unknown | cut-stream
    min_cached: int = 0  # not-renamed: an earlier file of this conversation still serves this much


def chat(url: str, messages: list) -> tuple[str, dict]:
    r = httpx.post(url + "/v1/chat/completions", timeout=300,
                   json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj["choices"][0]["message"]["content"], obj["usage"]


def ssd(url: str) -> dict:
    return httpx.get(url + "/stats").json()["ssd_cache"]


def wait_until(pred, what: str, bound_s: float = 120.0, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + bound_s
    while not pred():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(poll_s)


def written_fraction(path: Path) -> float:
    """How much of its final size a `*.tmp` holds (its safetensors header says the total); 0 before the header."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return 0.0
    if len(raw) < 8 or len(raw) < 8 + struct.unpack("<Q", raw[:8])[0]:
        return 0.0
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    total = 8 + n + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    return len(raw) / total


class Trials:
    """The shared state of the trials: the cache dir, the conversations and what each kill left."""

    def __init__(self, kv: Path, model: Path):
        self.kv, self.model = kv, model
        self.convs: list[Conv] = []
        self.report: list[str] = []
        self.servers: list[ServerProc] = []  # killed or stopped by the test; any left running at the end, killed

    def tmp_files(self) -> list[Path]:
        return sorted(self.kv.rglob("*.tmp"))

    def complete_files(self) -> set[Path]:
        return set(self.kv.rglob("*.safetensors"))

    def start(self, env: dict | None = None) -> ServerProc:
        """Start a server on the directory and check its scan against what the last kill left on disk."""
        tmps, files = self.tmp_files(), self.complete_files()
        srv = ServerProc("--model", str(self.model), *MECHANICS_FLAGS, "--ssd-cache", str(self.kv),
                         "--write-behind-debounce", "0.05", env=env)
        self.servers.append(srv)
        s = ssd(srv.url)
        assert self.tmp_files() == [], "a *.tmp survived the start-up scan"
        assert s["removed_at_scan"] == len(tmps), (s, tmps)  # the temp files and nothing else
        assert s["entries"] == len(files) and self.complete_files() == files, (s, files)
        self.report.append(f"  restart: scan removed {len(tmps)} *.tmp, indexed {len(files)} complete files, "
                           f"0 bad entries")
        return srv

    def new_conv(self, url: str) -> Conv:
        topic = TOPICS[len(self.convs) % len(TOPICS)]
        messages = [SYSTEM, {"role": "user", "content": f"In one sentence: what is {topic}?"}]
        text, usage = chat(url, messages)
        conv = Conv(messages, text, usage["prompt_tokens"], "unknown")
        self.convs.append(conv)
        return conv

    def verify_durable(self, url: str) -> int:
        """Every entry known durable hits in full, with the same greedy text; returns how many."""
        durable = [c for c in self.convs if c.state == "durable"]
        for c in durable:
            text, usage = chat(url, c.messages)
            assert usage["prompt_tokens_details"]["cached_tokens"] == c.prompt_tokens - 1, (usage, c.messages)
            assert text == c.text
        return len(durable)

    def verify_rest(self, url: str, convs: list[Conv]) -> list[str]:
        """Conversations of earlier servers whose file may or may not have made it: same text either way; a
        `*.tmp` never renamed never serves. They are in RAM afterwards (and written again when they were lost)."""
        seen = []
        for c in [c for c in convs if c.state != "durable"]:
            text, usage = chat(url, c.messages)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if c.state == "cut-stream":  # killed after a token or two: the rest comes now
                assert text.startswith(c.text), (text, c.text)
                c.text, c.prompt_tokens = text, usage["prompt_tokens"]
            else:
                assert text == c.text, (text, c.text)
            if c.state == "not-renamed":
                assert c.min_cached <= cached < c.prompt_tokens - 1, (usage, c.min_cached)
            seen.append(f"{c.state}: {'restored' if cached == c.prompt_tokens - 1 else 'recomputed'}")
            c.state = "unknown"
        return seen

    def flush_all(self, url: str) -> None:
        r = httpx.post(url + "/admin/cache/flush", params={"timeout": 120}, timeout=180)
        assert r.status_code == 200 and r.json() == {"durable": True}, r.text
        for c in self.convs:
            c.state = "durable"

    def landing(self) -> str:
        tmps = self.tmp_files()
        sizes = ", ".join(f"{p.stat().st_size} B, {written_fraction(p):.0%} written" for p in tmps)
        return f"{len(tmps)} *.tmp ({sizes or '-'}), {len(self.complete_files())} complete files on disk"


def trial(t: Trials, i: int) -> ServerProc:
    """Start a server, verify the last kill's aftermath, set up trial i's kill point; returns the server to kill."""
    kind = KINDS[i % len(KINDS)]
    env = {"MLX_LANE_TEST_WRITE_DELAY": "600"} if kind.endswith("before-rename") else {}
    if kind == "mid-generation":
        env = {"MLX_LANE_TEST_TOKEN_DELAY": "0.2"}
    srv = t.start(env)
    earlier = list(t.convs)
    hits = t.verify_durable(srv.url)
    notes = [f"{hits} durable entries hit with identical text"]
    if kind.endswith("before-rename"):
        if kind == "before-rename":
            conv = t.new_conv(srv.url)
            conv.state = "not-renamed"
        else:
            base = next(c for c in reversed(t.convs) if c.state == "durable")
            messages = base.messages + [{"role": "assistant", "content": base.text},
                                        {"role": "user", "content": "And when should I avoid it?"}]
            text, usage = chat(srv.url, messages)
            assert usage["prompt_tokens_details"]["cached_tokens"] >= base.prompt_tokens
            t.convs.append(Conv(messages, text, usage["prompt_tokens"], "not-renamed", base.prompt_tokens))
        # the kill lands in the held pause: the temp file is complete (fsync follows, then 600 s of sleep)
        wait_until(lambda: any(written_fraction(p) == 1.0 for p in t.tmp_files()), "the held write's *.tmp")
        notes += t.verify_rest(srv.url, earlier)  # their writes queue behind the held one
    else:
        notes += t.verify_rest(srv.url, earlier)
        t.flush_all(srv.url)
        if kind == "after-write":
            t.new_conv(srv.url)
            t.flush_all(srv.url)
        elif kind == "mid-write":
            # first round: kill as the temp file appears; second: once half of it is written (or, on a disk
            # too fast to catch it, just after the rename: the landing is reported)
            n, half = len(t.complete_files()), (i // len(KINDS)) % 2 == 1
            t.new_conv(srv.url)  # its write starts after the 0.05 s debounce: watch the file system only
            wait_until(lambda: len(t.complete_files()) > n or any(
                not half or written_fraction(p) >= 0.5 for p in t.tmp_files()), "the write", poll_s=0.0005)
        else:  # mid-generation
            t.new_conv(srv.url)  # its write races with the stream below
            topic = TOPICS[len(t.convs) % len(TOPICS)]
            messages = [SYSTEM, {"role": "user", "content": f"Explain {topic} to a new engineer."}]
            stream = start_stream(srv.url, messages, max_tokens=16)
            wait_until(lambda: stream.text, "the stream's first token")
            t.convs.append(Conv(messages, stream.text, 0, "cut-stream"))
    t.report.append(f"  before the kill: {'; '.join(notes)}")
    return srv


def test_kill_9_during_ssd_writes(tmp_path, tiny_llama_dir):
    t = Trials(tmp_path / "kv", tiny_llama_dir)
    try:
        for i in range(TRIALS):
            t.report.append(f"trial {i + 1}/{TRIALS} {KINDS[i % len(KINDS)]}")
            trial(t, i).kill()
            t.report.append(f"  kill -9 landed with {t.landing()}")
        final = t.start()
        hits = t.verify_durable(final.url)
        rest = t.verify_rest(final.url, list(t.convs))
        t.report.append(f"  final: {hits} durable entries hit with identical text; {'; '.join(rest) or '-'}")
        s = ssd(final.url)
        assert s["failed"] == 0 and s["restores_failed"] == 0, s
        assert final.stop() == 0, final.log()
    finally:
        print("\n" + "\n".join(t.report))
        for srv in t.servers:
            if srv.proc.poll() is None:
                srv.kill()
