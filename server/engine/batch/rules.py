"""A decode batch's logits rules (logit bias, repetition / presence / frequency penalties, grammar masks) as a few
array operations over all the rows that have them, instead of one small graph per row built in Python.

mlx-lm's processors (``make_logits_processors``) are closures over one row: the logit bias, then the repetition,
presence and frequency penalties over the last ``PENALTY_CONTEXT`` tokens the row has seen, each a gather and a
scatter on that row's logits. Here the same arithmetic, in the same order, runs once over the rows that have any:
one scatter-add counts each token of each row's window into a (rows, vocab) table, then each rule is a whole-array
operation with one value per row (a row without that rule gets its identity: factor 1, penalty 0, which leaves its
logits bit for bit as they were). Grammar masks (llguidance fills them on the host, one matcher per request) are
stacked and applied with one ``where``.

The promise: the same logits as mlx-lm's per-row processors, bit for bit for bias, repetition and presence; for a
frequency penalty on a token seen k > 1 times, ``logit - k * penalty`` instead of k subtractions one by one (a
rounding difference in the last place). Tested against mlx-lm's processors in tests/unit/test_batch_logits.py and,
through whole batches, against mlx-lm's ``GenerationBatch`` in tests/unit/test_ragged_batch.py.

Every decode path applies these rules, and only these: the ragged and speculating batches call ``apply_rules`` /
``penalise`` over all their rows; the paths that run mlx-lm's loops (the solo ``generate_step``, mlx-lm's
``GenerationBatch``, the solo speculative walk) take ``LogitsRules.processors(history)``, the same arithmetic for
one row in mlx-lm's processor shape. How far back penalties look is ``server.engine.sampling.PENALTY_CONTEXT``.
Lane thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from server.engine.sampling import PENALTY_CONTEXT

__all__ = ["Penalties", "LogitsRules", "penalise", "penalty_windows", "mask_rows", "apply_rules"]


@dataclass(frozen=True)
class Penalties:
    """One request's logit bias and penalties (None or 0: not applied, as mlx-lm's ``make_logits_processors``)."""

    logit_bias: Optional[tuple[tuple[int, float], ...]] = None
    repetition: Optional[float] = None
    presence: Optional[float] = None
    frequency: Optional[float] = None

    @classmethod
    def of(cls, params) -> Optional["Penalties"]:
        """The request's rules from its SamplingParams, or None when it has none."""
        p = cls(
            logit_bias=tuple((int(k), float(v)) for k, v in params.logit_bias.items()) if params.logit_bias else None,
            repetition=params.repetition_penalty or None,
            presence=params.presence_penalty or None,
            frequency=params.frequency_penalty or None,
        )
        return p if (p.logit_bias or p.repetition or p.presence or p.frequency) else None

    @property
    def needs_history(self) -> bool:
        return bool(self.repetition or self.presence or self.frequency)


@dataclass(frozen=True)
class LogitsRules:
    """One request's logits rules: its bias and penalties, and its grammar (a ``GrammarProcessor``, stateful: it
    must see each sampled token exactly once, so one row of one decode path holds it at a time)."""

    penalties: Optional[Penalties] = None
    grammar: Any = None

    @classmethod
    def of(cls, params, grammar=None) -> "LogitsRules":
        return cls(Penalties.of(params), grammar)

    @property
    def empty(self) -> bool:
        return self.penalties is None and self.grammar is None

    def processors(self, history: Sequence[int] = ()) -> list:
        """These rules as mlx-lm logits processors (``proc(tokens, logits) -> logits``, ``tokens`` what the loop fed
        since ``history``), for mlx-lm's loops; the same arithmetic as the batches' (``penalise``, ``mask_rows``),
        the window built on the device so that mlx-lm's pipelining keeps its lead."""
        if self.empty:
            return []
        penalties, grammar = self.penalties, self.grammar
        prefix = mx.array(list(history[-PENALTY_CONTEXT:]), dtype=mx.uint32) if history else None

        def process(tokens: mx.array, logits: mx.array) -> mx.array:
            if penalties is not None:
                windows = None
                if penalties.needs_history:
                    seen = tokens.astype(mx.uint32)
                    if prefix is not None:
                        seen = mx.concatenate([prefix, seen])
                    seen = seen[-PENALTY_CONTEXT:][None]
                    windows = (seen, mx.ones(seen.shape, dtype=mx.float32))
                logits = penalise(logits, [penalties], windows)
            if grammar is not None:
                mx.async_eval(logits)  # the forward runs while the host fills the mask
                logits = mask_rows(logits, [grammar.allowed(lambda: int(tokens[-1].item()))])
            return logits

        return [process]


