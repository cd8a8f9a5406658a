"""``ckptfs fsck`` over the in-memory store (issue 25, item 3): one test per finding
kind, the second look that keeps a live store's moving parts from being called damage,
that a check only reads, and that a repair only puts back verified local copies."""

from __future__ import annotations

import hashlib
import uuid

from ckptfs.cluster.fsck import UNREACHABLE, check
from ckptfs.cluster.fsck_repair import LocalCopies, repair
from ckptfs.data.cache import cache_file
from ckptfs.format.remote import (Entry, chunk_id_of_key, chunk_key, chunk_matches,
                                  entry_key, inode_key)
from ckptfs.store import MemoryStore

READS = {"get", "list", "exists", "check"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_id() -> str:
    return uuid.uuid4().hex


def put_chunk(store: MemoryStore, data: bytes) -> str:
    store.put(chunk_key(sha(data)), data)
    return sha(data)


def put_file(store: MemoryStore, dir_id: str, name: str, *parts: bytes) -> list[str]:
    chunks = [(put_chunk(store, p), len(p)) for p in parts]
    entry = Entry(type="file", mode=0o644, size=sum(n for _, n in chunks), chunks=chunks)
    store.put(entry_key(dir_id, name.encode()), entry.to_json())
    return [c for c, _ in chunks]


def put_dir(store: MemoryStore, parent: str, name: str, staged: bool = False) -> str:
    dir_id = new_id()
    store.put(entry_key(parent, name.encode()),
              Entry(type="dir", mode=0o755, id=dir_id, staged=staged).to_json())
    return dir_id


def tree() -> tuple[MemoryStore, dict]:
    """/ckpt/model.bin (two chunks), /ckpt/cfg.json, /notes (a symlink), /a and /b
    (hard links to one inode object)."""
    store = MemoryStore()
    store.put("ckptfs.json", b'{"format": 1}')
    ckpt = put_dir(store, "root", "ckpt")
    model = put_file(store, ckpt, "model.bin", b"m" * 100, b"n" * 50)
    cfg = put_file(store, ckpt, "cfg.json", b"{}")
    store.put(entry_key("root", b"notes"),
              Entry(type="symlink", mode=0o777, target=b"ckpt/cfg.json").to_json())
    link = new_id()
    shared = put_chunk(store, b"shared bytes")
    store.put(inode_key(link), Entry(type="file", mode=0o644, size=12,
                                     chunks=[(shared, 12)], nlink=2).to_json())
    for name in ("a", "b"):
        store.put(entry_key("root", name.encode()),
                  Entry(type="link", mode=0, link=link).to_json())
    store.calls.clear()
    return store, {"ckpt": ckpt, "model": model, "cfg": cfg, "shared": shared, "link": link}


def test_a_whole_store_is_clean_and_only_read():
    store, _ = tree()
    report = check(store, full=True)
    assert not report.damaged, report.to_json()
    assert (report.dirs, report.files, report.chunks) == (1, 5, 4)
    assert report.chunks_hashed == 4
    assert report.orphan_chunks == [] and report.orphan_inodes == []
    assert {c.op for c in store.calls} <= READS


def test_a_missing_chunk_names_the_files_by_path():
    store, ids = tree()
    store.delete(chunk_key(ids["model"][1]))
    store.delete(chunk_key(ids["shared"]))
    report = check(store)
    assert report.damaged
    assert sorted(report.missing_chunks) == sorted([ids["model"][1], ids["shared"]])
    assert [(d.path, d.missing) for d in report.damaged_files] == [
        ("/a", [ids["shared"]]), ("/b", [ids["shared"]]),
        ("/ckpt/model.bin", [ids["model"][1]])]


def test_corrupt_bytes_are_found_by_full_only():
    store, ids = tree()
    store.put(chunk_key(ids["cfg"][0]), b"[]")          # same length, other bytes
    assert not check(store).damaged
    report = check(store, full=True)
    assert report.corrupt_chunks == [ids["cfg"][0]]
    assert [d.path for d in report.damaged_files] == ["/ckpt/cfg.json"]


def test_a_chunk_of_the_wrong_size_is_corrupt_without_full():
    store, ids = tree()
    store.put(chunk_key(ids["model"][0]), b"m" * 99)
    report = check(store)
    assert report.corrupt_chunks == [ids["model"][0]]
    assert [d.path for d in report.damaged_files] == ["/ckpt/model.bin"]


def test_unparseable_entries_and_bad_keys_are_named():
    store, ids = tree()
    store.put(entry_key(ids["ckpt"], b"half"), b'{"type": "file", "chunks"')
    store.put(f"dirs/{ids['ckpt']}/bad%zzescape",
              Entry(type="symlink", mode=0o777, target=b"x").to_json())
    store.put(entry_key("root", b"evil"), b'{"type": "dir", "mode": 493, "id": "../x"}')
    report = check(store)
    keys = [k for k, _ in report.bad_entries]
    assert keys == sorted([entry_key(ids["ckpt"], b"half"), f"dirs/{ids['ckpt']}/bad%zzescape",
                           entry_key("root", b"evil")])
    assert "not JSON" in dict(report.bad_entries)[entry_key(ids["ckpt"], b"half")]
    assert "bad directory id" in dict(report.bad_entries)[entry_key("root", b"evil")]
    assert report.damaged


def test_a_dangling_directory_id_and_its_files():
    store, ids = tree()
    lost = new_id()
    chunk = put_file(store, lost, "orphan.bin", b"lost")[0]
    store.delete(chunk_key(chunk))
    report = check(store)
    assert report.dangling_dirs == [(lost, 1)]
    assert [d.path for d in report.damaged_files] == \
        [UNREACHABLE + entry_key(lost, b"orphan.bin")]


def test_orphans_staged_trees_and_other_prefixes_are_no_damage():
    store, ids = tree()
    orphan = put_chunk(store, b"nobody's")
    store.put(inode_key(new_id()), Entry(type="file", mode=0o644).to_json())
    staged = put_dir(store, ids["ckpt"], "step-2", staged=True)
    inner = put_dir(store, staged, "shards", staged=True)
    put_file(store, inner, "0.bin", b"zero")
    store.put(f"leases/{staged}/node1", b"{}")
    store.put("peers/node1", b"not an entry")
    store.put("peers/secret", b"\0\1")
    store.put("gc/state.json", b'{"generation": 3, "phase": "idle", "history": []}')
    report = check(store)
    assert not report.damaged, report.to_json()
    assert report.orphan_chunks == [orphan]
    assert len(report.orphan_inodes) == 1
    assert [(s.path, s.dir_id) for s in report.staged_trees] == [("/ckpt/step-2", staged)]
    assert report.staged_trees[0].lease_age is not None
    assert report.leases == 1 and report.gc_phase == "idle"


def test_a_missing_inode_object_names_its_links():
    store, ids = tree()
    store.delete(inode_key(ids["link"]))
    report = check(store)
    assert report.missing_inodes == [("/a", inode_key(ids["link"])),
                                     ("/b", inode_key(ids["link"]))]
    assert report.damaged


def test_a_file_removed_with_its_chunk_during_the_walk_is_no_damage():
    """A writer deletes a file and gc its chunk after fsck read the entry, before fsck
    listed the chunks: the second look at the entry sees it gone."""
    store, ids = tree()

    def remove(call) -> None:
        store.delete(entry_key(ids["ckpt"], b"cfg.json"))
        store.delete(chunk_key(ids["cfg"][0]))
    store.before(remove, op="list", prefix="chunks/", times=1)
    report = check(store)
    assert not report.damaged, report.to_json()


def test_a_directory_renamed_during_the_listing_is_not_dangling():
    """The flat listing misses both names of a directory moving (the new key was passed
    before it was written, the old one deleted before it was reached): listed again,
    the directory has its new name."""
    store, ids = tree()
    old = entry_key("root", b"ckpt")
    body, _ = store.get(old)
    calls = []

    def before(call) -> None:
        if call.key == "dirs/" and not calls:
            calls.append(call)
            store.delete(old)

    def after(call) -> None:
        if calls and call is calls[0]:
            store.put(entry_key("root", b"ckpt-renamed"), body)
    store.before(before, op="list", prefix="dirs/")
    store.after(after, op="list", prefix="dirs/")
    report = check(store)
    assert report.dangling_dirs == []
    assert not report.damaged, report.to_json()


def test_repair_puts_back_only_verified_local_copies(tmp_path):
    store, ids = tree()
    cached, staged, rotten = ids["model"][0], ids["model"][1], ids["cfg"][0]
    for chunk in (cached, staged, rotten):
        store.delete(chunk_key(chunk))
    cache = tmp_path / "cache"
    cache_file(cache, cached).parent.mkdir(parents=True)
    cache_file(cache, cached).write_bytes(b"m" * 100)
    cache_file(cache, rotten).parent.mkdir(parents=True)
    cache_file(cache, rotten).write_bytes(b"[]")         # rotted on disk: not uploaded
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "7.2").write_bytes(b"m" * 100 + b"n" * 50)   # the file's closed version
    (staging / "8").write_bytes(b"x" * 150)                 # same size, other bytes
    report = check(store)
    assert len(report.missing_chunks) == 3
    store.calls.clear()
    repair(store, report, LocalCopies(cache, [staging, tmp_path / "absent"]))
    assert sorted(c for c, _ in report.repaired) == sorted([cached, staged])
    assert report.missing_chunks == [rotten]
    assert [d.path for d in report.damaged_files] == ["/ckpt/cfg.json"]
    writes = [(c.op, c.key) for c in store.calls if c.op not in READS]
    assert sorted(writes) == sorted([("put_if_absent", chunk_key(cached)),
                                     ("put_if_absent", chunk_key(staged))])
    again = check(store, full=True)
    assert again.missing_chunks == [rotten] and again.corrupt_chunks == []


def test_chunk_ids_are_the_format_module_s():
    data = b"abc"
    chunk = sha(data)
    assert chunk_id_of_key(chunk_key(chunk)) == chunk
    assert chunk_id_of_key(f"chunks/zz/{chunk}") is None
    assert chunk_id_of_key("chunks/ab/not-a-chunk") is None
    assert chunk_matches(chunk, data) and not chunk_matches(chunk, b"abd")


def test_a_hard_linked_file_removed_during_the_walk_is_no_damage():
    """Both names of a hard-linked file are unlinked (link entries, then the inode
    object) after the walk read them, before the flat listing: read again, the names
    are gone."""
    store, ids = tree()

    def unlink(call) -> None:
        for name in (b"a", b"b"):
            store.delete(entry_key("root", name))
        store.delete(inode_key(ids["link"]))
    store.before(unlink, op="list", prefix="inodes/", times=1)
    report = check(store)
    assert report.missing_inodes == []
    assert not report.damaged, report.to_json()


def test_a_tree_gc_is_removing_is_not_dangling():
    """gc removes a staged tree's directory entry before the entries under it: a
    directory id losing entries between the two listings is being removed, not lost."""
    store, ids = tree()
    going = new_id()
    put_file(store, going, "0.bin", b"zero")
    put_file(store, going, "1.bin", b"one")
    flat = []

    def remove_one(call) -> None:
        if call.key == "dirs/":
            flat.append(call)
            if len(flat) == 1:
                store.delete(entry_key(going, b"0.bin"))
    store.after(remove_one, op="list", prefix="dirs/")
    report = check(store)
    assert len(flat) == 2
    assert report.dangling_dirs == []
    assert not report.damaged, report.to_json()


def test_a_corrupt_gc_state_is_a_bad_entry():
    store, _ = tree()
    store.put("gc/state.json", b"{not json")
    report = check(store)
    assert [k for k, _ in report.bad_entries] == ["gc/state.json"]
    assert report.damaged and report.gc_phase is None


def test_a_rename_in_progress_is_reported_not_damage():
    store, ids = tree()
    claimed = Entry(type="symlink", mode=0o777, target=b"ckpt/cfg.json",
                    moving_to=entry_key(ids["ckpt"], b"notes"), moving_at=1000.0)
    store.put(entry_key("root", b"notes"), claimed.to_json())
    report = check(store, clock=lambda: 1030.0)
    assert report.rename_claims == [("/notes", entry_key(ids["ckpt"], b"notes"), 30.0)]
    assert not report.damaged


def test_the_summary_names_each_finding_and_ends_with_the_verdict():
    from ckptfs.cli.fsck import report_lines
    store, ids = tree()
    store.delete(chunk_key(ids["shared"]))
    store.put(entry_key("root", b"half"), b"{")
    lines = report_lines(check(store))
    assert lines[0].startswith("fsck mem://: 7 entries (1 directory, 5 files), 3 chunks")
    assert f"DAMAGED /a: 1 chunk(s) missing (first: {ids['shared']})" in lines
    assert f"DAMAGED /b: 1 chunk(s) missing (first: {ids['shared']})" in lines
    assert any(line.startswith("BAD ENTRY dirs/root/half: entry is not JSON") for line in lines)
    assert lines[-1] == "result: DAMAGE: 2 damaged files, 1 missing chunk, 1 bad entry"
    assert report_lines(check(tree()[0]))[-1] == "result: clean"
