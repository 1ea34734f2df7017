"""Per-request speculation counters (``SpecStats``) that the server sums for /stats and /metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["SpecStats"]


@dataclass
class SpecStats:
    """Counters of one request (or, summed with ``+=``, of many).

    - ``rounds``: verify rounds that carried at least one draft token;
    - ``drafted``: draft tokens sent to the target for verification;
    - ``accepted``: draft tokens the target agreed with and that were emitted;
    - ``emitted``: every token the speculative generator yielded (accepted drafts, corrections,
      bonus tokens and plain steps);
    - ``stopped``: requests for which the policy turned drafting off because it did not pay;
    - ``cannot_rewind``: requests that decoded plainly because their model's caches cannot take back a rejected
      draft (recurrent state: linear attention, SSM);
    - ``replayed``: rounds whose rejected drafts were taken back by feeding the kept tokens again (recurrent state
      whose every-position values were not kept: spec.rewind); the rest cost nothing to take back;
    - ``blind``: requests whose MTP heads (spec.mtp) started on a cached prefix whose entry kept none of their state:
      they drafted from the new tokens' hidden states only.
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    stopped: int = 0
    cannot_rewind: int = 0
    replayed: int = 0
    blind: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 before anything was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per round that drafted (0.0 before the first round)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def __iadd__(self, other: "SpecStats") -> "SpecStats":
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.stopped += other.stopped
        self.cannot_rewind += other.cannot_rewind
        self.replayed += other.replayed
        self.blind += other.blind
        return self

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d
