"""What an idle model sharded over processes costs the host: each rank's CPU while no request runs.

Starts ``mlx-lane serve`` under ``mlx.launch`` (the ring backend on loopback) on a tiny random qwen2 (4 layers, the
default model's tokenizer; tests/fixtures/tiny_models.py), then for each phase reads every rank's CPU time (Linux
/proc) over --seconds: idle after the start, then idle after a request. Rank 0 is the HTTP server; the others are
followers, which wait on rank 0's doorbell when its lane is idle (server/engine/doorbell.py) or, without one, inside
MLX's next collective, which polls its sockets.

    python bench/sharded_idle.py --ranks 2 --seconds 5
    python bench/sharded_idle.py --ranks 3 --model default      # the default model over 3 processes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def idle_cores(ranks: dict[int, int], seconds: float) -> dict[int, float]:
    """Each rank's CPU over ``seconds`` of wall time, in cores."""
    from tests.launchproc import cpu_seconds

    before = {r: cpu_seconds(p) for r, p in ranks.items()}
    time.sleep(seconds)
    return {r: round((cpu_seconds(p) - before[r]) / seconds, 3) for r, p in ranks.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--model", default="tiny", help="tiny (a random 4-layer qwen2) or any --model of mlx-lane serve")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()

    import httpx

    from tests.launchproc import LaunchedServer

    model = args.model
    if model == "tiny":
        from models import ensure_default_model
        from tests.fixtures.tiny_models import write_shardable_model

        model = str(write_shardable_model(Path(tempfile.mkdtemp(prefix="sharded-idle-")) / "qwen",
                                          ensure_default_model(progress=False)))
    srv = LaunchedServer(args.ranks, "--model", model, "--no-ssd-cache", "--warm-up", "off")
    try:
        ranks = srv.ranks()
        stats = httpx.get(srv.url + "/stats").json()["distributed"]
        time.sleep(1.0)
        idle_start = idle_cores(ranks, args.seconds)
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0})
        r.raise_for_status()
        time.sleep(1.0)
        idle_after = idle_cores(ranks, args.seconds)
    finally:
        srv.stop()
    result = {"ranks": args.ranks, "model": args.model, "seconds": args.seconds,
              "idle_followers": stats.get("idle_followers", "polling (no doorbell in this version)"),
              "cores_idle_after_start": idle_start, "cores_idle_after_a_request": idle_after,
              "cpu_count": os.cpu_count(), "loadavg": os.getloadavg()}
    print(json.dumps(result, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sharded_idle_{args.ranks}ranks.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
