"""Issue 8: the close decision and versions.  A name changes only at a close its
writer meant; a closed version is immutable; an open reader keeps its version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.mounts import eventually, fresh

MiB = 1 << 20

# A writer that stops halfway and waits on stdin: "kill" (SIGKILL from the test) or a
# line telling it how to go on.  Before stopping it can run a subprocess, fork a child
# that exits at once, or fsync.
WRITER = r"""
import os, subprocess, sys, hashlib
path, mib, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3]
block = hashlib.sha256(b"new").digest() * (1 << 15)
f = open(path, "wb")
for i in range(mib // 2):
    f.write(block)
f.flush()
if extra == "subprocess":
    subprocess.run(["true"], check=True)
elif extra == "fork":
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
elif extra == "fsync":
    os.fsync(f.fileno())
print("half", flush=True)
if sys.stdin.readline().strip() == "finish":
    for i in range(mib - mib // 2):
        f.write(block)
    f.close()
    print("done", flush=True)
"""


def new_bytes(mib: int) -> bytes:
    import hashlib
    return hashlib.sha256(b"new").digest() * (1 << 15) * mib


def start_writer(path: Path, mib: int, extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(mib), extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "half"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("extra", ["subprocess", "fork"])
def test_a_copy_closed_by_a_child_publishes_nothing(extra, store, make_mount):
    mnt = make_mount(store)
    old = os.urandom(MiB)
    (mnt.path / "model.bin").write_bytes(old)
    writer = start_writer(mnt.path / "model.bin", 8, extra)
    # The child's close came and went: nothing new is published yet...
    assert (fresh(make_mount, store).path / "model.bin").read_bytes() == old
    kill(writer)
    # ... and the killed writer publishes nothing either.
    assert (fresh(make_mount, store).path / "model.bin").read_bytes() == old
    assert (mnt.path / "model.bin").read_bytes() == old


def test_a_child_during_a_save_does_not_stop_the_real_close(store, make_mount):
    mnt = make_mount(store)
    writer = start_writer(mnt.path / "model.bin", 8, "subprocess")
    writer.stdin.write("finish\n")
    writer.stdin.flush()
    assert writer.stdout.readline().strip() == "done"
    writer.wait()
    assert (fresh(make_mount, store).path / "model.bin").read_bytes() == new_bytes(8)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_fsync_mid_write_then_kill_publishes_nothing(durability, store, make_mount):
    mnt = make_mount(store, durability=durability)
    old = os.urandom(MiB)
    (mnt.path / "model.bin").write_bytes(old)
    run_wait(mnt)
    writer = start_writer(mnt.path / "model.bin", 8, "fsync")
    run_wait(mnt)
    assert (fresh(make_mount, store).path / "model.bin").read_bytes() == old
    kill(writer)
    run_wait(mnt)
    assert (fresh(make_mount, store).path / "model.bin").read_bytes() == old
    assert (mnt.path / "model.bin").read_bytes() == old


def run_wait(mnt) -> None:
    from support.mounts import run_ckptfs
    run_ckptfs("wait", str(mnt.path), check=True)


def test_daemon_killed_under_an_open_writer_shows_the_last_published_version(
        store, make_mount):
    mnt = make_mount(store)
    old = os.urandom(MiB)
    (mnt.path / "model.bin").write_bytes(old)
    writer = start_writer(mnt.path / "model.bin", 8, "fsync")
    mnt.kill()
    kill(writer)
    mnt.start()
    assert (mnt.path / "model.bin").read_bytes() == old
    # No metadata operation can publish the torn bytes afterwards.
    os.chmod(mnt.path / "model.bin", 0o600)
    os.utime(mnt.path / "model.bin")
    assert (mnt.path / "model.bin").read_bytes() == old
    other = fresh(make_mount, store)
    assert (other.path / "model.bin").read_bytes() == old
    assert os.listdir(mnt.state_dir / "abandoned"), "the torn bytes are kept aside"


def test_a_new_file_whose_daemon_died_under_its_writer_disappears(store, make_mount):
    mnt = make_mount(store)
    writer = start_writer(mnt.path / "new.bin", 8, "none")
    mnt.kill()
    kill(writer)
    mnt.start()
    assert os.listdir(mnt.path) == []
    assert os.listdir(fresh(make_mount, store).path) == []


def test_recreating_a_name_right_after_its_writer_was_killed_works(store, make_mount):
    mnt = make_mount(store)
    writer = start_writer(mnt.path / "model.bin", 8, "none")
    os.stat(mnt.path / "model.bin")          # the kernel caches the name
    kill(writer)
    data = os.urandom(MiB)
    (mnt.path / "model.bin").write_bytes(data)      # at once: no ENOENT
    assert (mnt.path / "model.bin").read_bytes() == data
    assert (fresh(make_mount, store).path / "model.bin").read_bytes() == data


def test_a_closed_version_is_immutable_while_it_uploads(store, make_mount, tmp_path):
    # Async mode, uploads slowed down: v1 is closed and queued when v2 truncates the
    # same name and is killed.  v1 must reach the store, v2 must not.
    control = tmp_path / "faults.json"
    control.write_text('{"rules": [{"op": "put", "prefix": "chunks/", "kind": "delay", '
                       '"delay": 0.5}]}')
    mnt = make_mount(store, durability="async",
                     faults={"rules": [], "control_file": str(control)})
    v1 = os.urandom(8 * MiB + 5)
    (mnt.path / "last.ckpt").write_bytes(v1)
    writer = start_writer(mnt.path / "last.ckpt", 8, "none")
    kill(writer)
    control.write_text('{"rules": []}')
    run_wait(mnt)
    assert (mnt.path / "last.ckpt").read_bytes() == v1
    assert (fresh(make_mount, store).path / "last.ckpt").read_bytes() == v1


def test_an_open_reader_keeps_its_version(store, make_mount):
    a = make_mount(store, name="a")
    b = make_mount(store, name="b")
    v1 = os.urandom(64 * MiB)
    v2 = os.urandom(64 * MiB)
    (a.path / "model.bin").write_bytes(v1)
    assert eventually(lambda: (b.path / "model.bin").exists())
    with open(b.path / "model.bin", "rb") as reader:
        head = reader.read(17 * MiB)
        (a.path / "model.bin").write_bytes(v2)
        # B's mount learns of v2 ...
        assert eventually(lambda: _digest_in_child(b.path / "model.bin") == _digest(v2))
        # ... while the reader that opened v1 goes on reading v1.
        rest = reader.read()
    assert head + rest == v1


def _digest(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


def _digest_in_child(path: Path) -> str:
    code = "import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],'rb').read()).hexdigest())"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True).stdout.strip()


INTERRUPTED_SAVE = r"""
import os, signal, sys, torch
path, how = sys.argv[1], sys.argv[2]

class Boom:
    def __reduce_ex__(self, proto):
        raise MemoryError("out of memory in the middle of a save")

state = {"weights": torch.arange(1 << 20, dtype=torch.float32), "later": Boom()}
if how == "exception":
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
    except MemoryError:
        pass
    except OSError as exc:     # the close of the torn file reports EIO
        print("close-error", exc.errno, flush=True)
    else:
        sys.exit("save did not fail")
    print("unwound", flush=True)
elif how == "sigterm":
    # A SIGTERM handler that exits (Lightning, SLURM requeue): sys.exit(1) unwinds the
    # save from a live process, which then closes the half-written file.
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))
    big = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(64)}

    class Stall:
        def __reduce_ex__(self, proto):
            os.kill(os.getpid(), signal.SIGTERM)
            return (int, (0,))
    big["stall"] = Stall()
    with open(path, "wb") as f:
        torch.save(big, f)
