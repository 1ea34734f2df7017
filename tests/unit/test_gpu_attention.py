"""models.attention.gpu: the columns its fused CUDA kernel lets each query see (``row_ranges``) are exactly what the
batch caches' masks say, for both decode-batch layouts, and the path stays out of the way where it does not apply.

The kernel itself runs only on MLX's CUDA backend; CI has no GPU, so its arithmetic is checked against
``reference_attention`` on the H200 by ``bench/gpu_attention.py --parts check`` (BENCHMARKS.md). What is checked here
is everything around it: the ranges (a wrong range would be silently wrong text on a GPU), the reference the
benchmark holds the kernel to, and when the path is taken."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache

from models.attention import gpu as gpu_attention
from server.engine.batch.ragged_kv import RaggedKV
from tests.fixtures.attention_oracle import theirs_and_ours

KV, D = 2, 16


def _row(n: int, seed: int) -> list:
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, KV, n, D)), mx.random.normal((1, KV, n, D)))
    return [c]


def _new(B: int, W: int, seed: int = 7):
    mx.random.seed(seed)
    return mx.random.normal((B, KV, W, D)), mx.random.normal((B, KV, W, D)), mx.random.normal((B, 3 * KV, W, D))


def _masked(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)


@pytest.mark.parametrize("W", [1, 3])
def test_ragged_rows_ranges_are_the_ragged_mask(W):
    lengths = [5, 17, 1, 9]  # rows of very different lengths, left-aligned in one buffer
    kv = RaggedKV.from_rows([_row(n, i) for i, n in enumerate(lengths)])
    kv.reserve(W)
    layer = kv.layers[0]
    mask = layer.make_mask(W)  # built before the forward writes, as the model does
    nk, nv, q = _new(len(lengths), W)
    keys, values = layer.update_and_fetch(nk, nv)
    start, last = gpu_attention.row_ranges(layer, W)
    assert start.tolist() == [0, 0, 0, 0] and last.tolist() == lengths
    ours = gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last)
    assert mx.allclose(ours, _masked(q, keys, values, mask), atol=1e-5)


@pytest.mark.parametrize("W", [1, 2])
def test_left_padded_rows_ranges_are_mlx_lms_batch_mask(W):
    lengths = [6, 11, 3]
    rows = [_row(n, i) for i, n in enumerate(lengths)]
    batch = KVCache.merge([r[0] for r in rows])  # mlx-lm's BatchKVCache: rows right-justified, left-padded
    mask = batch.make_mask(W)
    nk, nv, q = _new(len(lengths), W)
    keys, values = batch.update_and_fetch(nk, nv)
    start, last = gpu_attention.row_ranges(batch, W)
    assert start.tolist() == [11 - n for n in lengths] and last.tolist() == [11] * 3
    ours = gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last)
    assert mx.allclose(ours, _masked(q, keys, values, mask), atol=1e-5)


def test_caches_without_known_ranges_keep_their_mask():
    assert gpu_attention.row_ranges(KVCache(), 1) is None  # one sequence: MLX's own kernels take it
    batch = KVCache.merge([_row(4, 0)[0], _row(2, 1)[0]])
    batch.prepare(right_padding=[0, 2])  # a batched prefill's right padding: the mask knows more than the ranges
    assert gpu_attention.row_ranges(batch, 1) is None


def test_only_decode_shaped_16_bit_steps_qualify():
    q = mx.zeros((4, 32, 1, 128), dtype=mx.bfloat16)
    k = mx.zeros((4, 8, 300, 128), dtype=mx.bfloat16)
    assert gpu_attention._applies(q, k, k, object())
    assert not gpu_attention._applies(q.astype(mx.float32), k.astype(mx.float32), k.astype(mx.float32), object())
    wide = mx.zeros((4, 32, gpu_attention.MAX_WIDTH + 1, 128), dtype=mx.bfloat16)  # a prefill chunk: cuDNN's
    assert not gpu_attention._applies(wide, k, k, object())
    assert not gpu_attention._applies(q[..., :80], k[..., :80], k[..., :80], object())  # head size 80

    class Quantized:
        bits = 8

    assert not gpu_attention._applies(q, k, k, Quantized())


def test_a_window_layers_ranges_and_sinks_are_what_its_mask_and_mlx_say():
    """A sliding-window layer of the ragged batch: the reference the kernel is checked against (window + sinks)
    equals MLX's attention over the mask the layer gives the model, sinks included."""
    from mlx_lm.models.cache import RotatingKVCache

    def window_row(n, seed, window=6):
        mx.random.seed(seed)
        c = RotatingKVCache(max_size=window, keep=0)
        for i in range(n):  # token by token: the buffer wraps and rotates as a decode's would
            c.update_and_fetch(mx.random.normal((1, 2, 1, D)), mx.random.normal((1, 2, 1, D)))
        return [c]

    lengths = [3, 9, 14]
    kv = RaggedKV.from_rows([window_row(n, i) for i, n in enumerate(lengths)])
    layer = kv.layers[0]
    assert layer.attention_window == 6
    W = 2
    mx.random.seed(9)
    q = mx.random.normal((3, 4, W, D))
    kv.reserve(W)
    keys, values = layer.update_and_fetch(mx.random.normal((3, 2, W, D)), mx.random.normal((3, 2, W, D)))
    mask = layer.make_mask(W)
    start, last = gpu_attention.row_ranges(layer, W)
    sinks = mx.random.normal((4,))
    ours = gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last, window=6, sinks=sinks)
    theirs = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5, mask=mask, sinks=sinks)
    assert mx.allclose(ours, theirs, atol=1e-5)
    # the window really narrows what is seen: without it the answer differs
    assert not mx.allclose(ours, gpu_attention.reference_attention(q, keys, values, D ** -0.5, start, last,
                                                                   sinks=sinks), atol=1e-3)


