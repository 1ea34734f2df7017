"""Fit a checkpoint's multi-token-prediction head to its own target (issue 44 item 5), for bench/mtp_fit.py.

Random weights give a head that never agrees with its model, so a speed figure for MTP needs a head fitted to the
model it drafts for. This trains only the MTP module (the target, its embedding and its output head stay frozen) on
the target's own greedy continuations, with the loss the drafts are judged by:

  depth 1   the entry at position q (the embedding of S[q] and the target's hidden state H[q-1]) predicts the
            target's greedy token after q, argmax(head(H[q])): what a verify step accepts
  depth 2   the entry fed its own depth-1 output as the hidden state and the target's token as the next token
            predicts the token after that (positions where the sequence took the target's token only): what a
            chained draft needs. Its attention runs over depth-2 entries of the earlier positions, where inference
            has depth-1 entries: an approximation, which the acceptance measured afterwards on the server's own path
            (spec.speculative_decode) judges

Parts, each used by bench/mtp_fit.py:

    build_target_with_heads(shape, out, dtype, tokenizer_dir, vocab)   bench/gpu.py's random shape + untrained heads
    fit_prompts(tokenizer, n, tokens, seed)     windows of Python's own standard library sources (not the prompts the
                                                fitted head is measured on)
    continuations(model, prompts, new_tokens)   the target's greedy continuations, batched
    fit(loaded, head, sequences, steps, ...)    AdamW on the module's parameters; the loss curve
    write_heads(head, model, src, out)          the fitted head as its family's checkpoint tensors (mtp.safetensors,
                                                the index pointing the heads' names at it); the rest of ``src``
                                                linked, so ``mlx-lane serve --model out --draft-kind mtp`` drafts with it
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

HEADS_FILE = "mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MTP_CONFIG = {"qwen3_5": {"mtp_num_hidden_layers": 1},  # the key a family's config declares its heads with
              "glm4_moe_lite": {"num_nextn_predict_layers": 1}}


def build_target_with_heads(shape: str, out: Path, dtype: str, tokenizer_dir: Path, vocab: int | None = None) -> Path:
    """bench/gpu.py's random-weight ``shape`` (its vocabulary cut to ``vocab`` when given) with an untrained MTP head
    of its family (random normal * 0.02, norms 1, as the target), written as the family ships it."""
    import gpu
    from models.mtp.heads import MtpHead
    from tests.fixtures import zoo_mtp

    base = dict(gpu.SHAPES[shape])
    model_type = base.get("model_type", "llama")
    if model_type not in MTP_CONFIG:
        raise SystemExit(f"--shape {shape}: a {model_type} model; MTP heads are built here for "
                         f"{', '.join(MTP_CONFIG)} shapes")
    gpu.SHAPES[shape] = {**base, **MTP_CONFIG[model_type], **({"vocab_size": vocab} if vocab else {})}
    model = gpu.build_model(Path(out), shape, dtype, Path(tokenizer_dir))
    cfg = json.loads((Path(out) / "config.json").read_text())
    module = zoo_mtp.module_for(model_type, model, cfg)
    gpu.random_weights(module, dtype, seed=44)
    head = MtpHead(family=zoo_mtp.FAMILY[model_type], module=module, embed=None, head=None, layers=1,
                   hidden_size=int(cfg["hidden_size"]))
    write_heads(head, model, Path(out), Path(out))
    return Path(out)


def fit_prompts(tokenizer, n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` windows of ``tokens`` tokens from Python's standard library sources (code, as agents send)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 8000)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        ids = tokenizer.encode(rng.choice(files).read_text(errors="replace"))
        if len(ids) > tokens:
            s = rng.randrange(0, len(ids) - tokens)
            out.append(ids[s: s + tokens])
    return out


def continuations(model, prompts: list[list[int]], new_tokens: int, batch: int = 16) -> list[list[int]]:
    """Each prompt followed by the target's ``new_tokens`` greedy tokens (prompts of one length, ``batch`` at once)."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for i in range(0, len(prompts), batch):
        rows = prompts[i: i + batch]
        caches = make_prompt_cache(model)
        logits = model(mx.array(rows), cache=caches)
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        got = [tok]
        for _ in range(new_tokens - 1):
            tok = mx.argmax(model(tok[:, None], cache=caches)[:, -1, :], axis=-1)
            got.append(tok)
            mx.async_eval(tok)
        new = mx.stack(got, axis=1).tolist()
        out.extend(r + n for r, n in zip(rows, new))
    return out