"""


@pytest.mark.parametrize("how", ["exception", "sigterm"])
@pytest.mark.expect_log_errors(r"not published: incomplete torch archive")
def test_an_interrupted_torch_save_is_not_published(how, store, make_mount):
    import torch
    mnt = make_mount(store)
    torch.save({"weights": torch.ones(1000)}, mnt.path / "model.pt")
    before = (mnt.path / "model.pt").read_bytes()
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_SAVE, str(mnt.path / "model.pt"),
                           how], capture_output=True, text=True, timeout=120)
    if how == "exception":
        assert "unwound" in proc.stdout, proc.stderr
    assert (mnt.path / "model.pt").read_bytes() == before
    other = fresh(make_mount, store)
    assert (other.path / "model.pt").read_bytes() == before
    assert torch.load(other.path / "model.pt")["weights"].sum() == 1000
    log = (mnt.state_dir / "ckptfs.log").read_text()
    assert "model.pt not published: incomplete torch archive" in log


def test_a_complete_torch_save_still_publishes(store, make_mount):
    import torch
    mnt = make_mount(store)
    torch.save({"w": torch.arange(10)}, mnt.path / "ok.pt")
    other = fresh(make_mount, store)
    assert torch.equal(torch.load(other.path / "ok.pt")["w"], torch.arange(10))


# A process that exits (or is killed) holding one file open several times for writing:
# it writes through the first descriptor and never closes any.
EXIT_HOLDING = r"""
import os, signal, sys
path, how, count, existing = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
flags = os.O_RDWR | os.O_TRUNC | (0 if existing else os.O_CREAT)
fds = [os.open(path, flags, 0o644)] + [os.open(path, os.O_RDWR) for _ in range(count - 1)]
os.write(fds[0], b"written through one of several descriptors " * 5000)
if how == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)
"""
EXIT_BYTES = b"written through one of several descriptors " * 5000


def exit_holding(path: Path, how: str, count: int, existing: bool) -> int:
    return subprocess.run([sys.executable, "-c", EXIT_HOLDING, str(path), how, str(count),
                           "1" if existing else "0"]).returncode


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("existing", [False, True], ids=["new file", "existing file"])
def test_an_exit_holding_a_file_open_several_times_publishes_it(
        durability, existing, store, make_mount):
    """The kernel flushes every descriptor at exit, then releases them: each flush saw
    another descriptor still open and passed the close on, and the last release took
    the version for one nobody closed -- a new file vanished, an existing one went back
    to its old bytes, after an exit with status 0 (a hostile run's sqlite in WAL mode).
    The last release now makes the close decision the last flush passed on."""
    mnt = make_mount(store, durability=durability)
    path = mnt.path / "db"
    if existing:
        path.write_bytes(b"the version before")
    assert exit_holding(path, "exit", 3 if existing else 2, existing) == 0
    run_wait(mnt)
    assert path.read_bytes() == EXIT_BYTES
    assert (fresh(make_mount, store).path / "db").read_bytes() == EXIT_BYTES


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_writer_killed_holding_a_file_open_twice_publishes_nothing(
        durability, store, make_mount):
    mnt = make_mount(store, durability=durability)
    path = mnt.path / "db"
    path.write_bytes(b"the version before")
    run_wait(mnt)
    assert exit_holding(path, "killed", 2, True) == -signal.SIGKILL
    run_wait(mnt)
    assert path.read_bytes() == b"the version before"
    assert (fresh(make_mount, store).path / "db").read_bytes() == b"the version before"


# The C idiom torch.from_file(shared=True) follows: map MAP_SHARED, close the descriptor,
# write through the mapping, msync, munmap.  (ctypes: Python's mmap keeps a dup.)
MAP_AFTER_CLOSE = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
path, size = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, size)
addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
assert addr != ctypes.c_void_p(-1).value
os.close(fd)
ctypes.memset(addr, ord("M"), size // 2)
ctypes.memset(addr + size - 10, ord("Z"), 10)
assert libc.msync(addr, size, 4) == 0      # MS_SYNC
assert libc.munmap(addr, size) == 0
"""


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("existing", [False, True], ids=["new file", "existing file"])
def test_writes_through_a_mapping_after_the_close_are_kept(durability, existing,
                                                          local_store, make_mount):
    """Writes that reach the daemon after the descriptor's close (the mapping's
    writeback) started a version no close decided, and its release dropped them: the
    file stayed all zeros (a helper's run; ``torch.from_file(shared=True)`` too)."""
    mnt = make_mount(local_store, durability=durability, extra=("--passthrough", "off"))
    path, size = mnt.path / "mapped.bin", 1 << 20
    if existing:
        path.write_bytes(b"O" * size)
    subprocess.run([sys.executable, "-c", MAP_AFTER_CLOSE, str(path), str(size)], check=True)
    want = b"M" * (size // 2) + (b"O" if existing else b"\0") * (size // 2 - 10) + b"Z" * 10
    run_wait(mnt)
    assert path.read_bytes() == want
    assert (fresh(make_mount, local_store).path / "mapped.bin").read_bytes() == want
