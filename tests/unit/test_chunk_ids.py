"""Chunk identity in format v2 (format/chunkid.py): BLAKE3 ids (``b3-<hex>``) beside v1's
bare sha256 ones.  Mixed stores: entries naming either kind are read, verified and kept
by gc; the format marker is moved from 1 to 2 only by a node that writes BLAKE3 chunks,
and a marker this release cannot read is refused in one line."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
import trio

from ckptfs.cluster.gc import collect
from ckptfs.core import Config
from ckptfs.format.chunkid import (BLAKE3, SHA256, algorithm_of, chunk_id, chunk_ok,
                                   is_chunk_id)
from ckptfs.format.remote import FORMAT_KEY, BadEntry, Entry, chunk_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.node.daemon import MountError, read_format_marker
from ckptfs.store import LocalStore, MemoryStore
from support.core import Core, open_core

DATA = b"checkpoint bytes " * 1000


def test_ids_of_both_algorithms_are_content_addresses():
    b3, sha = chunk_id(DATA), chunk_id(DATA, SHA256)
    assert b3.startswith("b3-") and len(b3) == 67 and algorithm_of(b3) == BLAKE3
    assert sha == hashlib.sha256(DATA).hexdigest() and algorithm_of(sha) == SHA256
    assert chunk_ok(DATA, b3) and chunk_ok(DATA, sha)
    assert not chunk_ok(DATA + b"x", b3) and not chunk_ok(DATA + b"x", sha)
    assert chunk_id(DATA, BLAKE3) == chunk_id(memoryview(bytearray(DATA)))


def test_chunk_keys_fan_out_by_digest_and_end_with_the_id():
    b3 = chunk_id(DATA)
    assert chunk_key(b3) == f"chunks/{b3[3:5]}/{b3}"
    sha = chunk_id(DATA, SHA256)
    assert chunk_key(sha) == f"chunks/{sha[:2]}/{sha}"      # v1's key, unchanged


@pytest.mark.parametrize("bad", ["b3-" + "0" * 63, "b3:" + "0" * 64, "B3-" + "0" * 64,
                                 "sha256-" + "0" * 64, "0" * 63, "../" + "0" * 61, 7])
def test_entries_refuse_malformed_chunk_ids(bad):
    assert not is_chunk_id(bad)
    doc = {"v": 2, "type": "file", "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 0,
           "size": 3, "chunks": [[bad, 3]]}
    with pytest.raises(BadEntry, match="bad chunk"):
        Entry.from_json(json.dumps(doc).encode())


def test_one_entry_may_name_chunks_of_both_algorithms():
    a, b = os.urandom(10), os.urandom(20)
    chunks = [(chunk_id(a, SHA256), 10), (chunk_id(b), 20)]
    entry = Entry(type="file", mode=0o644, size=30, chunks=chunks)
    assert Entry.from_json(entry.to_json()).chunks == chunks


def test_a_v1_marker_is_upgraded_only_by_a_blake3_writer():
    store = MemoryStore()
    assert read_format_marker(store, 1 << 20, 1.0, SHA256).version == 1
    assert json.loads(store.get(FORMAT_KEY)[0])["format"] == 1     # old releases mount it
    assert read_format_marker(store, 1 << 20, 1.0, SHA256).version == 1
    fmt = read_format_marker(store, 1 << 20, 1.0, BLAKE3)
    assert fmt.version == 2 and fmt.chunk_size == 1 << 20
    doc = json.loads(store.get(FORMAT_KEY)[0])
    assert doc == {"format": 2, "chunk_size": 1 << 20, "gc_settle": 1.0}
    # A sha256 writer on a v2 store leaves it at 2.
    assert read_format_marker(store, 1 << 20, 1.0, SHA256).version == 2
    assert json.loads(store.get(FORMAT_KEY)[0])["format"] == 2


def test_a_new_store_of_a_blake3_writer_is_v2():
    store = MemoryStore()
    assert read_format_marker(store, 1 << 20, 1.0).version == 2
    assert json.loads(store.get(FORMAT_KEY)[0])["format"] == 2


@pytest.mark.parametrize("version", [3, 0, "2", None])
def test_a_format_this_release_cannot_read_is_refused_in_one_line(version):
    store = MemoryStore()
    store.put(FORMAT_KEY, json.dumps({"format": version}).encode())
    with pytest.raises(MountError) as err:
        read_format_marker(store, 1 << 20, 1.0)
    assert "\n" not in str(err.value) and f"format {version!r}" in str(err.value)
    assert json.loads(store.get(FORMAT_KEY)[0])["format"] == version     # untouched


def _chunk_ids(store: LocalStore) -> set[str]:
    return {o.key.rsplit("/", 1)[-1] for o in store.list("chunks/")}


@pytest.mark.trio
async def test_a_mixed_store_is_read_verified_and_kept_by_gc(tmp_path):
    """Files written with sha256 ids (what format v1 wrote), then files written with
    BLAKE3 ids into the same store, read back by a fresh node; gc keeps every chunk an
    entry names, of either kind, and collects unreferenced ones of either kind."""
    store = LocalStore(tmp_path / "store")
    old_data, new_data = os.urandom(300_000), os.urandom(200_000)
    small = dict(chunk_size=64 << 10)
    async with open_core(tmp_path / "old", store, Config(chunk_hash=SHA256, **small)) as fs:
        await Core(fs, store).save(ROOT_INO, b"old.bin", old_data)
    old_ids = _chunk_ids(store)
    assert old_ids and all(algorithm_of(c) == SHA256 for c in old_ids)
    async with open_core(tmp_path / "new", store, Config(**small)) as fs:
        core = Core(fs, store)
        assert await core.load(await core.resolve("old.bin")) == old_data
        await core.save(ROOT_INO, b"new.bin", new_data)
    new_ids = _chunk_ids(store) - old_ids
    assert new_ids and all(algorithm_of(c) == BLAKE3 for c in new_ids)
    # One unreferenced chunk of each kind, written long enough ago for gc to condemn.
    orphans = {chunk_id(b"orphan", SHA256), chunk_id(b"orphan")}
    past = time.time() - 3600
    for cid in orphans:
        store.put(chunk_key(cid), b"orphan")
        os.utime(store.root / chunk_key(cid), (past, past))
    for _ in range(2):                     # condemn, then delete
        await trio.to_thread.run_sync(
            lambda: collect(store, grace=0, settle=0.3, dry_run=False))
    left = _chunk_ids(store)
    assert not orphans & left
    async with open_core(tmp_path / "reader", store, Config(**small)) as fs:
        core = Core(fs, store)
        assert await core.load(await core.resolve("new.bin")) == new_data
        assert await core.load(await core.resolve("old.bin")) == old_data
    assert old_ids | new_ids <= left
