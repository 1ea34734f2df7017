"""Prompt tokens recomputed per turn on a hybrid model with a thinking template (issue 35): ours vs today vs mlx_lm.

A 10-turn agent conversation (a system prompt, then each turn a user message with ~150 tokens of tool output) on a
tiny random-weight hybrid (qwen3-next: gated delta-net linear attention + full attention, the default model's
tokenizer) whose chat template works as the thinking templates agents run do: the generation prompt opens a think
block (``<|im_start|>assistant\\n<think>\\n``, as Qwen3.5 / QwQ / DeepSeek-R1 templates put it) and earlier replies
are rendered without their reasoning. So turn N+1's prompt parts from turn N's inside turn N's prompt, where its
generation prompt begins: a cache that can serve only whole entries of a model whose recurrent state cannot be cut
back (mlx_lm.server; mlx-lane before checkpoints) recomputes everything, every turn.

The conversation is fixed (each reply the client resends is canned, with a think block the template drops), so every
server sees the same prompts. Per server and turn: prompt_tokens, cached_tokens (usage), recomputed = prompt -
cached, and TTFT. Servers, one after the other, each fresh:
  ours         `mlx-lane serve` of this checkout (checkpoints where the conversation ends and at chunk ends)
  today        `mlx-lane serve` of another checkout (--today DIR: e.g. a worktree of the landed main)
  mlx_lm       mlx_lm.server (its prompt cache sized for the conversation)

    python bench/hybrid_turns.py --today /path/to/landed-main --out bench/results/hybrid_turns.json
    python bench/hybrid_turns.py --turns 3 --servers ours,mlx_lm      # smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers as peer_servers  # noqa: E402
from agent_workload import SYSTEM_PROMPT, user_message, workload  # noqa: E402
from common import ROOT, ServerProc, preflight, run_record, write_result  # noqa: E402

from tests.fixtures.zoo import THINKING_TEMPLATE  # noqa: E402  (the zoo's: the same thinking template)


def write_model(out: Path, tokenizer_dir: Path, *, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random-weight qwen3-next (every other layer full attention) with the default model's tokenizer and the
    thinking template above, as an mlx-lm directory."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    heads = max(2, hidden // 32)
    config = {"model_type": "qwen3_next", "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": 2 * hidden, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
              "head_dim": 32, "linear_num_value_heads": heads, "linear_num_key_heads": max(1, heads // 2),
              "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
              "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
              "shared_expert_intermediate_size": hidden, "mlp_only_layers": [], "moe_intermediate_size": hidden // 2,
              "rms_norm_eps": 1e-6, "vocab_size": vocab, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "max_position_embeddings": 32768, "full_attention_interval": 2, "tie_word_embeddings": False}
    mx.random.seed(seed)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights["model.embed_tokens.weight"] = mx.random.normal(weights["model.embed_tokens.weight"].shape)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["chat_template"] = THINKING_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    return out


def conversation(tokenizer, turns: int, seed: int) -> list[list[dict]]:
    """The messages of each turn: the same for every server."""
    tasks, chunks = workload(tokenizer, 1, turns, seed=seed, lo=120, hi=180)
    out, history = [], [{"role": "system", "content": SYSTEM_PROMPT}]
    for t, chunk in enumerate(chunks[0]):
        history = history + [user_message(tasks[0], chunk, t)]
        out.append(list(history))
        reply = f"<think>\nThe user wants step {t}; the tool output shows what to do.\n</think>\n\nDone with step {t}."
        history = history + [{"role": "assistant", "content": reply}]
    return out


def run_server(peer, turns: list[list[dict]], max_tokens: int) -> list[dict]:
    rows = []
    with httpx.Client(timeout=1200) as client:
        for t, messages in enumerate(turns):
            t0 = time.monotonic()
            first = None
            usage = None
            with client.stream("POST", peer.url + "/v1/chat/completions", json={
                    "messages": messages,  # no model: each server's one
                    "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    delta = obj["choices"][0].get("delta", {}) if obj.get("choices") else {}
                    if first is None and (delta.get("content") or delta.get("reasoning_content")
                                          or delta.get("reasoning")):
                        first = time.monotonic() - t0  # the first generated text (not the role chunk)
                    if obj.get("usage"):
                        usage = obj["usage"]
            prompt = usage["prompt_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            row = {"turn": t + 1, "prompt_tokens": prompt, "cached_tokens": cached,
                   "recomputed": prompt - cached, "ttft_s": round(first or 0.0, 3)}
            if peer.name != "mlx_lm":  # what our RAM tier holds after the turn (entries carry their checkpoints)
                pc = client.get(peer.url + "/stats").json().get("prompt_cache") or {}
                row.update(ram_entries=pc.get("entries"), ram_bytes=pc.get("bytes"))
            rows.append(row)
            print(f"  {peer.name:6} turn {t + 1:2}: prompt {prompt:5}  cached {cached:5}  recomputed {prompt - cached:5}"
                  f"  TTFT {first or 0:.2f}s", flush=True)
    return rows


class Today(peer_servers.Ours):
    """`mlx-lane serve` of another checkout."""

    name = "today"

    def __init__(self, workdir: Path, model_dir: Path, checkout: Path):
        super().__init__(workdir, model_dir)
        self.checkout = checkout

    def start(self) -> None:
        env = {"MLX_LANE_HOME": str(self.workdir / "today-home"), "MLX_LANE_EMBEDDING_MODEL": "none"}
        self.proc = ServerProc("--model", str(self.model_dir), "--log-level", "warning", "--no-ssd-cache",
                               env=env, startup_timeout=300, cwd=self.checkout)
        self.url = self.proc.url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours,today,mlx_lm")
    ap.add_argument("--today", help="the checkout whose server is 'today' (e.g. a worktree of the landed main)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hybrid_turns.json"))
    args = ap.parse_args()
    from models import ensure_default_model

    work = Path(tempfile.mkdtemp(prefix="hybrid-turns-"))
    model_dir = write_model(work / "tiny-qwen3-next", Path(ensure_default_model(progress=False)),
                            hidden=args.hidden, layers=args.layers)
    from mlx_lm.utils import load_tokenizer

    turns = conversation(load_tokenizer(model_dir), args.turns, args.seed)
    result = {**run_record(), "preflight": preflight(), "args": vars(args), "servers": {}}
    for name in args.servers.split(","):
        if name == "today":
            if not args.today:
                print("skipping 'today': give --today DIR", file=sys.stderr)
                continue
            peer = Today(work, model_dir, Path(args.today))
        elif name == "mlx_lm":
            peer = peer_servers.MlxLm(work, model_dir, extra=("--prompt-cache-size", str(4 * args.turns)))
        else:
            peer = peer_servers.Ours(work, model_dir)
        print(f"{name}:", flush=True)
        peer.start()
        try:
            rows = run_server(peer, turns, args.max_tokens)
        finally:
            peer.stop()
        later = rows[1:]
        result["servers"][name] = {"turns": rows, "recomputed_after_turn_1": sum(r["recomputed"] for r in later),
                                   "ram_bytes_at_end": rows[-1].get("ram_bytes"),
                                   "prompt_after_turn_1": sum(r["prompt_tokens"] for r in later),
                                   "mean_ttft_after_turn_1": round(sum(r["ttft_s"] for r in later) / max(1, len(later)), 3)}
    print("\nprompt tokens recomputed over turns 2..N (of all prompt tokens sent):")
    for name, s in result["servers"].items():
        print(f"  {name:6} {s['recomputed_after_turn_1']:6} of {s['prompt_after_turn_1']:6}   mean TTFT "
              f"{s['mean_ttft_after_turn_1']:.2f}s   RAM tier at the end {s['ram_bytes_at_end']} bytes")
    write_result(result, args.out)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
