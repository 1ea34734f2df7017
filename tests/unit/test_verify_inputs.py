"""server.engine.batch.verify_inputs: a speculating batch's verify step from drafts read and unread. Unread rows
enter as columns of their drafter's array (no read), in their own row order, padded past their drafter's longest
draft; the lengths are known before the read; reading tells the drafter once. No model: an OpenDrafts over an array."""

from __future__ import annotations

import mlx.core as mx

from server.engine.batch.draft_rows import OpenDrafts
from server.engine.batch.verify_inputs import UnreadDraft, draft_lengths, read_drafts, unread_arrays, verify_inputs


class Source:
    def __init__(self):
        self.recorded: list = []

    def record_draft(self, d):
        self.recorded.append(list(d))


def test_unread_drafts_enter_as_their_drafters_columns_and_read_once():
    # the drafter's rows 0..2 drafted [11, 12], [21], [31, 32] (row 1's third column is not its draft)
    sources = [Source(), Source(), Source()]
    array = mx.array([[11, 12], [21, 99], [31, 32]], dtype=mx.uint32)
    # asked in the order: drafter rows 2, 0, 1 (batch rows 1, 3, 0)
    open_ = OpenDrafts(array, rows=[2, 0, 1], lengths=[2, 2, 1], sources=[sources[2], sources[0], sources[1]])
    drafts = [UnreadDraft(open_, 2), UnreadDraft(open_, 0), [5, 6, 7], UnreadDraft(open_, 1), []]
    pending = [100, 101, 102, 103, 104]
    assert draft_lengths(drafts) == [1, 2, 3, 2, 0]
    width = 1 + max(draft_lengths(drafts))
    inputs = verify_inputs(pending, drafts, width)
    assert not any(s.recorded for s in sources)  # nothing read to build the step
    rows = inputs.tolist()
    assert [r[: 1 + n] for r, n in zip(rows, draft_lengths(drafts))] == [
        [100, 21], [101, 31, 32], [102, 5, 6, 7], [103, 11, 12], [104]]
    assert rows[3][3] == 0 and rows[4] == [104] * 4  # padding past a drafter's longest draft; an eager row's own
    assert len(unread_arrays(drafts)) == 1
    got = read_drafts(drafts)
    assert got == [[21], [31, 32], [5, 6, 7], [11, 12], []]
    assert [s.recorded for s in sources] == [[[11, 12]], [[21]], [[31, 32]]]
    read_drafts(drafts)
    assert [len(s.recorded) for s in sources] == [1, 1, 1]  # read once


def test_a_drafter_that_drafted_nothing_leaves_the_rows_their_pending_token():
    open_ = OpenDrafts(None, rows=[0, 1], lengths=[0, 0], sources=[Source(), Source()])
    drafts = [UnreadDraft(open_, 0), [9], UnreadDraft(open_, 1)]
    assert draft_lengths(drafts) == [0, 1, 0] and unread_arrays(drafts) == []
    assert verify_inputs([1, 2, 3], drafts, 2).tolist() == [[1, 1], [2, 9], [3, 3]]
    assert read_drafts(drafts) == [[], [9], []]
