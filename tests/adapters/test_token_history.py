"""TokenHistory: the device-side token context handed to logits processors."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from melix_mlx.runtime.token_history import TokenHistory

chunks = st.lists(st.lists(st.integers(0, 2**20), max_size=300), max_size=8)


@settings(max_examples=40, deadline=None)
@given(first=st.lists(st.integers(0, 2**20), max_size=600), more=chunks)
def test_appends_read_back_exactly_and_earlier_views_never_change(first, more) -> None:
    history = TokenHistory(first)
    expected = list(first)
    views = [(history.upto(), list(expected))]
    for i, chunk in enumerate(more):
        if i % 2:
            history.extend(mx.array(chunk, dtype=mx.uint32))  # device arrays append too
        else:
            history.extend(chunk)
        expected += chunk
        views.append((history.upto(), list(expected)))
        assert len(history) == len(expected)
    assert history.tolist() == expected
    for view, want in views:  # growth and in-place writes left every earlier slice intact
        assert view.tolist() == want and view.dtype == mx.uint32
    if expected:
        assert history.upto(len(expected) - 1).tolist() == expected[:-1]


def test_upto_refuses_a_length_it_does_not_hold() -> None:
    history = TokenHistory([1, 2, 3])
    with pytest.raises(IndexError):
        history.upto(4)
    with pytest.raises(IndexError):
        history.upto(-1)
