"""Arranging ranks into an HSDP mesh by locality group, without processes."""

from __future__ import annotations

from workloads.plans import arrange_mesh


def test_contiguous_groups_become_rows() -> None:
    arrangement = arrange_mesh(["a", "a", "b", "b"])
    assert arrangement.rows == ((0, 1), (2, 3))
    assert arrangement.groups == ("a", "b")


def test_interleaved_ranks_are_regrouped_by_locality() -> None:
    arrangement = arrange_mesh(["east", "west", "east", "west", "east", "west"])
    assert arrangement.rows == ((0, 2, 4), (1, 3, 5))


def test_rows_are_ordered_by_their_lowest_rank_not_by_name() -> None:
    arrangement = arrange_mesh(["zz", "zz", "aa", "aa"])
    assert arrangement.rows == ((0, 1), (2, 3))
    assert arrangement.groups == ("zz", "aa")


def test_every_row_shares_one_group_and_covers_every_rank_once() -> None:
    groups = ["g2", "g1", "g3", "g1", "g2", "g3", "g3", "g1", "g2"]
    rows = arrange_mesh(groups).rows
    assert rows is not None
    assert sorted(rank for row in rows for rank in row) == list(range(len(groups)))
    assert all(len({groups[rank] for rank in row}) == 1 for row in rows)
    assert len({groups[row[0]] for row in rows}) == len(rows)


def test_one_group_is_a_single_row_and_singletons_a_column() -> None:
    assert arrange_mesh(["", "", ""]).rows == ((0, 1, 2),)
    assert arrange_mesh(["a", "b", "c"]).rows == ((0,), (1,), (2,))


def test_unequal_groups_cannot_form_a_mesh_and_say_why() -> None:
    arrangement = arrange_mesh(["a", "a", "b"])
    assert arrangement.rows is None
    assert "differ in size" in arrangement.reason and "a: 2" in arrangement.reason and "b: 1" in arrangement.reason
