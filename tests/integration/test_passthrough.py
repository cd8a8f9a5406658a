"""Issue 23: kernel FUSE passthrough.  An async mount writes new files through the kernel
straight to their staging files (no write request reaches the daemon), and every promise
holds as on the daemon's path: the bytes read back here and on a fresh node, st_size is
right while the writer writes, mmap writes land, a killed writer publishes nothing, a
reader of the old version keeps it while a new one is written, and a mount that cannot or
must not use passthrough says ``data path: daemon`` with the reason.  Needs the pyfuse3
that tools/setup.sh builds (tools/build_passthrough.sh)."""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import threading

import pytest

from support.mounts import eventually, run_ckptfs
from support.posix import fill_file_system

MiB = 1 << 20

WRITER = r"""
import sys
f = open(sys.argv[1], "wb")
f.write(b"t" * (1 << 20))
f.flush()
print("half", flush=True)
sys.stdin.readline()
"""


def _kernel_path(mount) -> dict:
    doc = mount.status()
    assert doc["data_path"] == {"path": "kernel passthrough", "reason": None}, \
        f"{doc['data_path']} (run tools/setup.sh: it builds pyfuse3 with passthrough)"
    return doc


def test_a_save_goes_through_the_kernel_and_reads_back_everywhere(store, make_mount):
    node = make_mount(store, durability="async")
    _kernel_path(node)
    data = os.urandom(3 * MiB + 123)
    path = node.path / "model.pt"
    with open(path, "wb") as f:
        f.write(data[:2 * MiB])
        f.flush()
        assert os.fstat(f.fileno()).st_size == 2 * MiB
        assert os.stat(path).st_size == 2 * MiB
        f.write(data[2 * MiB:])
    assert os.stat(path).st_size == len(data)
    requests = node.status()["fuse_requests"]
    assert "write" not in requests and requests["create"] == 1, requests
    assert path.read_bytes() == data
    run_ckptfs("wait", str(node.path), check=True)
    other = make_mount(store, name="fresh")
    assert (other.path / "model.pt").read_bytes() == data


def test_mmap_writes_and_a_killed_writer(local_store, make_mount):
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path = node.path / "mapped.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, MiB)
        with mmap.mmap(fd, MiB) as m:
            m[:] = b"m" * MiB
            m.flush()
    finally:
        os.close(fd)
    assert path.read_bytes() == b"m" * MiB
    # A writer killed mid-save: its new name goes, nothing is published.
    torn = node.path / "torn.pt"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(torn)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "half"
    assert os.stat(torn).st_size == MiB
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    eventually(lambda: not torn.exists())
    assert "write" not in node.status()["fuse_requests"]


