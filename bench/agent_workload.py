"""The coding-agent workload shared by agent_replay.py and concurrent_agents.py: conversations, and one streamed turn.

Every conversation = the shared SYSTEM_PROMPT + its own task (TASKS, cycled with a variant suffix past 16). Each
turn's user message is a tool-output-sized chunk (tool_chunk: code / test logs / grep output / tracebacks of a token
count drawn in [lo, hi]), deterministic from the seed: `workload()` draws every chunk from one random.Random(seed)
in conversation-major order, so a given (seed, K, T, lo, hi) always yields the same conversations.
"""

from __future__ import annotations

import random
import time

from common import sse_chunks

SYSTEM_PROMPT = """You are Lane, an autonomous coding agent working inside a developer's repository.
You can call tools to read files, search the code base, run shell commands and edit files. Work in small,
verifiable steps: first understand the task, then look at the relevant code, then make the smallest change
that fixes the problem, then run the tests that cover it. Never guess the contents of a file you have not
read. Prefer precise edits over rewriting whole files. Keep the existing code style, naming and comments.

Tools available:
- read_file(path: str, start: int = 1, end: int | None = None): returns the numbered lines of a file.
- search(pattern: str, path: str = "."): ripgrep over the repository; returns file:line:text matches.
- run(command: str, timeout: int = 120): runs a shell command in the repository root; returns exit status,
  stdout and stderr (truncated to 4,000 characters each).
- edit_file(path: str, old: str, new: str): replaces exactly one occurrence of `old` with `new`.
- list_dir(path: str = "."): lists a directory, two levels deep, ignoring hidden files.

Rules:
1. Answer with one tool call per turn, written as a JSON object on a single line, or with a short final
   answer when the task is done. Do not explain what you are about to do at length.
2. When a command fails, read its error output carefully before trying again. Do not repeat a failing
   command unchanged.
3. Tests are the source of truth. A change is done only when the relevant tests pass and no other test
   starts failing. If the test suite is slow, run the narrowest test selection first.
4. Never delete tests to make them pass, never skip them, never weaken an assertion.
5. Do not touch files outside the repository. Do not install packages unless the task asks for it.
6. Secrets, tokens and credentials found in files must never be printed back in full.
7. If the task is ambiguous, choose the most conservative interpretation and say so in the final answer.

The repository is a Python 3.11 project using pytest, with sources under src/ and tests under tests/.
Continuous integration runs `make lint test` on every push; lint is ruff with the default rule set plus
import sorting. The project follows semantic versioning; do not bump the version yourself."""

TASKS = [
    "The CSV exporter drops the last row when the input has no trailing newline. Find and fix it.",
    "`parse_duration('1h30m')` returns 5400.0 but `parse_duration('90m')` raises ValueError. Fix the parser.",
    "The retry decorator sleeps even after the final attempt. Remove the useless last sleep and add a test.",
    "Add a `--dry-run` flag to the `sync` command that prints the planned actions without executing them.",
    "tests/test_cache.py::test_eviction_order is flaky on CI. Find the race and make the test deterministic.",
    "The HTTP client does not honour the `Retry-After` header on 429 responses. Implement it.",
    "`Config.load` ignores environment overrides for nested keys like DB__HOST. Make nested overrides work.",
    "The progress bar prints a stray carriage return when stdout is not a TTY. Suppress it in that case.",
    "Memory grows without bound when the watcher runs for hours. Find the leak in the event loop code.",
    "Rename the public function `get_usr` to `get_user`, keeping a deprecated alias for one release.",
    "The JSON logger crashes on datetime values in `extra`. Serialise them as ISO 8601 strings.",
    "Speed up `find_duplicates`, which is quadratic in the number of files. Keep its output order.",
    "The migration 0042 fails on SQLite because ALTER COLUMN is unsupported. Rewrite it portably.",
    "Pagination skips an item when the page size divides the total exactly. Fix the off-by-one.",
    "Add type hints to src/app/scheduler.py so that mypy --strict passes on that module.",
    "The `diff` command shows CRLF files as completely changed. Normalise line endings before diffing.",
]

_WORDS = ("user cache entry config token request handler session buffer index record batch stream worker "
          "queue parser reader writer result value item node path file event state lock timer client "
          "server backend frontend schema table column row metric limit offset page retry delay").split()
_MODULES = ("exporter parser retry cli cache http config progress watcher users logging dedupe migrations "
            "pagination scheduler diff").split()


def _ident(rng: random.Random) -> str:
    return "_".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def _code_block(rng: random.Random) -> list[str]:
    mod = rng.choice(_MODULES)
    start = rng.randint(1, 400)
    lines = [f"$ read_file src/app/{mod}.py {start} {start + 40}"]
    n = start
    for _ in range(rng.randint(2, 4)):
        fn, a, b = _ident(rng), _ident(rng), _ident(rng)
        body = [f"def {fn}({a}, {b}=None):",
                f'    """Return the {rng.choice(_WORDS)} for {a} ({rng.choice(_WORDS)} aware)."""',
                f"    if {b} is None:",
                f"        {b} = {rng.randint(0, 64)}",
                f"    for {rng.choice(_WORDS)} in {a}:",
                f"        if len({a}) > {b}:",
                f"            raise ValueError(f\"{fn}: too many {rng.choice(_WORDS)}s: {{len({a})}}\")",
                f"    return {{k: v for k, v in {a}.items() if v is not None}}",
                ""]
        for line in body:
            lines.append(f"{n:5d}  {line}")
            n += 1
    return lines