def penalty_windows(histories: Sequence[Sequence[int]], last: Optional[mx.array] = None,
                    size: int = PENALTY_CONTEXT) -> tuple[mx.array, mx.array]:
    """Each row's last ``size`` tokens as ``(tokens, weights)``, both (rows, size): the window right-aligned,
    weight 1 where a token is and 0 in the padding of a row that has seen fewer. ``last`` (rows,), lazy or not, is
    each row's newest token, appended after its host history (a pipelined batch's input is not on the host yet)."""
    host = size - (1 if last is not None else 0)
    tokens = np.zeros((len(histories), host), dtype=np.uint32)
    weights = np.zeros((len(histories), size), dtype=np.float32)
    for i, h in enumerate(histories):
        tail = list(h[-host:]) if host else []
        if tail:
            tokens[i, host - len(tail):] = tail
        weights[i, host - len(tail): host] = 1.0
    if last is not None:
        weights[:, -1] = 1.0
    win = mx.array(tokens)
    if last is not None:
        win = mx.concatenate([win, last.astype(mx.uint32)[:, None]], axis=1)
    return win, mx.array(weights)


def penalise(logits: mx.array, rules: Sequence[Penalties], windows: Optional[tuple[mx.array, mx.array]]) -> mx.array:
    """``logits`` (rows, vocab) after each row's ``rules[i]``, in mlx-lm's order: bias, repetition, presence,
    frequency. ``windows`` (from ``penalty_windows``) is needed when any rule reads history."""
    dtype = logits.dtype
    rows = len(rules)
    bias = [(i, t, v) for i, r in enumerate(rules) if r.logit_bias for t, v in r.logit_bias]
    if bias:
        r_idx, t_idx, vals = zip(*bias)
        logits = logits.at[mx.array(r_idx), mx.array(t_idx)].add(mx.array(vals))
    if not any(r.needs_history for r in rules):
        return logits
    tokens, weights = windows
    vocab = logits.shape[-1]  # an id past the vocabulary (an image's cache-key token, server.core.media) is no
    weights = mx.where(tokens < vocab, weights, 0.0)  # token the model could repeat: it weighs nothing
    tokens = mx.minimum(tokens, vocab - 1)
    counts = mx.zeros(logits.shape, dtype=mx.float32).at[mx.arange(rows)[:, None], tokens].add(weights)
    seen = counts > 0

    def per_row(values):
        return mx.array(values, dtype=mx.float32).astype(dtype)[:, None]

    if any(r.repetition for r in rules):
        p = per_row([r.repetition or 1.0 for r in rules])
        logits = mx.where(seen, mx.where(logits < 0, logits * p, logits / p), logits)
    if any(r.presence for r in rules):
        logits = logits - per_row([r.presence or 0.0 for r in rules]) * seen.astype(dtype)
    if any(r.frequency for r in rules):
        logits = logits - per_row([r.frequency or 0.0 for r in rules]) * counts.astype(dtype)
    return logits


def mask_rows(logits: mx.array, allowed: Sequence[np.ndarray]) -> mx.array:
    """``logits`` (rows, width) with every token row i's ``allowed[i]`` (bool, a grammar's vocabulary, which may be
    shorter or longer than the model's padded logits) does not allow set to -inf: one ``where`` for all rows."""
    width = logits.shape[-1]
    mask = np.zeros((len(allowed), width), dtype=np.bool_)
    for i, a in enumerate(allowed):
        n = min(width, a.shape[0])
        mask[i, :n] = a[:n]
    return mx.where(mx.array(mask), logits, -mx.inf)


def apply_rules(logits: mx.array, rows: Sequence[int], rules: Sequence[Optional[Penalties]],
                grammars: Sequence, histories: Sequence[Sequence[int]], last: mx.array,
                last_host: Callable[[], list]) -> mx.array:
    """A decode batch's ``logits`` (batch, vocab) with the rules of ``rows`` applied: ``rules[j]`` /
    ``grammars[j]`` / ``histories[j]`` belong to row ``rows[j]``; ``last`` (batch,) is every row's newest input and
    ``last_host()`` the same as a list (only called when a grammar needs the token it must advance over)."""
    logits = logits[:]  # item assignment below rewrites the array object it is given: not the caller's
    pen = [j for j, r in enumerate(rules) if r is not None]
    if pen:
        idx = mx.array([rows[j] for j in pen])
        picked = [rules[j] for j in pen]
        windows = None
        if any(r.needs_history for r in picked):
            windows = penalty_windows([histories[j] for j in pen], last[idx])
        logits[idx] = penalise(logits[idx], picked, windows)
    gram = [j for j, g in enumerate(grammars) if g is not None]
    if gram:
        mx.async_eval(logits)  # the forward runs while the host fills the masks
        fed: list = []

        def token(j):
            if not fed:
                fed.extend(last_host())
            return fed[rows[j]]

        allowed = [grammars[j].allowed(lambda j=j: token(j)) for j in gram]
        idx = mx.array([rows[j] for j in gram])
        logits[idx] = mask_rows(logits[idx], allowed)
    return logits