def test_a_reader_of_the_old_version_and_a_writer_of_the_new(local_store, make_mount):
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path = node.path / "model.pt"
    path.write_bytes(b"a" * MiB)
    before = node.status()["fuse_requests"].get("write", 0)
    with open(path, "rb") as reader:
        assert reader.read(4096) == b"a" * 4096
        # The reader keeps its inode; the name moves to a fresh one for the new version
        # (decision 0031), whose writer is alone on it: through the kernel too.
        with open(path, "wb") as writer:
            writer.write(b"b" * (MiB // 2))
        assert os.fstat(reader.fileno()).st_ino != os.stat(path).st_ino
        assert reader.read() == b"a" * (MiB - 4096)
        assert os.fstat(reader.fileno()).st_size == MiB
    assert node.status()["fuse_requests"].get("write", 0) == before
    assert path.read_bytes() == b"b" * (MiB // 2)
    # A writer alone gets passthrough; a reader opening beside it reads its bytes.
    before = node.status()["fuse_requests"].get("write", 0)
    with open(path, "wb") as writer:
        writer.write(b"c" * MiB)
        writer.flush()
        with open(path, "rb") as reader:
            assert reader.read() == b"c" * MiB
    assert node.status()["fuse_requests"].get("write", 0) == before
    assert path.read_bytes() == b"c" * MiB


# The outage below lasts the 2 s a save waits; on a loaded machine the retries of its
# upload may run out meanwhile and say so (the version stays queued).
@pytest.mark.expect_log_errors(r"failed after \d+ attempts")
def test_a_reader_that_joined_a_passthrough_save_outlives_it(local_store, make_mount,
                                                            tmp_path):
    """A reader that opened while a save went through the kernel shares its staging file
    (the kernel's rule: one backing file per inode, every open of it passthrough) and may
    stay open past that save's close -- a watcher loading ``latest.pt`` while the
    trainer saves it again.  The kernel fails (EIO) any open of such an inode that is
    not passthrough, so the next save cannot go to the daemon beside it.  Once the
    reader's version is in the store, the name moves to a fresh inode (the open answers
    ESTALE and the kernel looks the name up again): the next save goes on at once and
    the reader keeps its version.  While that version still waits for its upload, the
    fresh inode takes it over, upload and all: the save goes on at once too -- nothing
    of either version is lost."""
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    node = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    _kernel_path(node)
    path = node.path / "latest.pt"
    path.write_bytes(b"a" * MiB)
    with open(path, "wb") as writer:
        writer.write(b"b" * MiB)
        writer.flush()
        reader = open(path, "rb")                       # joins the writer's staging file
    try:
        assert reader.read(4096) == b"b" * 4096
        run_ckptfs("wait", str(node.path), check=True)   # b is in the store
        with open(path, "wb") as writer:                 # the next save, reader still open
            writer.write(b"c" * MiB)
        assert reader.read() == b"b" * (MiB - 4096)     # the reader keeps its version
        assert os.fstat(reader.fileno()).st_nlink == 0  # (its inode has no name now)
    finally:
        reader.close()
    assert path.read_bytes() == b"c" * MiB
    # The version before not uploaded yet (the store refuses): the name moves to a
    # fresh inode that takes that version over (decision 0031, stop 49), so the save
    # goes on at once; the reader keeps its version.  (Before: EBUSY past the wait.)
    control.write_text(json.dumps({"rules": [{"op": "put", "kind": "transient"}]}))
    with open(path, "wb") as writer:
        writer.write(b"d" * MiB)
        writer.flush()
        reader = open(path, "rb")
    try:
        with open(path, "wb") as writer:
            writer.write(b"e" * MiB)
        assert reader.read() == b"d" * MiB
        assert os.fstat(reader.fileno()).st_nlink == 0
    finally:
        reader.close()
    assert path.read_bytes() == b"e" * MiB
    control.write_text(json.dumps({"rules": []}))
    # A reader that goes while the next save waits: the save goes on.
    with open(path, "wb") as writer:
        writer.write(b"f" * MiB)
        writer.flush()
        reader = open(path, "rb")
    threading.Timer(0.1, reader.close).start()   # well inside the 2 s the save waits
    with open(path, "wb") as writer:
        writer.write(b"g" * MiB)
    assert path.read_bytes() == b"g" * MiB
    run_ckptfs("wait", str(node.path), check=True)
    assert (make_mount(local_store, name="fresh").path / "latest.pt").read_bytes() == \
        b"g" * MiB


def test_a_mount_without_passthrough_says_why(local_store, make_mount):
    node = make_mount(local_store, durability="async", extra=("--passthrough", "off"))
    doc = node.status()
    assert doc["data_path"] == {"path": "daemon", "reason": "passthrough = off"}
    (node.path / "a.bin").write_bytes(b"x" * MiB)
    assert node.status()["fuse_requests"]["write"] > 0
    text = run_ckptfs("status", str(node.path), check=True).stdout
    assert "data path   daemon (passthrough = off)" in text
    sync = make_mount(local_store, name="sync")
    assert sync.status()["data_path"]["reason"].startswith("sync mode")
    with open(sync.path / "b.bin", "wb") as f:
        f.write(b"y" * MiB)
        os.fsync(f.fileno())
    assert sync.status()["fuse_requests"]["write"] > 0


def test_a_write_the_kernel_failed_is_never_published(tmp_path, local_store, make_mount):
    """A passthrough writer's write that fails in the kernel (the staging file system is
    full) never reaches the daemon; its close must not publish what the file holds then
    (a truncated, torn version): the previous version stays, here and on a fresh node
    (found by the model test: a save that got ENOSPC left the file empty)."""
    from support.mounts import Mount
    node = Mount(tmp_path, local_store, "full")
    node.state_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(node.state_dir)],
                   check=True)
    try:
        node.start(durability="async")
        _kernel_path(node)
        path = node.path / "weights.bin"
        before = os.urandom(MiB)
        path.write_bytes(before)
        run_ckptfs("wait", str(node.path), check=True)
        failed = None
        try:
            with open(path, "wb") as f:         # passthrough: there is room at its open
                f.write(os.urandom(MiB))
                f.flush()
                fill_file_system(node.state_dir)           # then the staging file system fills up
                for _ in range(64):
                    f.write(os.urandom(MiB))
                    f.flush()
        except OSError as exc:
            failed = exc
        assert failed is not None and failed.errno == errno.ENOSPC, failed
        assert "write" not in node.status()["fuse_requests"]    # the kernel wrote it
        assert path.read_bytes() == before
        (node.state_dir / "filler").unlink()
        run_ckptfs("wait", str(node.path), check=True)
        node.stop()
        other = Mount(tmp_path, local_store, "fresh")
        other.start(durability="async")
        try:
            assert (other.path / "weights.bin").read_bytes() == before
        finally:
            other.cleanup()
    finally:
        node.cleanup()
        subprocess.run(["umount", "-l", str(node.state_dir)], check=False)


# ---------------------------------------------------------------- read behind the writer
# The daemon sees no writes of a passthrough writer: its complete chunks are read behind
# it from the staging file and uploaded while it writes (core/readbehind.py), and hashed
# again at publish in case the kernel changed them after (data/upload.py chunk_list).

READ_BEHIND = ("--chunk-size", "1M", "--upload-hold", "0")

SLOW_WRITER = r"""
import os, sys
f = open(sys.argv[1], "wb")
f.write(os.urandom(4 << 20) + b"tail")
f.flush()
print("written", flush=True)
sys.stdin.readline()
"""


def _uploaded(node, count: int) -> bool:
    return node.stats()["chunks_uploaded"] >= count


def test_complete_chunks_reach_the_store_before_the_close(local_store, make_mount):
    node = make_mount(local_store, durability="async", extra=READ_BEHIND)
    _kernel_path(node)
    data = os.urandom(4 * MiB + 5000)
    path = node.path / "model.pt"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        assert eventually(lambda: _uploaded(node, 4), timeout=30), node.stats()
        assert node.stats()["chunks_uploaded"] == 4       # the partial tail waits
    assert "write" not in node.status()["fuse_requests"]
    run_ckptfs("wait", str(node.path), check=True)
    stats = node.stats()
    assert stats["chunks_reverified"] == 4 and stats["chunks_changed_after_upload"] == 0
    assert (make_mount(local_store, name="fresh").path / "model.pt").read_bytes() == data


def test_chunks_changed_after_their_early_upload_publish_their_final_bytes(store,
                                                                          make_mount):
    node = make_mount(store, durability="async", extra=READ_BEHIND)
    _kernel_path(node)
    data = bytearray(os.urandom(4 * MiB + 100))
    path = node.path / "model.pt"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        assert eventually(lambda: _uploaded(node, 4), timeout=30), node.stats()
        os.pwrite(fd, b"P" * 64, MiB + 100)             # a header patched in place
        data[MiB + 100:MiB + 164] = b"P" * 64
        with mmap.mmap(fd, 2 * MiB) as m:                # an mmap store into chunk 0
            m[10:20] = b"M" * 10
        data[10:20] = b"M" * 10
    finally:
        os.close(fd)
    run_ckptfs("wait", str(node.path), check=True)
    other = make_mount(store, name="fresh")
    assert (other.path / "model.pt").read_bytes() == bytes(data)
    stats = node.stats()
    assert stats["chunks_reverified"] == 4 and stats["chunks_changed_after_upload"] == 2


def test_a_writer_killed_after_its_early_uploads_publishes_nothing(local_store, make_mount):
    node = make_mount(local_store, durability="async", extra=READ_BEHIND)
    _kernel_path(node)
    torn = node.path / "torn.pt"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(torn)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    assert eventually(lambda: _uploaded(node, 4), timeout=30), node.stats()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    eventually(lambda: not torn.exists())
    assert not torn.exists()
    run_ckptfs("wait", str(node.path), check=True)
    assert node.stats()["publishes"] == 0
    assert not (make_mount(local_store, name="fresh").path / "torn.pt").exists()


def test_an_mtime_set_on_the_open_file_is_kept_and_a_later_write_moves_it(store, make_mount):
    """``cp -p``, ``tar x`` and ``rsync -t`` set a file's times on the open descriptor
    before its close.  On the kernel's path the close took the staging file's own mtime
    (the last write's) instead: every preserved time was lost."""
    node = make_mount(store, durability="async")
    _kernel_path(node)
    path = node.path / "kept.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 5000)
        os.utime(fd, ns=(10**18, 10**18))
        assert os.fstat(fd).st_mtime_ns == 10**18
    finally:
        os.close(fd)
    assert os.stat(path).st_mtime_ns == 10**18
    moved = node.path / "moved.bin"
    fd = os.open(moved, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.utime(fd, ns=(10**18, 10**18))
        os.write(fd, b"y" * 5000)                    # a write after it: now
    finally:
        os.close(fd)
    assert os.stat(moved).st_mtime_ns > 10**18 + 10**17
    subprocess.run(["cp", "-p", "/etc/hostname", str(node.path / "h")], check=True)
    assert os.stat(node.path / "h").st_mtime_ns == os.stat("/etc/hostname").st_mtime_ns
    run_ckptfs("wait", str(node.path), check=True)
    other = make_mount(store, name="fresh")
    assert os.stat(other.path / "kept.bin").st_mtime_ns == 10**18
    assert os.stat(other.path / "h").st_mtime_ns == os.stat("/etc/hostname").st_mtime_ns


# A writer forks, closes its copy and exits; its child writes on (in place and past the
# end) through the same descriptor a while later, then exits.
FORK_WRITES_ON = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, b"P" * (1 << 20))
if os.fork() == 0:
    time.sleep(float(sys.argv[2]))
    end = int(sys.argv[4])
    if end != 1 << 20:
        os.ftruncate(fd, end)                 # through the handle: the daemon's path
    os.pwrite(fd, b"C" * 100, 0)
    os.pwrite(fd, b"C" * 100, end)
    os.close(fd)
    open(sys.argv[3], "w").close()          # (outside the mount) done
    os._exit(0)
os.close(fd)
os._exit(0)
"""


@pytest.mark.parametrize("delay,end", [(0.3, 1 << 20), (2.5, 1 << 20), (0.3, 1000)],
                         ids=["soon", "after the upload", "a truncate first"])
def test_writes_through_the_kernel_after_the_close_reach_every_node(delay, end, local_store,
                                                                     make_mount, tmp_path):
    """The child's writes go straight into the closed version's staging file; the store
    kept the bytes of the parent's close (a fresh node read no C, and the extension was
    lost everywhere but on the writer's node).  Now its release makes them the next
    version.  A truncate through the child's descriptor first made a version of its own
    and the writes after it were lost on every node: now it truncates the same file."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path = node.path / "f.bin"
    done = tmp_path / "child-done"
    subprocess.run([sys.executable, "-c", FORK_WRITES_ON, str(path), str(delay), str(done),
                    str(end)], check=True)
    want = b"C" * 100 + b"P" * (end - 100) + b"C" * 100
    assert eventually(done.exists, timeout=30)
    assert eventually(lambda: node.status()["fuse_requests"].get("release", 0) >= 1,
                      timeout=30)          # the child's release reached the daemon
    run_ckptfs("wait", str(node.path), check=True)
    assert path.read_bytes() == want
    assert (make_mount(local_store, name="fresh").path / "f.bin").read_bytes() == want


def test_a_lingering_reader_does_not_stop_its_node_reading_another_nodes_save(
        store, make_mount):
    """A reader on A joined a save that went through the kernel and stays open; B saves
    the same name anew.  A reads B's bytes at once -- the lingering reader keeps its own
    version (soak seed 1215430: A's open failed with EIO until the reader closed, the
    kernel refusing an open of an inode with a backing file that is not passthrough)."""
    a = make_mount(store, name="a", durability="async", extra=("--metadata-ttl", "0.2"))
    b = make_mount(store, name="b", durability="async", extra=("--metadata-ttl", "0.2"))
    _kernel_path(a)
    path = a.path / "f0"
    ours, size = os.urandom(100_000), 40_000
    with open(path, "wb") as writer:
        writer.write(ours)
        writer.flush()
        reader = open(path, "rb", buffering=0)    # joins the writer's staging file
    try:
        run_ckptfs("wait", str(a.path), check=True, timeout=60)
        theirs = os.urandom(size)
        assert eventually(lambda: (b.path / "f0").exists())
        (b.path / "f0").write_bytes(theirs)
        run_ckptfs("wait", str(b.path), check=True, timeout=60)
        assert eventually(lambda: os.stat(path).st_size == size), os.stat(path)
        assert path.read_bytes() == theirs
        with open(path, "rb") as again:
            assert again.read() == theirs
        assert reader.read() == ours                 # the reader keeps its version
    finally:
        reader.close()
    assert path.read_bytes() == theirs
    with open(path, "ab") as appender:               # and the name takes the next save
        appender.write(b"+")
    run_ckptfs("wait", str(a.path), check=True, timeout=60)
    fresh = make_mount(store, name="fresh")
    assert (fresh.path / "f0").read_bytes() == theirs + b"+"


def test_a_truncate_by_name_leaves_a_lingering_readers_bytes(local_store, make_mount):
    """``truncate(path)`` beside a reader that joined a passthrough save: the new
    version took over the staging file the kernel reads for that reader and cut it in
    place (the reader read 10 of its 100 000 bytes).  Now the name moves to a fresh
    inode first, as for an open for writing."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path = node.path / "f0"
    ours = os.urandom(100_000)
    with open(path, "wb") as writer:
        writer.write(ours)
        writer.flush()
        reader = open(path, "rb", buffering=0)
    try:
        run_ckptfs("wait", str(node.path), check=True, timeout=60)
        os.truncate(path, 10)
        assert path.read_bytes() == ours[:10]
        assert reader.read() == ours
    finally:
        reader.close()
    run_ckptfs("wait", str(node.path), check=True, timeout=60)
    assert (make_mount(local_store, name="fresh").path / "f0").read_bytes() == ours[:10]


def test_a_linked_file_with_a_lingering_reader_takes_the_next_save(local_store, make_mount):
    """A hard-linked file whose uploaded version a passthrough reader still reads: its
    next save was refused with EBUSY for as long as the reader stayed open (only a file
    with one name could move to a fresh inode).  Now all its names move together."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path, link = node.path / "latest.pt", node.path / "latest.lnk"
    ours, theirs = os.urandom(100_000), os.urandom(60_000)
    with open(path, "wb") as writer:
        writer.write(ours)
        writer.flush()
        reader = open(path, "rb", buffering=0)
    try:
        os.link(path, link)
        run_ckptfs("wait", str(node.path), check=True, timeout=60)
        with open(path, "wb") as writer:
            writer.write(theirs)
        assert link.read_bytes() == theirs and os.stat(link).st_nlink == 2
        assert reader.read() == ours
    finally:
        reader.close()
    run_ckptfs("wait", str(node.path), check=True, timeout=60)
    fresh = make_mount(local_store, name="fresh")
    assert (fresh.path / "latest.lnk").read_bytes() == theirs
    assert os.stat(fresh.path / "latest.pt").st_nlink == 2


EXIT_HOLDING_TWICE = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
again = os.open(sys.argv[1], os.O_RDWR)
data = memoryview(sys.stdin.buffer.read())
while data:
    data = data[os.write(fd, data):]
os._exit(0)
"""


def test_a_file_saved_by_a_process_that_exits_holding_it_twice_reads_whole_at_once(
        local_store, make_mount):
    """Soak seed 1215482: the exit flushes both descriptors before either release; the
    close decision comes after the last release, in the background.  A reader that
    opened right after the exit read an empty file about one time in twenty (the
    daemon's size was the bytes it had seen written: none, the kernel wrote them).
    Thirty saves, each read at once."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    for i in range(30):
        data = os.urandom(140_000)
        path = node.path / f"f{i}"
        subprocess.run([sys.executable, "-c", EXIT_HOLDING_TWICE, str(path)], input=data,
                       check=True)
        assert path.read_bytes() == data, f"save {i} read back wrong"
    run_ckptfs("wait", str(node.path), check=True)
