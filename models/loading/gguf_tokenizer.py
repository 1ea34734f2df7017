"""Build a Hugging Face `tokenizer.json` (+ tokenizer_config) from a GGUF file's metadata, torch-free.

A GGUF stores its tokenizer as llama.cpp metadata (`tokenizer.ggml.*`). Two kinds are supported:

- "gpt2": byte-level BPE with explicit merges (SmolLM2, Qwen2). The pre-tokenizer split depends on
  `tokenizer.ggml.pre`: qwen2 and llama3 use their own regexes, everything else gpt2's.
- "llama": sentencepiece-style BPE with byte fallback and no merges; merges are rebuilt from the
  token scores (or, for gemma, from token order, because gemma's scores do not follow merge order).

Token types: 3 (control) become special added tokens, 4 (user-defined) plain added tokens, so they
are matched whole in text. This mirrors transformers' GGUF tokenizer builders, which the oracle
test compares against.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from models.errors import ModelLoadError

__all__ = ["build_tokenizer", "tokenizer_config", "SUPPORTED_TOKENIZERS"]

SUPPORTED_TOKENIZERS = ("gpt2", "llama")
CONTROL, USER_DEFINED = 3, 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}
_NFC_PRE = {"qwen2", "deepseek-r1-qwen"}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece vocabulary: every split of a token into two vocabulary
    pieces, best-scored tokens first (transformers' `generate_merges` with scores)."""
    merges = []
    for token, score in scores.items():
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level(meta: dict[str, Any]) -> Tokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, tok in enumerate(meta["tokenizer.ggml.tokens"]):
        key = tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    split = _SPLITS.get(pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre in _NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], architecture: str) -> Tokenizer:
    tokens = list(meta["tokenizer.ggml.tokens"])
    gemma = architecture.startswith("gemma")
    if gemma:  # gemma stores runs of spaces as real spaces; its merges need them spelled with "▁"
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = generate_merges(vocab, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_marked_tokens(tok: Tokenizer, meta: dict[str, Any], byte_level: bool) -> None:
    """Control tokens -> special added tokens; user-defined ones -> plain added tokens, but only
    under a spelling the vocabulary has (adding any other string would append a new id past the
    model's vocabulary, e.g. gemma's whitespace runs, which the vocabulary spells with "▁")."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ()
    vocab = tok.get_vocab(with_added_tokens=False)
    letters = set(_byte_alphabet().values()) if byte_level else None
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == CONTROL and (letters is None or set(t) <= letters)
    ]
    plain = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types)
        if ty == USER_DEFINED and t in vocab
    ]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)


def _special(meta: dict[str, Any], key: str) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def _add_bos(meta: dict[str, Any]) -> bool:
    default = meta.get("tokenizer.ggml.model") == "llama"  # llama.cpp adds BOS to sentencepiece vocabularies
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def build_tokenizer(meta: dict[str, Any], architecture: str) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the one the GGUF metadata `meta` describes.

    `meta` maps GGUF keys to plain Python values. Raises ModelLoadError for tokenizer kinds
    other than SUPPORTED_TOKENIZERS.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level(meta)
    elif kind == "llama":
        tok = _sentencepiece(meta, architecture)
    else:
        raise ModelLoadError(
            f"this GGUF declares tokenizer {kind!r}; mlx-lane converts only {', '.join(SUPPORTED_TOKENIZERS)} "
            "tokenizers. Convert the original Hugging Face model with mlx_lm.convert instead."
        )
    _add_marked_tokens(tok, meta, byte_level=kind == "gpt2")
    bos, eos = _special(meta, "bos_token_id"), _special(meta, "eos_token_id")
    add_bos = _add_bos(meta) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        ids = {t: tok.token_to_id(t) for t in (bos if add_bos else None, eos if add_eos else None) if t}
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(ids.items()))
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` content: special tokens, BOS policy and the chat template."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context_length),
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        value = _special(meta, key)
        if value is not None:
            cfg[name] = value
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg
