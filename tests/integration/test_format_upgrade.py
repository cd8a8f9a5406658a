"""A store written by format 1 (sha256 chunk ids: a node mounted with ``--chunk-hash
sha256`` writes exactly what v1 wrote) is read by a node that names new chunks with
BLAKE3; that node moves the store's marker to format 2 and adds files; the store is then
mixed, gc keeps every chunk either kind of entry names, and a fresh node reads it all.
Over LocalStore and SeaweedFS (a BLAKE3 chunk's PUT carries a CRC32C the server checks)."""

from __future__ import annotations

import json
import os
import time

from ckptfs.format.chunkid import BLAKE3, SHA256, algorithm_of
from support.mounts import eventually, run_ckptfs

KiB = 1 << 10
SMALL = ("--chunk-size", "64K", "--gc-settle", "0.3")


def _raw_store(mount):
    from ckptfs.store import open_store
    env = dict(os.environ)
    try:
        os.environ.update(mount.store.env)
        return open_store(mount.store.url, mount.store.seaweed.endpoint_url
                          if mount.store.seaweed else None)
    finally:
        os.environ.clear()
        os.environ.update(env)


def _chunk_ids(mount) -> set[str]:
    return {o.key.rsplit("/", 1)[-1] for o in _raw_store(mount).list("chunks/")}


def _format(mount) -> int:
    return json.loads(_raw_store(mount).get("ckptfs.json")[0])["format"]


def test_a_v1_store_is_read_upgraded_mixed_and_collected(store, make_mount):
    old_data, new_data = os.urandom(150 * KiB), os.urandom(100 * KiB)
    old = make_mount(store, name="old", extra=(*SMALL, "--chunk-hash", "sha256"))
    (old.path / "ckpt").mkdir()
    (old.path / "ckpt" / "old.bin").write_bytes(old_data)
    old_ids = _chunk_ids(old)
    assert len(old_ids) == 3 and {algorithm_of(c) for c in old_ids} == {SHA256}
    assert _format(old) == 1
    old.stop()

    new = make_mount(store, name="new", extra=SMALL)
    assert _format(new) == 2
    assert "store format upgraded from 1 to 2" in (new.state_dir / "ckptfs.log").read_text()
    assert (new.path / "ckpt" / "old.bin").read_bytes() == old_data
    (new.path / "ckpt" / "new.bin").write_bytes(new_data)
    new_ids = _chunk_ids(new) - old_ids
    assert len(new_ids) == 2 and {algorithm_of(c) for c in new_ids} == {BLAKE3}

    for _ in range(2):                 # condemn, then delete: nothing is unreferenced
        proc = run_ckptfs("gc", str(new.path), "--grace", "0")
        assert proc.returncode == 0, proc.stderr
        time.sleep(1.2)                # chunks older than a pass
    assert _chunk_ids(new) == old_ids | new_ids

    fresh = make_mount(store, name="fresh", extra=SMALL)
    assert eventually(lambda: (fresh.path / "ckpt" / "new.bin").exists())
    assert (fresh.path / "ckpt" / "old.bin").read_bytes() == old_data
    assert (fresh.path / "ckpt" / "new.bin").read_bytes() == new_data