def _test_log(rng: random.Random) -> list[str]:
    mod = rng.choice(_MODULES)
    lines = [f"$ run 'python -m pytest tests/test_{mod}.py -x -q'",
             "============================= test session starts =============================="]
    passed = rng.randint(3, 40)
    lines.append(f"collected {passed + 1} items")
    lines.append(f"tests/test_{mod}.py " + "." * min(passed, 60) + "F")
    fn, arg = _ident(rng), _ident(rng)
    lines += ["=================================== FAILURES ===================================",
              f"____________________________ test_{fn} ____________________________",
              f"    def test_{fn}():",
              f"        {arg} = make_{rng.choice(_WORDS)}({rng.randint(1, 999)})",
              f">       assert {fn}({arg}) == {rng.randint(0, 99)}",
              f"E       AssertionError: assert {rng.randint(100, 999)} == {rng.randint(0, 99)}",
              f"E        +  where {rng.randint(100, 999)} = {fn}(<{rng.choice(_WORDS)} id=0x7f{rng.randint(10**8, 10**9 - 1):x}>)",
              "",
              f"tests/test_{mod}.py:{rng.randint(10, 300)}: AssertionError",
              "=========================== short test summary info ============================",
              f"FAILED tests/test_{mod}.py::test_{fn} - AssertionError",
              f"!!!!!!!!!!!!!!!!!!!!!!!!!! stopping after 1 failures !!!!!!!!!!!!!!!!!!!!!!!!!!!",
              f"1 failed, {passed} passed in {rng.uniform(0.2, 9):.2f}s"]
    return lines


def _grep(rng: random.Random) -> list[str]:
    word = _ident(rng)
    lines = [f"$ search '{word}'"]
    for _ in range(rng.randint(4, 10)):
        mod = rng.choice(_MODULES)
        lines.append(f"src/app/{mod}.py:{rng.randint(1, 600)}:    {_ident(rng)} = {word}({_ident(rng)}, "
                     f"{rng.choice(['True', 'False', 'None', str(rng.randint(0, 9))])})")
    return lines


def _traceback(rng: random.Random) -> list[str]:
    lines = ["$ run 'python -m app.cli sync --verbose'", "exit status: 1", "stderr:",
             "Traceback (most recent call last):"]
    for _ in range(rng.randint(3, 6)):
        mod = rng.choice(_MODULES)
        lines.append(f'  File "/repo/src/app/{mod}.py", line {rng.randint(1, 800)}, in {_ident(rng)}')
        lines.append(f"    return {_ident(rng)}(self.{_ident(rng)}, {_ident(rng)}={rng.randint(0, 9)})")
    lines.append(f"KeyError: '{_ident(rng)}'")
    return lines


def tool_chunk(rng: random.Random, tokenizer, lo: int = 150, hi: int = 400) -> str:
    """Realistic tool output of a token count drawn uniformly in [lo, hi] (cut at a line end)."""
    target = rng.randint(lo, hi)
    lines: list[str] = []
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < target:
        lines += rng.choice([_code_block, _test_log, _grep, _traceback])(rng) + [""]
    while len(lines) > 1 and len(tokenizer.encode("\n".join(lines[:-1]), add_special_tokens=False)) >= target:
        lines.pop()
    return "Tool output:\n" + "\n".join(lines).rstrip()


def workload(tokenizer, K: int, T: int, seed: int, lo: int = 150, hi: int = 400) -> tuple[list[str], list[list[str]]]:
    """(tasks[K], chunks[K][T]): each conversation's task and its T tool-output chunks, from random.Random(seed)."""
    rng = random.Random(seed)
    tasks = [TASKS[k % len(TASKS)] + ("" if k < len(TASKS) else f" (variant {k // len(TASKS)})") for k in range(K)]
    chunks = [[tool_chunk(rng, tokenizer, lo, hi) for _ in range(T)] for _ in range(K)]
    return tasks, chunks


def user_message(task: str, chunk: str, turn: int) -> dict:
    """Turn 0 carries the task and the first chunk; later turns carry the chunk alone."""
    return {"role": "user", "content": f"Task: {task}\n\n{chunk}" if turn == 0 else chunk}


def stream_chat(client, url: str, messages: list[dict], max_tokens: int) -> dict:
    """One greedy streamed chat turn (include_usage): {"ttft", "total" (s from the request's send), "text", "usage"}.

    TTFT = the first chunk with non-empty content (the whole request time when none came). A stream that carries an
    error event, or ends with neither text nor a usage chunk, raises RuntimeError: a failed request, however politely
    its stream closed (a server out of device memory ended 15-41 of 64 streams that way on an H100)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = None
    for elapsed, chunk in sse_chunks(client, url + "/v1/chat/completions", body, timeout=1200):
        if chunk.get("error"):
            raise RuntimeError(f"error event in the stream: {str(chunk['error'])[:200]}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content")
            if piece:
                if ttft is None:
                    ttft = elapsed
                text.append(piece)
    total = time.perf_counter() - t0
    if usage is None and not text:  # (a server may not send usage at all: then its text must have come)
        raise RuntimeError("the stream ended with neither text nor its usage chunk")
    if ttft is None:
        ttft = total
    return {"ttft": ttft, "total": total, "text": "".join(text), "usage": usage or {}}
