"""gc never deletes a referenced chunk (issue 8, section 4; decision 0003): the two-phase
protocol between gc and deduplicating writers, over a real LocalStore, with writers
placed at exact points of a gc pass through its ``wait`` hook."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from ckptfs.cluster.gc import GcConflict, collect
from ckptfs.data.guarded_store import GuardedStore
from ckptfs.data.liveness import DELETING, GC_STATE_KEY, MARKING, ChunkLiveness, GcState
from ckptfs.data.upload import ChunkUploader
from ckptfs.format.chunkid import chunk_id, chunk_ok
from ckptfs.format.remote import Entry, chunk_key, entry_key, removed_key
from ckptfs.store import LocalStore, NotFound

SETTLE = 0.3
DATA = b"\0" * (1 << 20)
SHA = chunk_id(DATA)      # what the uploader names it (blake3 by default)


class Node:
    """A writer: the real uploader decision and the real entry guard, no FUSE."""

    def __init__(self, store: LocalStore, tmp_path, name: str, **liveness_kw) -> None:
        self.store = store
        self.liveness = ChunkLiveness(store, SETTLE, **liveness_kw)
        self.guarded = GuardedStore(store, self.liveness)
        self.uploader = ChunkUploader(store, self.liveness, None, lambda sha, gen: None)
        self.staging = tmp_path / f"{name}-staging"
        self.puts = 0

    def upload(self, data: bytes) -> tuple[str, bool]:
        self.staging.write_bytes(data)
        sha, uploaded, _, _ = self.uploader._upload_sync(self.staging, 0, len(data))
        return sha, uploaded

    def publish_entry(self, name: str, sha: str, size: int) -> None:
        entry = Entry(type="file", mode=0o644, size=size, chunks=[(sha, size)])
        self.guarded.put(entry_key("root", name.encode()), entry.to_json())

    def publish(self, name: str, data: bytes) -> bool:
        sha, uploaded = self.upload(data)
        self.publish_entry(name, sha, len(data))
        return uploaded


def age(store: LocalStore, sha: str, seconds: float = 3600) -> None:
    """Make a chunk look written long ago (LastModified), as a day-old chunk would."""
    path = store.root / chunk_key(sha)
    past = time.time() - seconds
    os.utime(path, (past, past))


def chunk_there(store: LocalStore, sha: str) -> bool:
    try:
        body, _ = store.get(chunk_key(sha))
    except NotFound:
        return False
    return chunk_ok(body, sha)


def gc(store, **kw):
    kw.setdefault("grace", 0)
    kw.setdefault("dry_run", False)
    kw.setdefault("settle", SETTLE)
    return collect(store, **kw)


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    return LocalStore(root)


def test_first_pass_condemns_and_only_a_later_pass_deletes(store, tmp_path):
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    first = gc(store)
    assert (first.chunks_condemned, first.chunks_deleted) == (1, 0)
    assert chunk_there(store, SHA)
    second = gc(store)
    assert (second.chunks_deleted, second.generation) == (1, 2)
    assert not chunk_there(store, SHA)


def test_writer_deduplicating_a_condemned_chunk_keeps_it(store, tmp_path):
    """gc condemns; the writer dedups from memory (no request); the next pass keeps it."""
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)                                   # condemns the chunk
    assert node.publish("B", DATA) is False     # deduplicated
    report = gc(store)
    assert report.chunks_deleted == 0
    assert chunk_there(store, SHA)


def test_node_memory_expires_when_a_pass_collected_the_chunk(store, tmp_path):
    """The chunk is deleted while a node remembers it: the node must upload it again."""
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)
    assert gc(store).chunks_deleted == 1
    assert node.publish("B", DATA) is True      # memory no longer trusted: PUT again
    assert chunk_there(store, SHA)
    gc(store)
    gc(store)
    assert chunk_there(store, SHA)


def test_dedup_during_marking_is_a_touch_and_survives_an_entry_put_after_the_mark(
        store, tmp_path):
    """The dangerous interleaving: the writer decides to dedup while gc marks, and its
    entry lands after the mark has listed the directory.  The writer's re-PUT (newer
    LastModified than the marking announcement) is what keeps the chunk."""
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)                                   # condemned
    decided = {}
    writer_done = threading.Event()

    def entry_after_mark():
        node.publish_entry("B", SHA, len(DATA))
        writer_done.set()

    def wait(phase, seconds):
        time.sleep(seconds)
        if phase == MARKING:
            decided["uploaded"] = node.upload(DATA)[1]     # chunk step only
        if phase == DELETING:
            threading.Thread(target=entry_after_mark).start()
            time.sleep(SETTLE / 3)              # the entry waits for the pass to end
            decided["early"] = writer_done.is_set()

    report = gc(store, wait=wait)
    assert decided["uploaded"] is True          # a candidate is PUT again, not skipped
    assert report.chunks_deleted == 0
    assert writer_done.wait(10)
    assert decided["early"] is False
    assert chunk_there(store, SHA)
    assert json.loads(store.get(entry_key("root", b"B"))[0])["chunks"] == [[SHA, len(DATA)]]


def test_writer_arriving_while_gc_deletes_waits_then_uploads_again(store, tmp_path):
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)
    result = {}

    def writer():
        result["uploaded"] = node.publish("B", DATA)

    def wait(phase, seconds):
        time.sleep(seconds)
        if phase == DELETING:
            t = threading.Thread(target=writer)
            t.start()
            result["thread"] = t
            time.sleep(SETTLE / 3)
            result["early"] = "uploaded" in result   # must still wait for the pass

    report = gc(store, wait=wait)
    assert report.chunks_deleted == 1
    result["thread"].join(10)
    assert result["early"] is False
    assert result["uploaded"] is True
    assert chunk_there(store, SHA)


def test_entry_copied_during_marking_touches_chunks_it_has_no_bytes_of(store, tmp_path):
    """A rename on another node copies an entry referencing a candidate: it re-PUTs the
    chunk from the store (it has no local bytes) before its entry PUT."""
    writer = Node(store, tmp_path, "a")
    writer.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)
    other = Node(store, tmp_path, "b")
    seen = {}

    def wait(phase, seconds):
        time.sleep(seconds)
        if phase == MARKING:
            before = os.stat(store.root / chunk_key(SHA)).st_mtime
            other.publish_entry("renamed", SHA, len(DATA))
            seen["touched"] = os.stat(store.root / chunk_key(SHA)).st_mtime > before

    gc(store, wait=wait)
    assert seen["touched"] and other.liveness.touches == 1
    assert chunk_there(store, SHA)


def test_unparsable_entry_stops_the_sweep(store, tmp_path, caplog):
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)
    store.put("dirs/root/broken", b"{not json")
    report = gc(store)
    assert report.bad_entries == ["dirs/root/broken"]
    assert report.stopped and report.chunks_deleted == 0
    assert "dirs/root/broken" in caplog.text
    assert chunk_there(store, SHA)
    store.delete("dirs/root/broken")
    assert gc(store).chunks_deleted == 1        # still condemned: the next pass may go on


def test_chunks_of_a_16m_writer_are_referenced(store, tmp_path):
    big = os.urandom(16 << 20)
    sha = chunk_id(big)
    store.put(chunk_key(sha), big)
    age(store, sha)
    entry = Entry(type="file", mode=0o644, size=len(big), chunks=[(sha, len(big))])
    store.put(entry_key("root", b"big"), entry.to_json())
    for _ in range(3):
        report = gc(store)
        assert not report.bad_entries and report.chunks_deleted == 0
    assert chunk_there(store, sha)


def test_walk_is_iterative_and_survives_directory_id_loops(store):
    a, b = "a" * 32, "b" * 32
    old = 1

    def d(parent, name, dir_id, staged=False, mtime_ns=old):
        entry = Entry(type="dir", mode=0o755, id=dir_id, staged=staged, mtime_ns=mtime_ns)
        store.put(entry_key(parent, name), entry.to_json())

    d("root", b"checkpoint-1", a, staged=True)    # an old staged tree...
    d(a, b"x", b)
    d(b, b"back", a)                              # ...with a loop inside it
    d("root", b"live", b, mtime_ns=time.time_ns())  # and b also reachable from the root
    previous = b"root"
    ids = [f"{i:032x}" for i in range(1, 3001)]
    parent = "root"
    for dir_id in ids:                            # 3000 levels deep
        d(parent, b"n", dir_id, mtime_ns=time.time_ns())
        parent = dir_id
    del previous
    report = gc(store)
    assert report.staged_trees == ["/checkpoint-1"]
    keys = {o.key for o in store.list("dirs/")}
    assert entry_key("root", b"checkpoint-1") not in keys
    assert entry_key(b, b"back") in keys          # b is live: left alone
    assert entry_key(ids[-2], b"n") in keys


def test_a_second_gc_is_refused_while_one_runs(store, tmp_path):
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)
    errors = []

    def wait(phase, seconds):
        if phase == MARKING:
            try:
                gc(store)
            except GcConflict as exc:
                errors.append(exc)

    gc(store, wait=wait)
    assert len(errors) == 1
    state = GcState.from_json(store.get(GC_STATE_KEY)[0])
    assert state.phase == "idle" and state.generation == 2


def test_recently_verified_chunk_costs_no_request(store, tmp_path):
    now = [0.0]
    node = Node(store, tmp_path, "a", clock=lambda: now[0])
    node.publish("A", DATA)
    gc(store)                                   # nothing condemned (A references it)
    calls = []
    real_exists, real_get = store.exists, store.get
    store.exists = lambda key: calls.append(("HEAD", key)) or real_exists(key)
    store.get = lambda key: calls.append(("GET", key)) or real_get(key)
    for _ in range(20):
        node.upload(DATA)
        now[0] += SETTLE / 20
    assert [c for c in calls if c[1].startswith("chunks/")] == []
    # One small GET of the gc state per settle/2 of publishing, whatever the chunk count:
    # the state was read at t=0 (publish of A), again once t passed settle/2.
    assert len([c for c in calls if c[1] == GC_STATE_KEY]) == 1


def test_concurrent_callers_share_one_gc_state_read_and_its_failure():
    """A hanging store: the uploads of one close must not each wait a full timeout on
    the gc state, one after another (found by the hanging-store test: 3 chunks gave
    EIO after 3 timeouts)."""
    import threading
    import time as _time

    from ckptfs.data.liveness import ChunkLiveness
    from ckptfs.store import StoreError

    class HangingStore:
        url = "mem://"

        def __init__(self):
            self.gets = 0

        def get(self, key):
            self.gets += 1
            _time.sleep(0.5)
            raise StoreError(f"store timeout: get {key}")

    store = HangingStore()
    liveness = ChunkLiveness(store, settle=10)
    errors = []

    def call():
        try:
            liveness.state()
        except StoreError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.gets == 1 and len(errors) == 4   # one read shared, not four in a row


def test_a_gc_killed_while_it_deletes_a_staged_tree_strands_nothing(store):
    """gc deletes a staged tree's deepest entries first: a pass that dies halfway leaves
    every remaining entry reachable from the tree's top, so the next pass finds them
    (before: a subdirectory's entry went first, the entries under it were stranded)."""
    a, b = "a" * 32, "b" * 32

    def put(parent, name, entry):
        store.put(entry_key(parent, name), entry.to_json())

    put("root", b"checkpoint-1", Entry(type="dir", mode=0o755, id=a, staged=True, mtime_ns=1))
    put(a, b"sub", Entry(type="dir", mode=0o755, id=b, mtime_ns=1))
    put(b, b"weights.bin", Entry(type="file", mode=0o644, size=3, chunks=[("0" * 64, 3)]))
    put(b, b"config.json", Entry(type="file", mode=0o644, size=3, chunks=[("1" * 64, 3)]))

    class Killed(Exception):
        pass

    real_delete = store.delete
    deletes = []

    def delete_then_die(key):
        if deletes:
            raise Killed(key)
        deletes.append(key)
        real_delete(key)

    store.delete = delete_then_die
    with pytest.raises(Killed):
        gc(store)
    assert len(deletes) == 1
    store.delete = real_delete
    gc(store)
    left = sorted(o.key for o in store.list("dirs/"))
    assert left == [], f"stranded entries: {left}"


def test_gc_leaves_the_peers_keys_and_their_secret_alone(store, tmp_path):
    # Issue 24: peer membership and the cluster secret live under peers/, which no gc
    # phase walks, even when everything else is collected.
    from ckptfs.cluster import peer_auth
    from ckptfs.cluster.peer_members import peer_key
    secret = peer_auth.load_secret(store)
    member = peer_key("n1", "b1", "10.0.0.5:7601")
    store.put(member, b"{}")
    for path in (store.root / peer_auth.SECRET_KEY, store.root / member):
        os.utime(path, (time.time() - 10 * 86400,) * 2)
    node = Node(store, tmp_path, "a")
    node.publish("A", DATA)
    store.delete(entry_key("root", b"A"))
    age(store, SHA)
    gc(store)
    assert gc(store).chunks_deleted == 1
    assert peer_auth.load_secret(store) == secret
    assert store.exists(member)


def test_gc_deletes_removal_marks_older_than_its_grace_only(store):
    """rmdir's marks (decision 0028) are read right after a write lands; gc takes those
    older than the grace period and leaves younger ones."""
    old, young = removed_key("ab" * 16), removed_key("cd" * 16)
    for key in (old, young):
        store.put(key, b"{}")
    os.utime(store.root / old, (time.time() - 7200,) * 2)
    report = gc(store, grace=3600)
    assert report.removal_marks_deleted == 1
    assert not store.exists(old) and store.exists(young)