def _targets(model, tap, sequences: list[list[int]], batch: int) -> list[tuple[mx.array, mx.array, mx.array]]:
    """Per sequence (S, H, A): its tokens (L,), the target's hidden states there (L, hidden) and its greedy token after
    each position (L,), from one forward per ``batch`` sequences of one length."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    by_length: dict[int, list[list[int]]] = {}
    for seq in sequences:
        by_length.setdefault(len(seq), []).append(seq)
    for group in by_length.values():
        for i in range(0, len(group), batch):
            x = mx.array(group[i: i + batch])
            logits = model(x, cache=make_prompt_cache(model))
            h, a = tap.last, mx.argmax(logits, axis=-1)
            mx.eval(h, a)
            out.extend((x[j], h[j], a[j]) for j in range(x.shape[0]))
    return out


def fit(loaded, head, tap, sequences: list[list[int]], steps: int, lr: float = 1e-3, depth: int = 2,
        batch: int = 4, log_every: int = 25, seed: int = 0) -> dict:
    """Train ``head.module`` (only) on ``sequences`` of one length (see the module docstring); it ends in the
    target's dtype. Returns the loss curve and the depth-1 agreement on the training positions, first and last."""
    from models.mtp.heads import SHAPES

    model = loaded.model
    rows = _targets(model, tap, sequences, batch=max(1, batch * 2))
    span = min(int(s.shape[0]) for s, _, _ in rows)  # a training row: a window of this many positions

    def windows(picks: list[int]):
        got = []
        for i in picks:
            s, h, a = rows[i]
            o = rng.randrange(0, int(s.shape[0]) - span + 1)
            got.append((s[o: o + span], h[o: o + span], a[o: o + span]))
        return tuple(mx.stack(part) for part in zip(*got))

    first_dtype = next(v.dtype for v in _leaves(head.module))
    head.module.set_dtype(mx.float32)
    forward = SHAPES[head.family]

    def embed(tokens):
        e = head.embed(tokens)
        return e * head.embed_scale if head.embed_scale != 1.0 else e

    def losses(s, h, a):
        tok, hid, lab1 = s[:, 1:-1], h[:, :-2], a[:, 1:-1]
        out1 = forward(head.module, embed(tok), hid.astype(mx.float32), head.make_caches(), "causal")
        logits1 = head.logits(out1.astype(hid.dtype)).astype(mx.float32)
        l1 = nn.losses.cross_entropy(logits1, lab1).mean()
        agree = (mx.argmax(logits1, axis=-1) == lab1).astype(mx.float32).mean()
        if depth < 2:
            return l1, (l1, agree)
        took = (s[:, 2:-1] == a[:, 1:-2]).astype(mx.float32)  # the sequence went on with the target's token
        out2 = forward(head.module, embed(lab1[:, :-1]), out1[:, :-1].astype(hid.dtype).astype(mx.float32),
                       head.make_caches(), "causal")
        logits2 = head.logits(out2.astype(hid.dtype)).astype(mx.float32)
        l2 = (nn.losses.cross_entropy(logits2, a[:, 2:-1]) * took).sum() / mx.maximum(took.sum(), 1)
        return l1 + l2, (l1, agree)

    def loss_fn(s, h, a):
        total, _ = losses(s, h, a)
        return total

    grad_fn = nn.value_and_grad(head.module, loss_fn)
    rng = random.Random(seed)
    schedule = optim.cosine_decay(lr, max(1, steps))
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    n = len(rows)
    curve = []
    t0 = time.perf_counter()
    before = None
    for step in range(steps):
        s, h, a = windows([rng.randrange(n) for _ in range(batch)])
        if before is None:
            l1, agree = losses(s, h, a)[1]
            before = {"depth1_loss": l1.item(), "depth1_agreement": agree.item()}
        loss, grads = grad_fn(s, h, a)
        opt.update(head.module, grads)
        mx.eval(loss, head.module.parameters(), opt.state)
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(loss.item(), 4), "s": round(time.perf_counter() - t0, 1)})
            print(f"  fit step {step:4d}/{steps}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    l1, agree = losses(*windows(list(range(min(n, batch * 2)))))[1]
    head.module.set_dtype(first_dtype)
    mx.eval(head.module.parameters())
    return {"steps": steps, "lr": lr, "depth": depth, "batch": batch, "sequences": n, "window": span,
            "seconds": round(time.perf_counter() - t0, 1), "before": before,
            "after": {"depth1_loss": l1.item(), "depth1_agreement": agree.item()}, "curve": curve}


def _leaves(module):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(module.parameters())]


def write_heads(head, model, src: Path, out: Path) -> Path:
    """Write ``head`` as its family's checkpoint tensors into ``out/mtp.safetensors`` and point the index's entries
    for them there (the target's own tensors keep their files); ``out`` other than ``src`` gets links to the rest of
    ``src``'s files. mlx-lm loads ``model*.safetensors`` only, so the target never reads the heads' file."""
    from models.mtp import checkpoint_tensors

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(head, model)
    if out != src:
        for f in src.iterdir():
            if f.name not in (HEADS_FILE, INDEX_FILE) and not (out / f.name).exists():
                os.symlink(f.resolve(), out / f.name)
    index = src / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    else:  # every tensor of every other file, by name
        weight_map = {}
        for f in sorted(src.glob("*.safetensors")):
            if f.name != HEADS_FILE:
                weight_map.update({k: f.name for k in mx.load(str(f))})
    weight_map = {k: v for k, v in weight_map.items() if k not in tensors}
    weight_map.update({k: HEADS_FILE for k in tensors})
    tmp = out / ".mtp-writing.safetensors"  # a dot file: no glob of *.safetensors sees it half-written
    mx.save_safetensors(str(tmp), tensors, metadata={"format": "mlx"})
    os.replace(tmp, out / HEADS_FILE)
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))},
                                             indent=1))
    return out