def test_not_installed_off_cuda():
    from tests.fixtures.tiny_models import tiny_llama

    model = tiny_llama(0)
    assert gpu_attention.install(model) == 0  # this machine's MLX is the CPU build, or no CUDA device
    try:
        gpu_attention.configure(on=False)  # --attention mlx
        assert not gpu_attention.enabled()
    finally:
        gpu_attention.configure()


def test_the_wrapper_hands_what_does_not_apply_to_mlx_lm():
    calls = []

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append(mask)
        return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)

    wrapped = gpu_attention._wrap(original)
    q, k, v = (mx.random.normal((1, 2, 1, 16)) for _ in range(3))
    out = wrapped(q, k, v, cache=KVCache(), scale=0.25, mask=None)  # float32, one row: not the kernel's
    assert calls == [None] and out.shape == (1, 2, 1, 16)


# -- a lone sequence's prompt chunk through the kernel (--debug-gpu-attention-prefill-max) -----------------------


@pytest.fixture
def prefill_on():
    gpu_attention.configure(prefill_max=64)
    try:
        yield
    finally:
        gpu_attention.configure()


PD = 64  # a head size the kernel takes


def _filled(n: int, seed: int) -> KVCache:
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, KV, n, PD)).astype(mx.bfloat16),
                       mx.random.normal((1, KV, n, PD)).astype(mx.bfloat16))
    return c


def _chunk_through(cache, W: int, seed: int, dtype=mx.bfloat16):
    """``cache`` after a forward's W-token chunk as a model runs it: the mask built first, then ``update_and_fetch``."""
    h = mx.zeros((1, W, 8))  # the hidden states the model builds its mask from: only their length counts
    mask = base.create_attention_mask(h, cache, window_size=getattr(cache, "max_size", None))  # gpt-oss's call
    mx.random.seed(seed)
    nk, nv = mx.random.normal((1, KV, W, PD)), mx.random.normal((1, KV, W, PD))
    q = mx.random.normal((1, 3 * KV, W, PD))
    keys, values = cache.update_and_fetch(nk.astype(dtype), nv.astype(dtype))
    return q.astype(dtype), keys, values, mask


@pytest.mark.parametrize("cached", [0, 37, 300])
def test_a_lone_chunks_ranges_are_its_causal_mask(prefill_on, cached):
    """mlx-lm's KVCache after a 16-token chunk over ``cached`` positions: the kernel's (start, last) is what the
    model's "causal" mask (aligned to the last key) says."""
    cache = _filled(cached, 3) if cached else KVCache()
    q, keys, values, mask = _chunk_through(cache, 16, 5)
    assert mask == "causal"
    start, last, window = gpu_attention.prefill_ranges(q, keys, values, cache)
    assert start.tolist() == [0] and last.tolist() == [cached] and window == 0
    f = [a.astype(mx.float32) for a in (q, keys, values)]
    ours = gpu_attention.reference_attention(*f, PD ** -0.5, start, last)
    theirs = mx.fast.scaled_dot_product_attention(*f, scale=PD ** -0.5, mask=mask)
    assert mx.allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize("history, decoded", [(3, 0), (20, 0), (20, 7), (5, 9)])
