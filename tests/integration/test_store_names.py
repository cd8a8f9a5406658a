"""Every legal name survives in a LocalStore: names that look like the store's own temp
or lock files included (issue 8, section 5)."""

from __future__ import annotations

import os
import time

from support.mounts import eventually

NAMES = [".tmp-model.bin", ".tmp-x", ".tmp-", ".ckptfs-tmp", ".ckptfs-lock", "model.tmp"]


def test_temp_looking_names_survive_close_ttl_and_remount(local_store, make_mount):
    mnt = make_mount(local_store)
    for i, name in enumerate(NAMES):
        (mnt.path / name).write_bytes(f"content {i}".encode())
    os.mkdir(mnt.path / "d")
    (mnt.path / "d" / ".tmp-model.bin").write_bytes(b"nested")
    time.sleep(2.5)                     # past the 1 s metadata TTL: listings are redone
    assert sorted(os.listdir(mnt.path)) == sorted([*NAMES, "d"])
    for i, name in enumerate(NAMES):
        assert (mnt.path / name).read_bytes() == f"content {i}".encode()
    mnt.stop()
    mnt.start()
    assert sorted(os.listdir(mnt.path)) == sorted([*NAMES, "d"])
    fresh = make_mount(local_store, name="fresh")
    assert eventually(lambda: sorted(os.listdir(fresh.path)) == sorted([*NAMES, "d"]))
    for i, name in enumerate(NAMES):
        assert (fresh.path / name).read_bytes() == f"content {i}".encode()
    assert (fresh.path / "d" / ".tmp-model.bin").read_bytes() == b"nested"
