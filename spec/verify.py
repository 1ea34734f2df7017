"""The accept/rollback loop: ``speculative_decode``, a generator in the style of mlx-lm's ``generate_step``.

One round: ask the source for up to n drafts (n from the policy); run ONE target forward over
``[pending] + drafts``; sample every position with the request's own sampler (logits processors
see, at position i, the history plus the first i drafts); accept drafts while the target's
token equals the draft (``spec.accept``, the walk the batched verifier uses too); emit the accepted drafts, then the target's token at the first
mismatch (the correction) or after the last draft (the bonus). The target's caches take back
the rejected drafts (``spec.rewind``: also a sliding window that has wrapped) and the source is
told what was kept (``source.commit``). Caches that cannot take anything back (recurrent state)
decode plainly from the first token: a request never fails for its model's cache classes.

Greedy output is token-for-token what plain greedy decoding (``generate_step``) produces.
Sampled output follows mlx-lm's ``speculative_generate_step`` rule: each position's token is
drawn from the target's (processed) distribution given the accepted prefix, and a draft is
kept only when it equals that draw - so the output is distributed exactly as plain sampling,
though the random stream is consumed differently (the same seed gives the same text across
speculative runs, not the same text as a plain run).

When the policy stops drafting, the rest of the request is delegated to mlx-lm's pipelined
``generate_step`` on the same caches, so a request whose drafts do not pay runs at plain speed (``pipelined`` False:
it goes on one token a round instead, feeding nothing ahead, so that it can still be handed over). A source that reads
the target's hidden states (``hears_hidden``: spec.mtp) hears every forward that fed its sequence (``heard``, right
after the verify forward and after the last token is fed at the end); it is handed over to ``generate_step``, whose
forwards it does not hear, only where it can recompute them later (plain KV caches: spec.mtp ``catch_up``); over
recurrent state its policy pauses instead of stopping.

Handing the sequence over (``HandOver`` thrown into the generator at a yield, by a decoder whose row joins a batch):
it settles as ``close()`` does but leaves the last yielded token unfed, its next input, so the caches cover the
sequence but that token, which is what a batch's row starts from; recurrent state and wrapped windows could not be
cut back to it. Where that token was an accepted draft (the verify forward fed it), it is taken back with the
rejected ones. Not once plain decoding took over (it fed ahead): ``pipelined`` False keeps that from happening.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Generator, Optional, Sequence, cast

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import greedy_sampler

from spec.accept import accept
from spec.adaptive import FixedDraftLength
from spec.rewind import VerifyRewind, can_rewind
from spec.source import DraftSource, HearingDraftSource
from spec.stats import SpecStats

__all__ = ["speculative_decode", "HandOver", "READ_DRAFTS_WITH_VERDICT"]

# False: a source's drafts are read before the verify forward is built, even where it can hand them over unread
# (``draft_lazy``); bench/mtp_fit.py --reads wait measures the difference
READ_DRAFTS_WITH_VERDICT = True


class HandOver(Exception):
    """Thrown into ``speculative_decode`` at a yield: settle with the last yielded token unfed (the module docstring);
    it comes back out of ``throw``. A ``RuntimeError`` comes out instead where plain decoding had taken over."""


def speculative_decode(
    model,
    caches: list,
    first_token_input: int | Sequence[int] | mx.array,
    source: DraftSource,
    *,
    sampler=None,
    logits_processors: Optional[list] = None,
    max_tokens: int = 256,
    num_draft_tokens: int = 3,
    stream=None,
    policy=None,
    stats: Optional[SpecStats] = None,
    pipelined: bool = True,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` one token at a time, at most ``max_tokens``.

    Preconditions: ``caches`` (the target's) cover the prompt except its last
    token, which is ``first_token_input``; the source has been ``prefill``-ed with the same
    tokens. ``logits_processors`` get, like in ``generate_step``, the tokens fed since
    ``first_token_input`` (wrap them to prepend older history). ``policy`` (default: a fixed
    length ``num_draft_tokens``) is capped at ``num_draft_tokens``. ``stats`` is updated in
    place as tokens are emitted.

    Invariant: after the generator is closed (exhausted, ``close()``d at any yield, or dropped
    by a consumer that found EOS or a stop string inside a draft), the target caches cover
    prompt + every yielded token - the same state plain ``generate_step`` leaves, which is what
    the lane stores in the prompt cache - and the source has been ``commit``-ted, so its own
    caches cover a prefix of that sequence (``source.prefill(prompt + generated)`` completes
    them). If an exception escapes the model, the caches are trimmed but the last token is not
    fed again.
    """
    rewindable = can_rewind(caches)  # else: plain decoding (stats.cannot_rewind)
    rewinder = VerifyRewind(model, caches)
    hears = bool(getattr(source, "hears_hidden", False))
    pos = _covered(caches)  # positions the target's caches cover: where the next forward feeds
    if isinstance(first_token_input, mx.array):
        first_token_input = first_token_input.tolist()
    if not isinstance(first_token_input, int):
        (first_token_input,) = list(first_token_input)
    sampler = sampler or greedy_sampler
    processors = list(logits_processors or [])
    policy = policy if policy is not None else FixedDraftLength(num_draft_tokens)
    stats = stats if stats is not None else SpecStats()
    ctx = mx.stream(stream) if stream is not None else contextlib.nullcontext()

    pending = int(first_token_input)  # last token of the sequence, not yet fed to the target
    history = [pending]  # tokens fed since first_token_input, plus pending (for processors)
    feed = [pending]  # joined the sequence since the source last heard
    ntoks = 0
    over = 0  # tokens in the target caches beyond the yielded sequence (unverified/unyielded drafts)
    unfed = True  # the last token of the sequence is not in the target caches
    drafts: list[int] = []
    fed: list[int] = []  # the tokens the latest verify forward fed
    walked = 0  # drafts of the open round emitted so far
    open_round = False
    unheard = False  # the latest verify forward's kept positions are not heard yet (a source that hears)
    lazy = getattr(source, "draft_lazy", None) if READ_DRAFTS_WITH_VERDICT else None  # unread drafts (spec.mtp)
    proposed: Optional[mx.array] = None  # the open round's drafts until the verify forward read them
    plain = None  # generate_step, once drafting stopped

    def hear(tokens: list[int]) -> None:
        nonlocal pos, unheard
        unheard = False
        if hears:
            cast(HearingDraftSource, source).heard(pos, tokens)
        pos += len(tokens)

    def take_back() -> None:
        nonlocal over
        replays = rewinder.replays
        rewinder.take_back(over, fed)
        over = 0
        stats.replayed += rewinder.replays - replays

    def settle() -> None:
        nonlocal over, open_round, unfed
        exc = sys.exc_info()[1]
        handing = isinstance(exc, HandOver)
        if handing and open_round and walked:
            # handed over at an accepted draft's yield: the verify forward fed that draft, and it is the sequence's
            # next input now, so it goes back too
            over += 1
        if over:
            take_back()
        if open_round:
            open_round = False
            source.commit(drafts if proposed is None else proposed, walked)  # unread: the verify forward failed
        clean = exc is None or handing or isinstance(exc, GeneratorExit)
        if unheard and clean:
            hear(fed[: 1 + walked])
        if plain is not None:
            plain.close()
            if handing:
                raise RuntimeError("cannot hand over: plain decoding fed the sequence ahead") from exc
            return
        if unfed and ntoks and clean and not handing:
            model(mx.array([[pending]]), cache=caches)
            hear([pending])
            mx.eval([c.state for c in caches])
            unfed = False

    with ctx:
        try:
            while ntoks < max_tokens:
                if not rewindable:
                    stats.cannot_rewind = 1
                    break
                n = min(policy.next_length(), num_draft_tokens, max_tokens - ntoks - 1)
                if policy.stopped:
                    if not stats.stopped:
                        stats.stopped = 1
                    # plain decoding from here on, pipelined; a source that hears the target follows it only where
                    # it can recompute what it missed later (plain KV), else it goes on hearing one token a step;
                    # not pipelined: one token a step too, so the sequence can still be handed over
                    if pipelined and (not hears or cast(HearingDraftSource, source).can_catch_up(caches)):
                        break
                    n = 0
                drafts, proposed = [], None
                if n > 0 or hears:  # a source that hears is told every token, drafting or not
                    if lazy is not None:  # drafts not read yet: read with the verdict, in one wait
                        proposed = lazy(feed, n)
                    else:
                        drafts = source.draft(feed, n)
                    feed = []
                    got = len(drafts) if proposed is None else proposed.shape[0]
                    if got > n:
                        raise RuntimeError(f"draft source proposed {got} tokens, asked for {n}")
                open_round = bool(drafts) or proposed is not None
                walked = 0
                with rewinder.verifying():
                    tokens, logprobs, drafts = _verify(model, caches, pending, drafts if proposed is None else proposed,
                                                       history, sampler, processors)
                proposed = None
                over, unfed, fed, unheard = len(drafts), False, [pending] + list(drafts), True
                if drafts:
                    stats.rounds += 1
                    stats.drafted += len(drafts)
                a = accept(drafts, tokens)
                for i in range(a):  # a consumer may stop at any of them (EOS, a stop string inside the draft)
                    walked = i + 1
                    over -= 1
                    ntoks += 1
                    stats.accepted += 1
                    stats.emitted += 1
                    yield tokens[i], logprobs[i], True
                # correction (a < len(drafts)) or bonus (a == len(drafts)) from the target
                if over:
                    take_back()
                if open_round:
                    open_round = False
                    source.commit(drafts, a)
                    policy.update(len(drafts), a)
                hear(fed[: 1 + a])
                pending = tokens[a]
                history.extend(drafts[:a])
                history.append(pending)
                feed.append(pending)
                unfed = True
                ntoks += 1
                stats.emitted += 1
                yield pending, logprobs[a], False
            else:
                return
            # drafting stopped: the rest runs on mlx-lm's pipelined plain decode
            plain = generate_step(
                mx.array([pending], mx.uint32),
                model,
                stream if stream is not None else mx.default_stream(mx.default_device()),
                max_tokens=max_tokens - ntoks,
                sampler=sampler,
                logits_processors=_with_prefix(processors, history[:-1]),
                prompt_cache=caches,
            )
            for token, lp in plain:
                unfed = False
                pending = token
                ntoks += 1
                stats.emitted += 1
                yield token, lp, False
        finally:
            settle()


