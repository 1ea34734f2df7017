"""Single-request speed, one request at a time: cold prefill tok/s and decode tok/s of each server (bench/peers.py).

Every round sends to every server, the order rotating each round:
  prefill  a ~N-token prompt no server has seen (a unique first line), max_tokens 1, streamed:
           prefill tok/s = prompt tokens / time to the first streamed chunk with content or a finish reason;
  decode   a short prompt, --decode-tokens tokens at temperature 0 with the EOS token banned (logit_bias -100),
           streamed: decode tok/s = (tokens - 1) / (last token time - first token time); tokens from the usage
           chunk where the server sends one, else the number of content chunks (llama-cpp-python streams one
           token per chunk and sends no usage).
Prompt tokens are counted with the default model's tokenizer and chat template (llama.cpp applies the same
template from the GGUF). Peak RSS (VmHWM) of each server is read when it stops.

First, --startup-rounds rounds of launch to the first answer (issue 45): each server started afresh (the order
rotating), the seconds until it answers its readiness probe, then a tiny request's time to its first token; the
sum is what a user waits after launching it. Each runs as installed here (mlx_lm.server with whatever this venv
holds: `make test` installs torch, which transformers imports when present; ours hides it).

    python bench/single_request.py --servers ours,mlx_lm,llama_cpp --rounds 3
    python bench/single_request.py --servers ours,mlx_lm --rounds 0 --startup-rounds 5   # start-up alone
    python bench/single_request.py --servers ours,mlx_lm --model /tmp/shape --rounds 0 --startup-rounds 2  # H200
    python bench/single_request.py --servers ours,ours_warmers,mlx_lm --model /tmp/shape --rounds 0 \
        --startup-rounds 2     # the kernel warmers' share (bench/peers.py OURS_VARIANTS: each a home of its own)

The first start of ours finds a fresh MLX_LANE_HOME (no kernel cache); the later ones find what it compiled, so
the summary gives both. mlx_lm.server likewise: its CUDA kernels go to a folder of this run (MLX_PTX_CACHE_DIR),
empty at its first start (before 2026-12-07 it used MLX's default folder, which earlier runs on the machine may have
filled: in the H200 row of 12-05 the peer's first answer was only 2.3 s slower than its second) (issue 45: fresh <= 1.0x mlx_lm.server, with the kernel cache <= 0.6x its fresh start).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

import peers as peer_servers
from common import ROOT, ensure_blas_here, preflight, run_record, spread, sse_chunks, write_result

FILLER = ("The build system reads the manifest, resolves every dependency to a pinned version, fetches what is "
          "missing into the local cache and then compiles each package in topological order. ")


def stream(client, url: str, messages: list[dict], max_tokens: int, logit_bias: dict | None = None) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if logit_bias:
        body["logit_bias"] = logit_bias
    stamps, usage, first = [], None, None
    for elapsed, chunk in sse_chunks(client, url + "/v1/chat/completions", body, timeout=1200):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            if (ch.get("delta") or {}).get("content"):
                stamps.append(elapsed)
            if first is None and ((ch.get("delta") or {}).get("content") or ch.get("finish_reason")):
                first = elapsed
    n = (usage or {}).get("completion_tokens") or len(stamps)
    rate = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return {"ttft_s": first, "decode_tok_s": rate, "completion_tokens": n, "usage": usage}


def launch_to_first_answer(server, client) -> dict:
    """Start ``server`` afresh, wait for its readiness, send a tiny request; stop it. Seconds of each part."""
    waits, server.wait_warm = getattr(server, "wait_warm", None), False  # ours: the port open is what a user
    t0 = time.perf_counter()                                               # waits for (its warm-up runs behind)
    server.start()
    healthy = time.perf_counter() - t0
    server.wait_warm = waits
    phases = None
    try:
        first = stream(client, server.url, [{"role": "user", "content": "Say hi."}], 4)
        try:  # ours says where its seconds before ready went (/stats "startup"); a peer has no such block
            phases = client.get(server.url + "/stats", timeout=30).json().get("startup")
        except (httpx.HTTPError, ValueError, AttributeError):
            phases = None
    finally:
        server.stop()
    return {"healthy_s": round(healthy, 3), "first_ttft_s": round(first["ttft_s"], 3),
            "first_answer_s": round(healthy + first["ttft_s"], 3), **({"startup": phases} if phases else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours,mlx_lm,llama_cpp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--startup-rounds", type=int, default=3, help="rounds of launch to the first answer (0: none)")
    ap.add_argument("--model", default=None, help="an MLX model directory instead of the default model (ours and "
                    "mlx_lm only; e.g. a shape bench/gpu.py --shape built on the H200)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "single_request.json"))
    args = ap.parse_args()
    ensure_blas_here()

    from mlx_lm.utils import load_tokenizer

    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="single-request-"))
    servers = peer_servers.make(names, workdir, model_dir=Path(args.model) if args.model else None)
    for s in servers:
        if isinstance(s, peer_servers.MlxLm):  # a new user's mlx_lm.server compiles its CUDA kernels too: MLX's cache
            # (default <tmp>/mlx/<version>/ptx) may hold what earlier runs on this machine compiled, so the peer
            # gets a folder of this run, empty at its first start and kept for the later ones, as ours' home is
            s.env["MLX_PTX_CACHE_DIR"] = str(workdir / "mlx-lm-ptx")
    tokenizer = load_tokenizer(servers[0].model_dir if hasattr(servers[0], "model_dir") else peer_servers.default_paths()[0])
    eos = sorted(int(e) for e in (tokenizer.eos_token_ids or []))
    filler = FILLER * (args.prompt_tokens // 30 + 2)
    rows: list[dict] = []
    pf = preflight()
    client = httpx.Client()
    startup: dict = {s.name: [] for s in servers}
    for i in range(args.startup_rounds):
        for s in servers[i % len(servers):] + servers[:i % len(servers)]:
            startup[s.name].append(launch_to_first_answer(s, client))
            print(f"start {i} {s.name:9s} {startup[s.name][-1]}", flush=True)
    for s in servers:
        s.start()
    try:
        for s in servers:  # warm-up: kernels, allocator, the server's own first-request costs
            stream(client, s.url, [{"role": "user", "content": "Say hi."}], 4)
        for i in range(args.rounds):
            order = servers[i % len(servers):] + servers[:i % len(servers)]
            for s in order:
                # a first line no server has seen: no prefix cache can serve this prompt
                text = f"Round {i} for {s.name} at {time.time_ns()}: summarise this log.\n" + filler
                ids = tokenizer.encode(text)[: args.prompt_tokens]
                msgs = [{"role": "user", "content": tokenizer.decode(ids)}]
                n_prompt = len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
                p = stream(client, s.url, msgs, 1)
                d = stream(client, s.url, [{"role": "user", "content": f"Write a long story about a lighthouse "
                                            f"keeper (version {i})."}], args.decode_tokens,
                           logit_bias={str(e): -100 for e in eos})
                row = {"round": i, "server": s.name, "prompt_tokens": n_prompt, "prefill_ttft_s": round(p["ttft_s"], 3),
                       "prefill_tok_s": round(n_prompt / p["ttft_s"], 1), "decode_tok_s": round(d["decode_tok_s"], 2)
                       if d["decode_tok_s"] else None, "decode_tokens": d["completion_tokens"],
                       "cached_tokens": ((p["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}
                rows.append(row)
                print(f"round {i} {s.name:9s} prefill {n_prompt} tokens in {p['ttft_s']:.2f}s = "
                      f"{row['prefill_tok_s']:.1f} tok/s | decode {row['decode_tok_s']} tok/s "
                      f"({d['completion_tokens']} tokens)", flush=True)
    finally:
        client.close()
        for s in servers:
            s.stop()

    summary = {}
    for s in servers:
        rs = [r for r in rows if r["server"] == s.name]
        pre = [r["prefill_tok_s"] for r in rs]
        dec = [r["decode_tok_s"] for r in rs if r["decode_tok_s"]]
        summary[s.name] = {
            "label": s.label,
            "prefill_tok_s": spread(pre) if pre else None,
            "decode_tok_s": spread(dec) if dec else None,
            "peak_rss_mib": round(s.peak_rss_mib, 1) if s.peak_rss_mib else None,
        }
    for s in servers:
        if startup[s.name]:
            summary[s.name]["first_answer_s"] = spread([r["first_answer_s"] for r in startup[s.name]])
            summary[s.name]["healthy_s"] = spread([r["healthy_s"] for r in startup[s.name]])
            # the first start found no kernel cache (ours: a fresh MLX_LANE_HOME); the later ones found the first's
            summary[s.name]["first_answer_fresh_s"] = startup[s.name][0]["first_answer_s"]
            if len(startup[s.name]) > 1:
                summary[s.name]["first_answer_again_s"] = spread([r["first_answer_s"] for r in startup[s.name][1:]])
    ratios = {}
    if "ours" in summary:
        for n, v in summary.items():
            if n != "ours":
                o = summary["ours"]
                if "first_answer_s" in o and "first_answer_s" in v:
                    ratios.setdefault(n, {})["first_answer_ours_over_peer"] = round(
                        o["first_answer_s"]["median"] / v["first_answer_s"]["median"], 3)
                    ratios[n]["first_answer_fresh_ours_over_peer"] = round(
                        o["first_answer_fresh_s"] / v["first_answer_fresh_s"], 3)
                    if "first_answer_again_s" in o and "first_answer_again_s" in v:
                        ratios[n]["first_answer_again_ours_over_peer_fresh"] = round(
                            o["first_answer_again_s"]["median"] / v["first_answer_fresh_s"], 3)
                        ratios[n]["first_answer_again_ours_over_peer_again"] = round(
                            o["first_answer_again_s"]["median"] / v["first_answer_again_s"]["median"], 3)
                if not rows:
                    continue
                ratios[n] = {**ratios.get(n, {}), "prefill_ours_over_peer": round(o["prefill_tok_s"]["median"] / v["prefill_tok_s"]["median"], 3),
                             "decode_ours_over_peer": round(o["decode_tok_s"]["median"] / v["decode_tok_s"]["median"], 3)
                             if o["decode_tok_s"] and v["decode_tok_s"] else None,
                             "peak_rss_ours_over_peer": round(o["peak_rss_mib"] / v["peak_rss_mib"], 3)
                             if o["peak_rss_mib"] and v["peak_rss_mib"] else None}
    result = {**run_record(), "preflight": pf, "preflight_end": preflight(),
              "config": {"servers": {s.name: s.label for s in servers}, "rounds": args.rounds,
                         "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                         "alternation": "every round sends to every server, order rotated each round"},
              "summary": summary, "ratios": ratios, "rows": rows, "startup": startup}
    write_result(result, args.out)
    import json

    print(json.dumps({k: result[k] for k in ("summary", "ratios")}, indent=1))


if __name__ == "__main__":
    main()
