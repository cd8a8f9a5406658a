"""An entry PUT cut short can leave an EMPTY object at its key (SeaweedFS kept one for a
directory whose daemon was SIGKILLed mid-PUT; CI of 5c3441b).  No ckptfs writer ever
writes an empty entry, so the name is free: a mkdir -- async mode's replay of its log, or
sync mode's own retry -- takes it (replacing only that empty object), and never keeps its
directory under a conflict name as if another node held the name."""

from __future__ import annotations

import json
import os

import pytest

from support.mounts import fresh, run_ckptfs

TORN_MKDIR = {"rules": [{"op": "put_if_absent", "prefix": "dirs/", "kind": "torn",
                         "times": 1}]}


def faulty_mount(store, make_mount, tmp_path, durability):
    """A mount whose fault plan is empty until the test writes ``control``."""
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    return make_mount(store, durability=durability,
                      faults={"control_file": str(control)}), control


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_mkdir_whose_entry_put_was_torn_keeps_its_name(store, make_mount, tmp_path,
                                                         durability):
    mnt, control = faulty_mount(store, make_mount, tmp_path, durability)
    control.write_text(json.dumps(TORN_MKDIR))
    os.mkdir(mnt.path / "d1")
    (mnt.path / "d1/f").write_bytes(b"kept")
    run_ckptfs("wait", str(mnt.path), check=True)
    assert sorted(os.listdir(mnt.path)) == ["d1"]
    other = fresh(make_mount, store)
    assert sorted(os.listdir(other.path)) == ["d1"]
    assert (other.path / "d1/f").read_bytes() == b"kept"
    log = (mnt.state_dir / "ckptfs.log").read_text(errors="replace")
    assert "injected torn put" in log                               # the fault did fire
    assert "ckptfs-conflict" not in log


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_a_rename_whose_new_entry_put_was_torn_lands(store, make_mount, tmp_path,
                                                     durability):
    mnt, control = faulty_mount(store, make_mount, tmp_path, durability)
    (mnt.path / "f").write_bytes(b"checkpoint")
    run_ckptfs("wait", str(mnt.path), check=True)
    control.write_text(json.dumps(TORN_MKDIR))
    os.rename(mnt.path / "f", mnt.path / "g")
    run_ckptfs("wait", str(mnt.path), check=True)
    log = (mnt.state_dir / "ckptfs.log").read_text(errors="replace")
    assert "injected torn put" in log                               # the fault did fire
    other = fresh(make_mount, store)
    assert sorted(os.listdir(other.path)) == ["g"]
    assert (other.path / "g").read_bytes() == b"checkpoint"
