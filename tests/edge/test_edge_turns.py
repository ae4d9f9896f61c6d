"""Tenants take turns at having their large requests read (edge/turns.py): round robin between tenants, each
tenant's in order, a bounded line each."""

from __future__ import annotations

import pytest

from edgepath.edge.turns import Turns


def test_tenants_take_turns_and_each_tenants_requests_keep_their_order() -> None:
    turns: Turns[str] = Turns(per_tenant=3)
    for item in ("a1", "a2", "a3"):
        assert turns.add("a", item)
    assert turns.add("b", "b1")
    assert [turns.next() for _ in range(5)] == ["a1", "b1", "a2", "a3", None]
    assert len(turns) == 0


def test_a_tenants_full_line_refuses_more_and_leaves_the_others_alone() -> None:
    turns: Turns[int] = Turns(per_tenant=2)
    assert turns.add("a", 1) and turns.add("a", 2) and not turns.add("a", 3)
    assert turns.add("b", 4) and len(turns) == 3
    assert turns.next() == 1 and turns.add("a", 5)  # a place in a's line came free
    with pytest.raises(ValueError, match="at least 1"):
        Turns(per_tenant=0)