def test_a_lone_chunks_window_is_its_rotating_caches_mask(prefill_on, history, decoded):
    """mlx-lm's RotatingKVCache (a 12-token window) after prompt chunks and decode steps (its buffer wrapped), then
    a 16-token chunk: its keys come back in position order, and the kernel's range and window are its mask's."""
    from mlx_lm.models.cache import RotatingKVCache

    cache = RotatingKVCache(max_size=12, keep=0)
    mx.random.seed(11)
    if history:
        cache.update_and_fetch(*(mx.random.normal((1, KV, history, PD)).astype(mx.bfloat16) for _ in range(2)))
    for _ in range(decoded):
        cache.update_and_fetch(*(mx.random.normal((1, KV, 1, PD)).astype(mx.bfloat16) for _ in range(2)))
    q, keys, values, mask = _chunk_through(cache, 16, 13)
    start, last, window = gpu_attention.prefill_ranges(q, keys, values, cache)
    assert window == 12 and start.tolist() == [0] and last.tolist() == [keys.shape[2] - 16]
    f = [a.astype(mx.float32) for a in (q, keys, values)]
    sinks = mx.random.normal((3 * KV,))
    ours = gpu_attention.reference_attention(*f, PD ** -0.5, start, last, window=window, sinks=sinks)
    theirs = mx.fast.scaled_dot_product_attention(*f, scale=PD ** -0.5, mask=mask, sinks=sinks)
    assert mx.allclose(ours, theirs, atol=1e-4)


def test_only_lone_16_bit_chunks_within_the_limit_take_the_kernel(prefill_on):
    from mlx_lm.models.cache import RotatingKVCache

    cache = KVCache()
    q, keys, values, _ = _chunk_through(cache, 16, 1)
    assert gpu_attention.prefill_ranges(q, keys, values, cache) is not None
    assert gpu_attention.prefill_ranges(q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32),
                                        cache) is None  # float32: cuDNN's
    short = q[:, :, :gpu_attention.MAX_WIDTH]  # a verify step's width: the composed path's
    assert gpu_attention.prefill_ranges(short, keys, values, cache) is None
    long = mx.zeros((1, 3 * KV, 65, PD), dtype=mx.bfloat16)  # past --debug-gpu-attention-prefill-max 64
    long_kv = mx.zeros((1, KV, 65, PD), dtype=mx.bfloat16)
    assert gpu_attention.prefill_ranges(long, long_kv, long_kv, KVCache()) is None
    rows = mx.concatenate([q, q])  # two rows: a gathered prefill (mlx-lm's batch cache keeps its mask)
    assert gpu_attention.prefill_ranges(rows, mx.concatenate([keys] * 2), mx.concatenate([values] * 2), cache) is None
    assert gpu_attention.prefill_ranges(q, keys, values, RotatingKVCache(max_size=8, keep=4)) is None  # kept tokens
    assert gpu_attention.prefill_ranges(q, keys, values, object()) is None  # a cache whose layout it does not know
    try:
        gpu_attention.PREFILL_PARTIALS_MAX, saved = 1024, gpu_attention.PREFILL_PARTIALS_MAX
        assert gpu_attention.prefill_ranges(q, keys, values, cache) is None  # its partial results would not fit
    finally:
        gpu_attention.PREFILL_PARTIALS_MAX = saved
    S = keys.shape[2]
    try:
        gpu_attention.PREFILL_PAIRS_MAX, saved = 16 * S, gpu_attention.PREFILL_PAIRS_MAX
        assert gpu_attention.prefill_ranges(q, keys, values, cache) is not None  # 16 queries x S keys: at the cap
        gpu_attention.PREFILL_PAIRS_MAX = 16 * S - 1
        assert gpu_attention.prefill_ranges(q, keys, values, cache) is None  # past it: cuDNN's
    finally:
        gpu_attention.PREFILL_PAIRS_MAX = saved
    gpu_attention.configure()  # the default: off
    assert gpu_attention.prefill_ranges(q, keys, values, cache) is None


