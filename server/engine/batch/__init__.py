"""The decode batches: one ``Batch`` protocol (protocol.py), its kinds (solo, mlx, ragged, speculating), the one
place a kind is chosen and built (choose.py), the groups that hold them (groups.py), the logits rules every kind
applies (rules.py), the ragged layouts' storage (ragged_store.py over ragged_kv.py and ragged_states.py) and the
batched draft model (drafts.py)."""

from server.engine.batch.choose import (BatchKind, CacheFacts, Layout, Placement, choose, joins, make, make_solo,
                                        moves, place, solo_pipelined)
from server.engine.batch.groups import BatchGroups
from server.engine.batch.protocol import Batch, Covered, Emitted, GroupKey, LogitsRules, Row, RowDraft, RowState

__all__ = ["Batch", "BatchGroups", "BatchKind", "CacheFacts", "Covered", "Emitted", "GroupKey", "Layout",
           "LogitsRules", "Placement", "Row", "RowDraft", "RowState", "choose", "joins", "make", "make_solo", "moves",
           "place",
           "solo_pipelined"]
