"""The decode batches: one ``Batch`` protocol (protocol.py), its kinds (solo, mlx, ragged, speculating), the one
place a kind is chosen (choose.py), the groups that hold them (groups.py), the logits rules every kind applies
(rules.py), the ragged KV layout (ragged_kv.py) and the batched draft model (drafts.py)."""

from server.engine.batch.choose import BatchKind, CacheFacts, Layout, choose, joins, make, moves, solo_pipelined
from server.engine.batch.groups import BatchGroups
from server.engine.batch.protocol import Batch, Covered, Emitted, GroupKey, LogitsRules, Row, RowDraft

__all__ = ["Batch", "BatchGroups", "BatchKind", "CacheFacts", "Covered", "Emitted", "GroupKey", "Layout",
           "LogitsRules", "Row", "RowDraft", "choose", "joins", "make", "moves", "solo_pipelined"]