def test_the_wrapper_sends_a_lone_chunk_to_the_runtime_width_kernel(prefill_on, monkeypatch):
    taken = []

    def kernel(queries, keys, values, scale, start, last, window=0, sinks=None, runtime_width=False):
        taken.append((start.tolist(), last.tolist(), window, runtime_width))
        return gpu_attention.reference_attention(queries, keys, values, scale, start, last, window, sinks)

    monkeypatch.setattr(gpu_attention, "ranged_attention", kernel)
    wrapped = gpu_attention._wrap(lambda *a, **k: pytest.fail("cuDNN's path taken for a lone chunk"))
    cache = _filled(40, 2)
    q, keys, values, mask = _chunk_through(cache, 24, 4)
    out = wrapped(q, keys, values, cache=cache, scale=PD ** -0.5, mask=mask)
    assert taken == [([0], [40], 0, True)] and out.shape == q.shape


def test_the_runtime_width_kernels_read_the_width_from_their_arrays():
    """The prompt-chunk kernels are the decode kernels with ``W`` and ``NCHUNK`` declared from the arrays' shapes
    and the grid (MLX passes ``k_shape`` / ``po_shape`` because the source names them), nothing else changed."""
    fixed, runtime = gpu_attention.kernel_sources(), gpu_attention.kernel_sources(runtime_width=True)
    assert runtime["partial"] == ("  const int W = q_shape[2];\n  const int NCHUNK = gridDim.y / k_shape[1];\n"
                                  + fixed["partial"])
    for name in ("merge", "merge_sinks"):
        assert runtime[name] == "  const int W = po_shape[2];\n" + fixed[name]
    assert "(idx / W) % HQ" in runtime["merge_sinks"]  # the sinks' head index reads the width too


def test_rows_prefilled_together_ranges_are_their_batch_mask(prefill_on):
    """mlx-lm's PromptProcessingBatch: rows of different cached lengths merged (left-padded), chunks of different
    lengths right-padded to the longest (``prepare``), the mask built before the update: each row's range is what
    its mask says, for every query, the padded ones included (a real query never sees a row's padded tail: it comes
    after it)."""
    from mlx_lm.models.cache import BatchKVCache

    rows = [_filled(n, i) for i, n in enumerate([30, 7, 52])]
    batch = BatchKVCache.merge(rows)
    W, lengths = 20, [20, 12, 17]
    batch.prepare(lengths=lengths, right_padding=[W - n for n in lengths])
    mask = base.create_attention_mask(mx.zeros((3, W, 8)), batch)
    mx.random.seed(21)
    q = mx.random.normal((3, 3 * KV, W, PD)).astype(mx.bfloat16)
    keys, values = batch.update_and_fetch(*(mx.random.normal((3, KV, W, PD)).astype(mx.bfloat16) for _ in range(2)))
    start, last, window = gpu_attention.prefill_ranges(q, keys, values, batch)
    assert start.tolist() == [22, 45, 0] and last.tolist() == [52] * 3 and window == 0
    f = [a.astype(mx.float32) for a in (q, keys, values)]
    ours = gpu_attention.reference_attention(*f, PD ** -0.5, start, last)
    theirs = mx.fast.scaled_dot_product_attention(*f, scale=PD ** -0.5, mask=mask)
    assert mx.allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt_oss", "qwen3_5"])
