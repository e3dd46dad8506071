"""The checkpoint directory protocol without processes: which directory is the latest, what is ignored and cleaned."""

from __future__ import annotations

from pathlib import Path

from workloads.checkpoint import (
    METADATA_FILE,
    TRAINER_FILE,
    checkpoint_name,
    commit,
    complete_checkpoints,
    latest_checkpoint,
    partial_dirs,
    prune,
    remove_partials,
)


def make_checkpoint(root: Path, name: str, *, metadata: bool = True, trainer: bool = True) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if metadata:
        (path / METADATA_FILE).write_bytes(b"meta")
    if trainer:
        (path / TRAINER_FILE).write_text('{"format": 1}')
    return path


def test_names_sort_like_steps() -> None:
    assert checkpoint_name(7) == "step-00000007"
    names = [checkpoint_name(step) for step in (9, 10, 100, 99_999_999)]
    assert names == sorted(names)


def test_latest_is_the_highest_complete_step(tmp_path: Path) -> None:
    for step in (10, 30, 20):
        make_checkpoint(tmp_path, checkpoint_name(step))
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 30 and latest.path.name == "step-00000030"
    assert [info.step for info in complete_checkpoints(tmp_path)] == [10, 20, 30]


def test_partial_and_incomplete_directories_are_never_latest(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, checkpoint_name(10))
    make_checkpoint(tmp_path, checkpoint_name(40) + ".partial")  # complete-looking, but never renamed
    make_checkpoint(tmp_path, checkpoint_name(30), metadata=False)  # DCP never finished
    make_checkpoint(tmp_path, checkpoint_name(20), trainer=False)  # trainer state missing
    make_checkpoint(tmp_path, "step-50")  # not our name
    (tmp_path / checkpoint_name(60)).write_text("a file, not a directory")
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 10


def test_no_checkpoint_in_an_empty_or_missing_directory(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    assert partial_dirs(tmp_path / "missing") == []


def test_partials_are_cleaned_and_complete_ones_kept(tmp_path: Path) -> None:
    kept = make_checkpoint(tmp_path, checkpoint_name(10))
    make_checkpoint(tmp_path, checkpoint_name(20) + ".partial", metadata=False)
    removed = remove_partials(tmp_path)
    assert [path.name for path in removed] == ["step-00000020.partial"]
    assert partial_dirs(tmp_path) == [] and kept.exists()


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path, checkpoint_name(step))
    removed = prune(tmp_path, keep=2)
    assert sorted(path.name for path in removed) == ["step-00000010", "step-00000020"]
    assert [info.step for info in complete_checkpoints(tmp_path)] == [30, 40]


def test_commit_renames_and_replaces_a_stale_same_step_checkpoint(tmp_path: Path) -> None:
    stale = make_checkpoint(tmp_path, checkpoint_name(10))
    (stale / "old-marker").write_text("old")
    partial = make_checkpoint(tmp_path, checkpoint_name(10) + ".partial")
    commit(partial, tmp_path / checkpoint_name(10))
    final = tmp_path / checkpoint_name(10)
    assert final.is_dir() and not partial.exists() and not (final / "old-marker").exists()
    assert [path.name for path in tmp_path.iterdir()] == [checkpoint_name(10)]
