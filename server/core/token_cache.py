"""Tokenizing a chat prompt from pieces already tokenized: an agent resends its whole conversation every turn.

``SegmentEncoder.encode(text)`` returns exactly ``tokenizer.encode(text, add_special_tokens=False)``. The text is cut
right before each special token (``<|im_start|>``, ``<|eot_id|>``, ...): a fast tokenizer splits its input at its
added tokens before anything else, so the pieces between them are tokenized apart, and a piece that begins with a
special token (which absorbs no whitespace to its left) tokenizes the same wherever it stands. Each piece's ids are
kept in a bounded LRU, so a conversation's earlier messages cost a dictionary lookup on the next turn. A 32k-token
conversation took ~68 ms to tokenize whole on this CPU (SmolLM2's tokenizer), on every request, and ~2.4 ms rendered
and looked up here (bench/prompt_tokens.py); a GPU's +1-token forward after a 32k cache hit is a few ms (issue 45).

Exactness is checked, not assumed: a tokenizer whose pieces do not add up (a SentencePiece-style pre-tokenizer that
marks only the first word of the whole text, say) is found by a probe when the encoder is made, and the first
``verify_first`` encodings are compared with the whole-text tokenization; any difference turns the cache off for
that tokenizer for good (logged once), and every encoding is the tokenizer's own from then on.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
import weakref
from collections import OrderedDict
from typing import Optional

log = logging.getLogger("mlx_lane")

__all__ = ["SegmentEncoder", "encoder_for"]

_PROBE_TEXTS = ("hello world", " leading space", "\nnew line\n\n", "trailing  ", "x", "  two  spaces ", "a\tb")


class SegmentEncoder:
    """Exact ``encode(text, add_special_tokens=False)`` of ``tokenizer`` from cached pieces (module docstring).
    Thread-safe: prompts are rendered on a thread pool. ``max_tokens`` bounds the ids kept."""

    def __init__(self, tokenizer, *, max_tokens: int = 2_000_000, verify_first: int = 3):
        self._tokenizer = tokenizer
        self._max_tokens = int(max_tokens)
        self._lock = threading.Lock()
        self._pieces: OrderedDict[str, array] = OrderedDict()  # 4 bytes a token, not a tuple of int objects
        self._held = 0
        self._verify_left = int(verify_first)
        self.hits = self.misses = self.tokens_reused = 0
        self._split = _splitter(tokenizer)
        self.enabled = self._split is not None and self._probe()

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return self._whole(text)
        pieces = self._split(text)
        out: list[int] = []
        for piece in pieces:
            out.extend(self._piece(piece))
        if self._verify_left > 0:
            with self._lock:
                self._verify_left -= 1
            whole = self._whole(text)
            if whole != out:
                self._disable("the pieces' tokens differ from the whole text's")
                return whole
        return out

    def stats(self) -> dict:
        with self._lock:
            return {"enabled": self.enabled, "pieces": len(self._pieces), "tokens_held": self._held,
                    "hits": self.hits, "misses": self.misses, "tokens_reused": self.tokens_reused}

    def _piece(self, piece: str) -> array:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                self.tokens_reused += len(ids)
                return ids
        ids = array("I", self._whole(piece))
        with self._lock:
            self.misses += 1
            if piece not in self._pieces and len(ids) <= self._max_tokens:
                self._pieces[piece] = ids
                self._held += len(ids)
                while self._held > self._max_tokens:
                    _, old = self._pieces.popitem(last=False)
                    self._held -= len(old)
        return ids

    def _whole(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _probe(self) -> bool:
        """Pieces that must add up: texts around, between and after the special tokens, whole vs cut."""
        specials = _boundary_tokens(self._tokenizer)[:3]
        samples = []
        for a in _PROBE_TEXTS:
            for s in specials:
                samples.append(f"{a}{s}user\n{a}{s}{a}")
                samples.append(f"{s}{a}{s}\n{a}")
        try:
            for text in samples:
                if sum((self._whole(p) for p in self._split(text)), []) != self._whole(text):
                    log.info("tokenizer pieces do not add up to the whole text's tokens (%r): the prompt token "
                             "cache is off for this tokenizer", text[:40])
                    return False
        except Exception as exc:  # noqa: BLE001 - any tokenizer oddity: tokenize whole, as before
            log.info("prompt token cache off for this tokenizer: %s", exc)
            return False
        return True

    def _disable(self, why: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self._pieces.clear()
            self._held = 0
        log.warning("prompt token cache turned off for this tokenizer: %s", why)


def _boundary_tokens(tokenizer) -> list[str]:
    """The added special tokens a piece may begin with: special, and absorbing no whitespace to their left."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}  # mlx-lm's wrapper forwards it to HF's
    out = [t.content for t in decoder.values()
           if getattr(t, "special", False) and not getattr(t, "lstrip", False) and getattr(t, "content", "")]
    return sorted(set(out), key=lambda s: (-len(s), s))


def _splitter(tokenizer):
    """``text -> pieces`` cutting right before each boundary token; None without any (nothing to cut at)."""
    tokens = _boundary_tokens(tokenizer)
    if not tokens:
        return None
    pattern = re.compile("|".join(re.escape(t) for t in tokens))

    def split(text: str) -> list[str]:
        starts = [m.start() for m in pattern.finditer(text)]
        cuts = [0] + [s for s in starts if s > 0] + [len(text)]
        return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]

    return split


_ENCODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def encoder_for(tokenizer) -> Optional[SegmentEncoder]:
    """The tokenizer's encoder, made on first use (one per tokenizer object, gone with it); None for a tokenizer
    that cannot be keyed weakly (it is then tokenized whole by the caller)."""
    with _ENCODERS_LOCK:
        try:
            enc = _ENCODERS.get(tokenizer)
        except TypeError:
            return None
        if enc is None:
            enc = SegmentEncoder(tokenizer)
            try:
                _ENCODERS[tokenizer] = enc
            except TypeError:
                return None
        return enc