def test_a_models_chunks_through_the_kernels_path_give_mlx_lms_logits(prefill_on, monkeypatch, name):
    """A zoo model (head size 64; gpt-oss with its 16-token windows, which wrap here, and its sinks; Qwen3.5's hybrid,
    its gated delta-net layers beside the attention ones) with the server's
    CUDA attention wrapper, the kernel stood in for by its reference: a 30-token chunk, then a 12-token chunk over
    it, and three rows' chunks of 12, 10 and 7 tokens prefilled together over 30, 9 and 21 cached (mlx-lm's batch
    caches, right padding pending) give mlx-lm's logits, every attention call taken by the kernel's path. In
    float32 (the CPU's mixture-of-experts product takes nothing else), so the wrapper's 16-bit rule is set aside
    here (tested above)."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    from tests.fixtures import zoo

    monkeypatch.setitem(zoo.ZOO, name, {**zoo.ZOO[name], "head_dim": 64})
    model = zoo.build(name, vocab=256, seed=4)
    monkeypatch.setattr(gpu_attention, "_kinds_apply", lambda q, k, v, cache: q.shape[-1] == 64)
    taken = []

    def kernel(queries, keys, values, scale, start, last, window=0, sinks=None, runtime_width=False):
        taken.append((queries.shape[2], window))
        return gpu_attention.reference_attention(queries, keys, values, scale, start, last, window, sinks)

    monkeypatch.setattr(gpu_attention, "ranged_attention", kernel)
    prompt = mx.array([[(11 * i + 5) % 250 + 3 for i in range(42)]])
    cached, chunks = [30, 9, 21], [12, 10, 7]  # three rows prefilled together, as PromptProcessingBatch does them

    def logits() -> list:
        caches = make_prompt_cache(model)
        model(prompt[:, :30], cache=caches)
        alone = model(prompt[:, 30:], cache=caches).astype(mx.float32)
        rows = []
        for n in cached:
            row = make_prompt_cache(model)
            model(prompt[:, :n], cache=row)
            rows.append(row)
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]
        W = max(chunks)
        for c in batch:
            c.prepare(lengths=chunks, right_padding=[W - n for n in chunks])
        tokens = mx.array([[int(t) for t in prompt[0, n: n + k]] + [0] * (W - k) for n, k in zip(cached, chunks)])
        together = model(tokens, cache=batch).astype(mx.float32)
        out = [alone] + [together[b, :k] for b, k in enumerate(chunks)]
        mx.eval(out)
        return out

    theirs, ours = theirs_and_ours(model, gpu_attention._wrap, logits)  # mlx-lm's own as the oracle
    layers = sum(1 for c in make_prompt_cache(model) if not isinstance(c, ArraysCache))  # attention layers
    # every attention layer: the lone row's 30- and 12-token chunks, the three rows' own 30, 9 and 21, then their chunks
    # together (12 wide, right-padded)
    assert [w for w, _ in taken].count(12) == 2 * layers and len(taken) == 6 * layers
    if name == "gpt_oss":
        assert {window for _, window in taken} == {0, zoo.WINDOW}
    for o, t in zip(ours, theirs):
        assert mx.allclose(o, t, atol=1e-3, rtol=1e-4).item()


@pytest.mark.parametrize("history, decoded, lengths", [
    ([5, 20, 9], [0, 3, 0], [16, 10, 13]),  # chunks of different lengths: right padding pending
    ([30, 2, 14], [2, 0, 9], None),  # wrapped windows, equal chunks
    ([40, 40, 1], [5, 0, 0], None),
])
def test_rows_prefilled_together_over_windows_see_what_their_mask_says(prefill_on, history, decoded, lengths):
    """mlx-lm's BatchRotatingKVCache (12-token windows, rows wrapped or not, some right-padded): every real query's
    output is what the mask the model builds gives (a padded query's is discarded)."""
    from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

    def window_row(n, d, seed):
        mx.random.seed(seed)
        c = RotatingKVCache(max_size=12, keep=0)
        if n:
            c.update_and_fetch(*(mx.random.normal((1, KV, n, PD)).astype(mx.bfloat16) for _ in range(2)))
        for _ in range(d):
            c.update_and_fetch(*(mx.random.normal((1, KV, 1, PD)).astype(mx.bfloat16) for _ in range(2)))
        return c

    W = 16
    batch = BatchRotatingKVCache.merge([window_row(n, d, i) for i, (n, d) in enumerate(zip(history, decoded))])
    if lengths:
        batch.prepare(lengths=lengths, right_padding=[W - n for n in lengths])
    mask = base.create_attention_mask(mx.zeros((3, W, 8)), batch, window_size=12)  # gpt-oss's call
    mx.random.seed(5)
    q = mx.random.normal((3, 3 * KV, W, PD)).astype(mx.bfloat16)
    keys, values = batch.update_and_fetch(*(mx.random.normal((3, KV, W, PD)).astype(mx.bfloat16) for _ in range(2)))
    start, last, window = gpu_attention.prefill_ranges(q, keys, values, batch)
    assert window == 12 and last.tolist() == [keys.shape[2] - W] * 3
    f = [a.astype(mx.float32) for a in (q, keys, values)]
    ours = gpu_attention.reference_attention(*f, PD ** -0.5, start, last, window=window)
    theirs = mx.fast.scaled_dot_product_attention(*f, scale=PD ** -0.5, mask=mask)
    for b, n in enumerate(lengths or [W] * 3):
        assert mx.allclose(ours[b, :, :n], theirs[b, :, :n], atol=1e-4), b


# -- masks that carry scores (multi-head latent attention) ---------------------------------------------------------


def test_an_additive_mask_is_never_replaced_by_ranges(monkeypatch):
    """A batch's decode-shaped 16-bit step takes the kernel with a boolean mask (its ranges say the same) and never
    with an additive one, which may carry scores (``scores_in_mask``): that goes to mlx-lm's function, or composed
    for a verify-sized step past cached keys."""
    from mlx_lm.models.cache import BatchKVCache

    taken, handed = [], []
    monkeypatch.setattr(gpu_attention, "ranged_attention", lambda *a, **k: taken.append(1) or a[0])

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        handed.append(mask.dtype)
        return queries

    wrapped = gpu_attention._wrap(original)
    cache = BatchKVCache([0, 0])
    mx.random.seed(3)
    k, v = (mx.random.normal((2, 2, 9, 64)).astype(mx.bfloat16) for _ in range(2))
    keys, values = cache.update_and_fetch(k, v)
    q = mx.random.normal((2, 4, 1, 64)).astype(mx.bfloat16)
    seen = mx.ones((2, 1, 1, 9), dtype=mx.bool_)
    wrapped(q, keys, values, cache=cache, scale=0.125, mask=seen)
    assert taken == [1] and handed == []
    wrapped(q, keys, values, cache=cache, scale=0.125, mask=mx.zeros((2, 4, 1, 9), dtype=mx.bfloat16))
    assert taken == [1] and handed == [mx.bfloat16]
    assert gpu_attention.scores_in_mask(mx.zeros((1,))) and not gpu_attention.scores_in_mask(seen)
    assert not gpu_attention.scores_in_mask("causal") and not gpu_attention.scores_in_mask(None)


def test_latent_attention_rows_verifying_together_give_mlx_lms_logits(monkeypatch):
    """GLM-4.7-Flash's latent attention (the zoo's DeepSeek-V3 layers, 64-wide heads, which the kernel's sizes
    include, as DeepSeek-V3's 128) passes its rotary scores as an additive mask. Three rows verifying 3 tokens
    together over 30, 9 and 21 cached (mlx-lm's ``BatchKVCache``) through the server's CUDA wrapper, the kernel
    stood in for by its reference (float32, the 16-bit rule set aside as above), give mlx-lm's logits: the kernel,
    which knows only each row's visible columns, is not asked (it would drop the rotary part)."""
    from mlx_lm.models.cache import KVCache as Lone

    from tests.fixtures import zoo

    monkeypatch.setitem(zoo.ZOO, "glm4_moe_lite", {**zoo.ZOO["deepseek_v3"], "qk_nope_head_dim": 64,
                                                   "v_head_dim": 64})
    model = zoo.build("glm4_moe_lite", vocab=256, seed=4)
    monkeypatch.setattr(gpu_attention, "_kinds_apply", lambda q, k, v, cache: q.shape[-1] == 64)
    taken = []

    def kernel(queries, keys, values, scale, start, last, window=0, sinks=None, runtime_width=False):
        taken.append(queries.shape[2])
        return gpu_attention.reference_attention(queries, keys, values, scale, start, last, window, sinks)

    monkeypatch.setattr(gpu_attention, "ranged_attention", kernel)
    prompt = [(13 * i + 7) % 250 + 3 for i in range(40)]
    cached = [30, 9, 21]

    def logits():
        rows = []
        for n in cached:
            row = [Lone() for _ in model.layers]
            model(mx.array([prompt[:n]]), cache=row)
            rows.append(row)
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]
        out = model(mx.array([prompt[n: n + 3] for n in cached]), cache=batch).astype(mx.float32)
        mx.eval(out)
        return out

    theirs, ours = theirs_and_ours(model, gpu_attention._wrap, logits)
    assert taken == []
    assert mx.allclose(ours, theirs, atol=1e-4, rtol=1e-4).item()
