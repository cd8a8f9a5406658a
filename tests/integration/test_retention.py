"""Retention (issue 12 part 1): ``[[retention]] pattern, keep_last`` removes sealed
checkpoints past the newest ``keep_last`` after a seal — never a staged one, never one a
pointer file names, never one open on this node — and says so in the log and status."""

from __future__ import annotations

import os

import pytest

from support.mounts import eventually, run_ckptfs


def listed(path) -> list[str]:
    return sorted(os.listdir(path))


def save(mnt, name: str) -> None:
    d = mnt.path / name
    d.mkdir()
    (d / "model.bin").write_bytes(name.encode() * 1000)
    run_ckptfs("commit", str(d), check=True)


def test_keep_last_with_pointer_open_and_staged(store, make_mount, tmp_path):
    config = tmp_path / "ckptfs.toml"
    config.write_text('[[retention]]\npattern = "global_step*"\nkeep_last = 2\n')
    a = make_mount(store, name="a", extra=("--config", str(config)))
    save(a, "global_step0")
    save(a, "global_step1")
    (a.path / "latest").write_text("global_step0")          # DeepSpeed's pointer
    held = open(a.path / "global_step1" / "model.bin", "rb")  # open on this node
    (a.path / "global_step9").mkdir()                         # staged, never sealed
    (a.path / "global_step9" / "part").write_bytes(b"p")
    (a.path / "other-3").mkdir()                              # not the pattern
    before = listed(a.path)
    save(a, "global_step2")
    save(a, "global_step3")
    # Past keep_last: 1 (open here) and 0 (named by `latest`): both kept.
    assert listed(a.path) == sorted(before + ["global_step2", "global_step3"])
    held.close()
    save(a, "global_step4")
    after = ["global_step0", "global_step3", "global_step4", "latest", "other-3"]
    assert eventually(lambda: listed(a.path) == after), listed(a.path)
    print(f"retention keep_last=2: before {sorted(before + ['global_step2', 'global_step3'])}"
          f" + global_step4, after {listed(a.path)}")
    assert (a.path / "global_step9" / "part").read_bytes() == b"p"     # staged: kept
    removed = a.status()["retention_removed"]
    assert removed == [str(a.path / "global_step1"), str(a.path / "global_step2")]
    log = (a.state_dir / "ckptfs.log").read_text()
    assert f"retention: removed {a.path / 'global_step1'}" in log
    status = run_ckptfs("status", str(a.path), check=True).stdout
    assert "retention   removed 2: " in status
    # Another node sees the same, and a fresh mount too.
    b = make_mount(store, name="b")
    assert eventually(lambda: listed(b.path) == after), listed(b.path)
    assert (b.path / "global_step3" / "model.bin").read_bytes() == b"global_step3" * 1000


def test_only_the_node_that_sealed_the_newest_prunes(local_store, make_mount, tmp_path):
    config = tmp_path / "ckptfs.toml"
    config.write_text('[[retention]]\npattern = "checkpoint-*"\nkeep_last = 1\n')
    a = make_mount(local_store, name="a", extra=("--config", str(config),
                                                 "--metadata-ttl", "0"))
    b = make_mount(local_store, name="b", extra=("--config", str(config),
                                                 "--metadata-ttl", "0"))
    save(a, "checkpoint-1")
    save(b, "checkpoint-2")            # b sealed the newest: b removes checkpoint-1
    assert eventually(lambda: listed(a.path) == ["checkpoint-2"]), listed(a.path)
    assert b.status()["retention_removed"] == [str(b.path / "checkpoint-1")]
    assert a.status()["retention_removed"] == []


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_checkpoints_sealed_by_a_rename_are_kept_and_pruned_by_seal_time(
        local_store, make_mount, tmp_path, durability):
    """A job that saves into a temporary staged name and renames it into place (the
    rename seals it) gets the same retention as one sealed by a mark or a commit."""
    config = tmp_path / "ckptfs.toml"
    config.write_text('[[retention]]\npattern = "checkpoint-*"\nkeep_last = 2\n')
    a = make_mount(local_store, durability=durability, extra=("--config", str(config)))
    for step in range(4):
        tmp = a.path / f"checkpoint-{step}.tmp"     # staged on create (checkpoint-*)
        tmp.mkdir()
        (tmp / "model.bin").write_bytes(b"%d" % step * 1000)
        os.rename(tmp, a.path / f"checkpoint-{step}")
        run_ckptfs("wait", str(a.path), check=True, timeout=120)
    assert eventually(lambda: listed(a.path) == ["checkpoint-2", "checkpoint-3"]), \
        listed(a.path)
    assert (a.path / "checkpoint-3" / "model.bin").read_bytes() == b"3" * 1000