def _covered(caches: list) -> int:
    """Positions the caches cover (the longest attention layer's offset; recurrent state has none)."""
    return max((int(c.offset) for c in caches if isinstance(getattr(c, "offset", None), int)), default=0)


def _verify(model, caches, pending: int, drafts: list[int] | mx.array, history: list[int], sampler, processors):
    """One target forward over [pending] + drafts; the sampled token and logprobs at every position, and the drafts
    as a list (an array of drafts, not read yet, is read in the same wait as the tokens)."""
    if isinstance(drafts, mx.array):
        window = mx.concatenate([mx.array([pending], mx.uint32), drafts.astype(mx.uint32)])
    else:
        window = mx.array([pending] + drafts, mx.uint32)
    width = window.shape[0]
    logits = model(window[None], cache=caches)[0]  # (n+1, vocab)
    if processors:
        base = mx.array(history, mx.uint32)
        ys, lps = [], []
        for i in range(width):
            seen = mx.concatenate([base, window[1 : i + 1]]) if i else base
            row = logits[i : i + 1]
            for proc in processors:
                row = proc(seen, row)
            lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
            ys.append(sampler(lp))
            lps.append(lp)
        tokens, logprobs = mx.concatenate(ys, axis=0), mx.concatenate(lps, axis=0)
    else:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = sampler(logprobs)
    mx.eval(tokens, logprobs, window)
    return tokens.tolist(), logprobs, window[1:].tolist()


def _with_prefix(processors: list, prefix: list[int]) -> list:
    if not processors or not prefix:
        return processors
    head = mx.array(prefix, mx.uint32)

    def wrap(proc):
        return lambda tokens, logits: proc(mx.concatenate([head, tokens.astype(mx.uint32)]), logits)

    return [wrap(p) for p in processors]
