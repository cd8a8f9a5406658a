"""gc never deletes a referenced chunk (issue 8, section 4): through real mounts, over
LocalStore and SeaweedFS.  ``--gc-settle`` is tiny here (recorded in the store by the
first mount); ``--grace 0`` makes every unreferenced chunk old enough."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from support.mounts import eventually, run_ckptfs

MiB = 1 << 20
SETTLE = ("--gc-settle", "0.3")


def gc(mount, *extra: str):
    proc = run_ckptfs("gc", str(mount.path), "--grace", "0", *extra)
    return proc


def store_chunks(mount) -> set[str]:
    """Chunk keys in the store, listed from outside the mount."""
    from ckptfs.store import open_store
    env = dict(os.environ)
    try:
        os.environ.update(mount.store.env)
        store = open_store(mount.store.url, mount.store.seaweed.endpoint_url
                           if mount.store.seaweed else None)
        return {o.key for o in store.list("chunks/")}
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_chunks_of_a_16m_writer_survive_gc_from_an_8m_node(store, make_mount):
    big = make_mount(store, name="big", extra=("--chunk-size", "16M", *SETTLE))
    data = os.urandom(20 * MiB)
    (big.path / "model.bin").write_bytes(data)
    small = make_mount(store, name="small")              # default 8M chunks
    assert eventually(lambda: (small.path / "model.bin").exists())
    chunks = store_chunks(small)
    assert len(chunks) == 2                              # 16 MiB + 4 MiB
    for _ in range(3):
        proc = gc(small)
        assert proc.returncode == 0, proc.stderr
        time.sleep(1.2)                                  # chunks older than a pass
    assert store_chunks(small) == chunks
    assert hashlib.sha256((small.path / "model.bin").read_bytes()).digest() == \
        hashlib.sha256(data).digest()
    fresh = make_mount(store, name="fresh")
    assert (fresh.path / "model.bin").read_bytes() == data


@pytest.mark.expect_log_errors(r"gc: cannot parse entry dirs/root/strange",
                               r"gc: 1 entry could not be parsed",
                               r"corrupt entry dirs/root/strange: entry is not JSON")
def test_unparsable_entry_stops_gc_and_names_its_key(local_store, make_mount):
    mnt = make_mount(local_store, extra=SETTLE)
    (mnt.path / "old").write_bytes(os.urandom(MiB))
    (mnt.path / "keep").write_bytes(b"keep me")
    os.unlink(mnt.path / "old")
    proc = gc(mnt)
    assert proc.returncode == 0, proc.stderr
    assert "condemned 1 " in proc.stdout
    # A file written by a future or broken node: its chunks are unknown to gc.
    (local_store.root / "dirs" / "root" / "strange").write_bytes(b'{"type": "file", "chunks"')
    time.sleep(1.2)
    chunks = store_chunks(mnt)
    proc = gc(mnt)
    assert proc.returncode == 1
    assert "dirs/root/strange" in proc.stderr and "stopped" in proc.stderr
    assert store_chunks(mnt) == chunks
    log = (mnt.state_dir / "ckptfs.log").read_text()
    assert "dirs/root/strange" in log
    assert (mnt.path / "keep").read_bytes() == b"keep me"


def test_bytes_reappearing_after_gc_are_never_referenced_but_missing(store, make_mount):
    """File A (a zero-filled chunk) is deleted; gc condemns and then deletes the chunk;
    file B with the same bytes is written on the node that remembers the chunk; gc runs
    again; a fresh mount must read B byte-exact."""
    mnt = make_mount(store, extra=SETTLE)
    zeros = bytes(8 * MiB)
    (mnt.path / "A").write_bytes(zeros)
    os.unlink(mnt.path / "A")
    assert gc(mnt).returncode == 0                       # condemns the chunk
    time.sleep(2.2)                                      # older than the next announcement
    proc = gc(mnt)                                       # deletes it
    assert proc.returncode == 0, proc.stderr
    assert " 1 chunk(s)" in proc.stdout, proc.stdout
    assert store_chunks(mnt) == set()
    (mnt.path / "B").write_bytes(zeros)                  # this node remembers the chunk
    assert len(store_chunks(mnt)) == 1
    for _ in range(2):
        assert gc(mnt).returncode == 0
    fresh = make_mount(store, name="fresh")
    assert (fresh.path / "B").read_bytes() == zeros


def test_bytes_reused_between_condemn_and_delete_survive(store, make_mount):
    mnt = make_mount(store, extra=SETTLE)
    zeros = bytes(8 * MiB)
    (mnt.path / "A").write_bytes(zeros)
    os.unlink(mnt.path / "A")
    proc = gc(mnt)
    assert proc.returncode == 0 and "condemned 1 " in proc.stdout, proc.stdout
    (mnt.path / "B").write_bytes(zeros)                  # deduplicated against the store
    time.sleep(2.2)
    for _ in range(2):
        proc = gc(mnt)
        assert proc.returncode == 0 and " 0 chunk(s)" in proc.stdout, proc.stdout
    fresh = make_mount(store, name="fresh")
    assert (fresh.path / "B").read_bytes() == zeros


def test_store_marker_records_chunk_size_and_other_sizes_still_mount(local_store,
                                                                      make_mount, caplog):
    first = make_mount(local_store, name="first", extra=("--chunk-size", "16M"))
    marker = json.loads((local_store.root / "ckptfs.json").read_text())
    assert marker["chunk_size"] == 16 * MiB and marker["format"] == 2
    second = make_mount(local_store, name="second", extra=("--chunk-size", "4M"))
    data = os.urandom(9 * MiB)
    (second.path / "f").write_bytes(data)
    assert eventually(lambda: (first.path / "f").exists())
    assert (first.path / "f").read_bytes() == data
    log = (second.state_dir / "ckptfs.log").read_text()
    assert log.count("created with 16777216-byte chunks") == 1
