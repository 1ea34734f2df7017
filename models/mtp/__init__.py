"""A checkpoint's own multi-token-prediction (MTP) heads, for drafting (spec.mtp).

Public API::

    load_heads(path, model, dtype) -> MtpHead      models.mtp.load (ModelLoadError: none this server can run)
    facts_of(head, model_type) -> models.facts.DraftHeads
    MtpHead: make_caches(), forward(tokens, hidden, caches, mask), logits(out)      models.mtp.heads
    tap(model) -> HiddenTap (.last: the latest forward's hidden states)            models.mtp.tap
    FAMILIES: model type -> head family
    checkpoint_tensors(head, model) -> {name: array}   the head's weights as its family's checkpoints name them
"""

from models.mtp.heads import MtpHead
from models.mtp.load import FAMILIES, checkpoint_tensors, facts_of, load_heads
from models.mtp.tap import HiddenTap, tap, untap

__all__ = ["MtpHead", "FAMILIES", "checkpoint_tensors", "facts_of", "load_heads", "HiddenTap", "tap", "untap"]
