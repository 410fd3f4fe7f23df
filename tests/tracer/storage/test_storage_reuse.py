"""Byte reuse on its own (tracer.storage._reuse): what a step's earlier records let a new record
skip, planned without a writer, a file or a step."""
from __future__ import annotations

import torch

from tracer.storage._reuse import SAME_LAYOUT, ReuseIndex, Within


def test_an_unchanged_tensor_reuses_its_first_record():
    index = ReuseIndex(keep_bytes=False)
    t = torch.randn(8)
    holder, shared, skip = index.plan(t, True)
    assert holder == [None, None] and shared is None and not skip
    again = index.plan(t, True)
    assert again[2] and again[0] is holder
    t.mul_(2)  # a new version: measured again, into a new holder
    changed = index.plan(t, True)
    assert not changed[2] and changed[0] is not holder


def test_an_unstable_tensor_is_neither_matched_nor_offered():
    index = ReuseIndex(keep_bytes=False)
    t = torch.randn(8)
    assert index.plan(t, False) == (None, None, False)
    assert not index.plan(t, True)[2]  # nothing was offered for it


def test_views_of_one_span_share_its_record_and_read_its_bytes_with_their_strides():
    index = ReuseIndex(keep_bytes=True)
    x = torch.randn(6, 4)
    holder = index.plan(x, True)[0]
    assert index.plan(x.view(-1), True) == (holder, "", True)
    assert index.plan(x.t(), True) == (holder, "1,4", True)  # the span, read in its own order


def test_the_same_tensor_by_identity_keeps_its_first_layout():
    index = ReuseIndex(keep_bytes=True)
    x = torch.randn(6, 4)[:, :2]  # not a dense span: found by identity
    holder = index.plan(x, True)[0]
    assert index.plan(x, True) == (holder, SAME_LAYOUT, True)


def test_a_slice_of_a_stored_span_points_into_its_bytes():
    index = ReuseIndex(keep_bytes=True)
    x = torch.randn(6, 4)
    holder = index.plan(x, True)[0]
    _, within, skip = index.plan(x[1:3, 1:], True)
    assert type(within) is Within and not skip
    assert within.holder is holder
    assert within.delta == (1 * 4 + 1) * 4  # bytes from x's first element to the slice's
    assert within.nbytes == (4 + 3) * 4 and within.strides == "4,1"
    # without kept bytes there is nothing to point into
    stats_only = ReuseIndex(keep_bytes=False)
    stats_only.plan(x, True)
    assert stats_only.plan(x[1:3, 1:], True)[1] is None


def test_a_parameter_snapshot_points_at_the_record_of_its_parameter_once():
    index = ReuseIndex(keep_bytes=True)
    p = torch.randn(5, 3)
    holder = index.plan(p, True)[0]  # the op that read the weight in forward
    snap = p.clone()
    index.same_bytes(snap, p)
    # (share, shared, measure, copy): no copy, the bytes are stored
    assert index.decide(snap, True, None, measured=True) == (holder, "", False, False)
    assert index.decide(snap, True, None, measured=True) == (None, None, False, True)  # once
    # statistics mode stores no bytes to point at
    stats_only = ReuseIndex(keep_bytes=False)
    stats_only.plan(p, True)
    stats_only.same_bytes(snap, p)
    assert stats_only.decide(snap, True, None, measured=True) == (None, None, False, False)


def test_decide_says_what_a_record_needs():
    index = ReuseIndex(keep_bytes=True)
    t = torch.randn(8)
    assert index.decide(t, True, None, False)[2:] == (True, True)  # measure and copy
    assert index.decide(t, True, None, False)[2:] == (False, False)  # reused whole
    part = torch.randn(4, 4)
    index.decide(part, True, None, False)
    within = index.decide(part[1:, 1:], True, None, False)
    assert type(within[1]) is Within and within[2:] == (True, False)  # bytes stored


def test_forget_and_reset_drop_what_was_seen():
    index = ReuseIndex(keep_bytes=False)
    a, b = torch.randn(4), torch.randn(4)
    index.plan(a, True)
    index.plan(b, True)
    index.forget([a])  # about to be written by an op that may not bump its version
    assert not index.plan(a, True)[2] and index.plan(b, True)[2]
    index.reset()
    assert not index.plan(b, True)[2]
