"""Fit a checkpoint's multi-token-prediction head to its own target (issue 44 item 5), for bench/mtp_fit.py.

Random weights give a head that never agrees with its model, so a speed figure for MTP needs a head fitted to the
model it drafts for. This trains only the MTP module (the target, its embedding and its output head stay frozen) on
the target's own greedy continuations, with the loss the drafts are judged by:

  depth 1   the entry at position q (the embedding of S[q] and the target's hidden state H[q-1]) predicts the
            target's greedy token after q, argmax(head(H[q])): what a verify step accepts
  depth d   (2..4) the entry fed its own depth-(d-1) output as the hidden state and the target's token as the next
            token predicts the token after that (positions where the sequence took the target's tokens only): what
            the d-th chained draft needs. For Qwen-family heads (Qwen3.5, Qwen3-Next) its attention is the one
            inference runs (``chain_forward``): the depth-1 entries up to its position and its own chain's entries,
            at the chain's positions. Other families keep an approximation at depth 2 (attention over the depth-2
            entries of earlier positions), which the acceptance measured afterwards judges. With the approximation a
            head fitted to a 9B-shape Qwen3.5 (H200, 12-07) held its first draft always and its second 47% of the
            time, its depth-2 loss 20x its depth-1 loss

Parts, each used by bench/mtp_fit.py:

    build_target_with_heads(shape, out, dtype, tokenizer_dir, vocab)   bench/gpu.py's random shape + untrained heads
    fit_prompts(tokenizer, n, tokens, seed)     windows of Python's own standard library sources (not the prompts the
                                                fitted head is measured on)
    continuations(model, prompts, new_tokens)   the target's greedy continuations, batched
    fit(loaded, head, sequences, steps, ...)    AdamW on the module's parameters; the loss curve; experts gathered
                                                or dense (a mixture-of-experts head)
    grad_norms(grads)                           the first step's gradient norm per parameter group
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


def grad_norms(grads) -> dict[str, float]:
    """The gradient's norm per parameter group (a path up to its third part, e.g. ``layers.0.mlp``, or the first
    parameter name past a group of experts): which parts of the head a step trains at all."""
    from mlx.utils import tree_flatten

    sums: dict[str, mx.array] = {}
    for name, g in tree_flatten(grads):
        parts = name.split(".")
        group = ".".join(parts[:4] if "switch_mlp" in parts or "experts" in parts else parts[:3])
        sq = (g.astype(mx.float32) ** 2).sum()
        sums[group] = sums[group] + sq if group in sums else sq
    return {k: round(float(mx.sqrt(v).item()), 6) for k, v in sorted(sums.items())}


def fit(loaded, head, tap, sequences: list[list[int]], steps: int, lr: float = 1e-3, depth: int = 2,
        batch: int = 4, log_every: int = 25, seed: int = 0, experts: str = "gather") -> dict:
    """Train ``head.module`` (only) on ``sequences`` of one length (see the module docstring); it ends in the
    target's dtype. Returns the loss curve, the first step's gradient norm per parameter group (``grad_norms``) and
    the depth-1 agreement on the training positions, first and last.

    ``experts``: how a mixture-of-experts head (GLM-4.7-Flash's, DeepSeek's) computes its experts while it trains:
    ``gather`` (mlx-lm's ``gather_mm``, sorted; its gradient on CUDA is mlx's ``GatherMM`` vjp) or ``dense`` (every
    expert for every training token as batched matrix products, models.kernels.moe, then each token's own: the same
    sums without a gather, so no ``GatherMM`` gradient; tests/unit/test_mtp_fit_chain.py: the same gradient). Built
    when a 10-layer GLM-4.7-Flash head stalled on the H100 (12-07) at a depth-1 loss of 3.3; the cause was its
    learning rate (3e-3; from 768 wide a DeepSeek-style head fits at 1e-3 on the CPU, and the 10-layer shape at 3e-4
    on the H200, BENCHMARKS.md), not the gather."""
    if experts not in ("gather", "dense"):
        raise ValueError(f"experts {experts!r}: gather or dense")
    if experts == "dense":
        from models.kernels import moe

        switched = moe.switch(head.module)
        saved = moe.DENSE_MAX
        moe.DENSE_MAX = 1 << 30
        try:
            return {**_fit(loaded, head, tap, sequences, steps, lr, depth, batch, log_every, seed),
                    "experts": experts, "expert_layers_dense": switched}
        finally:
            moe.DENSE_MAX = saved
    return {**_fit(loaded, head, tap, sequences, steps, lr, depth, batch, log_every, seed), "experts": experts}


def _fit(loaded, head, tap, sequences: list[list[int]], steps: int, lr: float, depth: int, batch: int,
         log_every: int, seed: int) -> dict:
    from models.mtp.heads import DEEPSEEK, QWEN, SHAPES

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

    exact = head.family in (QWEN, DEEPSEEK)

    def losses(s, h, a):
        tok, hid, lab1 = s[:, 1:-1], h[:, :-2], a[:, 1:-1]
        caches = head.make_caches()
        causal = mx.tril(mx.ones((tok.shape[1], tok.shape[1]), dtype=mx.bool_))[None, None]  # an array: a
        # DeepSeek-style layer's latent attention takes no "causal" string
        out1 = forward(head.module, embed(tok), hid.astype(mx.float32), caches, causal)
        logits1 = head.logits(out1.astype(hid.dtype)).astype(mx.float32)
        l1 = nn.losses.cross_entropy(logits1, lab1).mean()
        agree = (mx.argmax(logits1, axis=-1) == lab1).astype(mx.float32).mean()
        if depth < 2:
            return l1, (l1, agree)
        if exact:
            return l1 + chain_losses(head.family, head.module, embed, head.logits, caches, s, a, out1, hid.dtype,
                                     depth), (l1, agree)
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
    norms: dict[str, float] = {}
    for step in range(steps):
        s, h, a = windows([rng.randrange(n) for _ in range(batch)])
        if before is None:
            l1, agree = losses(s, h, a)[1]
            before = {"depth1_loss": l1.item(), "depth1_agreement": agree.item()}
        loss, grads = grad_fn(s, h, a)
        if step == 0:
            norms = grad_norms(grads)
            print(f"  gradient norms at step 0: {norms}", flush=True)
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
            "seconds": round(time.perf_counter() - t0, 1), "before": before, "grad_norms": norms,
            "after": {"depth1_loss": l1.item(), "depth1_agreement": agree.item()}, "curve": curve}


def chain_forward(family: str, module, embeds: mx.array, hidden: mx.array, e1: list, chain: list,
                  d: int) -> tuple[mx.array, list]:
    """A head's depth-``d`` entries (d >= 2) for every window position j at once, with the attention its inference
    runs (spec.mtp ``draft_lazy``): the entry of position j + d - 1 sees the depth-1 entries of positions 0..j (``e1``:
    each layer's (keys, values) from the depth-1 forward) and its own chain's entries of depths 2..d-1 (``chain``:
    per depth, each layer's (keys, values)), itself last; its rotary position is j + d - 1. ``embeds`` (B, L, H) the
    chain's tokens' embeddings, ``hidden`` the depth-(d-1) outputs. Qwen-family heads (mlx-vlm's layers, positions
    given) and DeepSeek-style ones (the target's own decoder layer, GLM-4.7-Flash's multi-head latent attention
    included: positions from the cache's offset). Returns the outputs and this depth's (keys, values) per layer, to
    append to ``chain``."""
    from models.mtp.heads import DEEPSEEK, QWEN

    B, L, _ = embeds.shape
    width = L * d  # keys: the depth-1 entries, then one block of L per earlier chain depth, then this depth's
    rows = mx.arange(L)[:, None]
    cols = mx.arange(L)[None, :]
    mask = mx.concatenate([cols <= rows] + [cols == rows] * (d - 1), axis=1)[None, None]  # (1, 1, L, L * d)
    made = []
    if family == QWEN:
        h = module.fc(mx.concatenate([module.pre_fc_norm_embedding(embeds), module.pre_fc_norm_hidden(hidden)],
                                     axis=-1))
        positions = mx.tile((mx.arange(L) + d - 1)[None, None], (3, 1, 1))  # Qwen3.5's 3 rotary sections, one text
        for i, layer in enumerate(module.layers):
            cache = _ChainCache([e1[i]] + [c[i] for c in chain], offset=width - L - 1)  # the layer reads offset +
            # L + 1 mask columns: all of them
            h = layer(h, mask=mask, cache=cache, position_ids=positions)
            made.append(cache.made)
        return module.norm(h), made
    if family == DEEPSEEK:
        h = module.eh_proj(mx.concatenate([module.enorm(embeds), module.hnorm(hidden)], axis=-1))
        cache = _ChainCache([e1[0]] + [c[0] for c in chain], offset=d - 1)  # its rotary offset: j + d - 1
        h = module.block(h, mask, cache)
        return module.norm(h), [cache.made]
    raise ValueError(f"no chained fit for {family} heads")


class _ChainCache:
    """What a head's attention layer reads as its cache in ``chain_forward``: keys and values held before this
    depth's, then this depth's (kept in ``made``)."""

    def __init__(self, held: list, offset: int):
        self.held, self.offset, self.made = held, offset, None

    def update_and_fetch(self, keys, values):
        self.made = (keys, values)
        return (mx.concatenate([k for k, _ in self.held] + [keys], axis=2),
                mx.concatenate([v for _, v in self.held] + [values], axis=2))


def chain_losses(family: str, module, embed, logits_of, caches: list, s, a, out1, dtype, depth: int) -> mx.array:
    """Depths 2..``depth`` of a Qwen-family head, exactly as inference chains them (``chain_forward``), on the
    depth-1 forward's entries (``caches``, one KVCache per layer) and outputs (``out1``): the sum of each depth's
    mean cross-entropy over the positions where the sequence took the target's tokens."""
    L = out1.shape[1]
    e1 = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
    pad = lambda x, n: mx.concatenate([x, mx.zeros((x.shape[0], n), x.dtype)], axis=1)  # noqa: E731
    # position j of the window (0..L-1) is sequence position j + 1; the token after it is a[:, j + 1]
    took = mx.ones((s.shape[0], L), mx.float32)
    total = mx.array(0.0)
    hidden, chain = out1, []
    for d in range(2, depth + 1):
        # the d-th draft's input token is the target's token after position j + d - 1, a[j + d - 1]; its label
        # a[j + d]; the sequence must have taken the target's tokens up to there (s[j + d] == a[j + d - 1])
        n = min(L, s.shape[1] - d)  # window positions with a label at this depth
        if n <= 0:
            break
        toks = pad(a[:, d - 1: d - 1 + n], L - n)
        labels = pad(a[:, d: d + n], L - n)
        took = took * pad((s[:, d: d + n] == a[:, d - 1: d - 1 + n]).astype(mx.float32), L - n)
        out, made = chain_forward(family, module, embed(toks), hidden.astype(mx.float32), e1, chain, d)
        logits = logits_of(out.astype(dtype)).astype(mx.float32)
        total = total + (nn.losses.cross_entropy(logits, labels) * took).sum() / mx.maximum(took.sum(), 1)
        hidden, chain = out, chain + [made]
    return total


def SHAPES_FOR_TEST(head):
    """The family's forward of a head (models.mtp.heads.SHAPES), for tests/unit/test_mtp_fit_chain.py."""
    from models.mtp.heads import SHAPES

    return SHAPES[head.family]


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
