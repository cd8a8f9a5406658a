"""Async durability is local-first (issue 9 §2, decision 0012): with the store down,
mkdir, save, rename, unlink and seals proceed on the node and are journaled; they reach
the store in order when it answers again, and a renamed or sealed tree appears complete
on other nodes, never half."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from support.mounts import eventually, run_ckptfs
from support.mounts import fresh

MiB = 1 << 20


@pytest.mark.expect_log_errors(r"store timeout: ", r"store closed: ", r"store error: ",
                               r"failed after \d+ attempts")
def test_saves_renames_removals_and_seals_proceed_while_the_store_hangs(
        store_proxy, s3_store, make_mount):
    mnt = make_mount(store_proxy, durability="async", extra=("--store-timeout", "5"))
    root = mnt.path
    (root / "old.bin").write_bytes(b"old")
    (root / "keep").mkdir()
    run_ckptfs("wait", str(root), check=True, timeout=120)
    os.listdir(root)
    os.listdir(root / "keep")

    store_proxy.proxy.mode = "hang"
    weights, optim = os.urandom(3 * MiB), os.urandom(MiB)
    times: dict[str, float] = {}

    def timed(what: str, step) -> None:
        started = time.monotonic()
        step()
        times[what] = round(time.monotonic() - started, 3)

    tmp = root / "tmp-checkpoint-1"
    timed("mkdir", tmp.mkdir)
    timed("save 2 files", lambda: ((tmp / "model.bin").write_bytes(weights),
                                   (tmp / "optim.bin").write_bytes(optim)))
    timed("mv directory", lambda: os.rename(tmp, root / "checkpoint-1"))
    timed("unlink", lambda: os.unlink(root / "old.bin"))
    timed("create again", lambda: (root / "old.bin").write_bytes(b"new"))
    timed("mkdir staged", (root / "checkpoint-2").mkdir)
    (root / "checkpoint-2" / "model.bin").write_bytes(b"w2")
    timed("seal by mark", lambda: (root / "checkpoint-2" / "trainer_state.json")
          .write_text("{}"))
    timed("rmdir", (root / "keep").rmdir)
    (root / "checkpoint-3").mkdir()
    (root / "checkpoint-3" / "model.bin").write_bytes(b"w3")
    commit: list = []
    timed("ckptfs commit", lambda: commit.append(
        run_ckptfs("commit", str(root / "checkpoint-3"), timeout=60)))
    assert commit[0].returncode == 0 and "seal journaled" in commit[0].stdout, commit[0]
    print(f"with the store hanging: {times}")

    # This node sees its own work at once (checkpoint-2 is staged until its seal lands).
    assert sorted(os.listdir(root)) == ["checkpoint-1", "old.bin"]
    assert (root / "checkpoint-1" / "model.bin").read_bytes() == weights
    assert (root / "old.bin").read_bytes() == b"new"
    fs = mnt.status()["fs"]
    assert fs["pending_metadata"] >= 8, fs   # mkdir x3, mv, unlink, seal x2, rmdir
    # Another node sees none of it yet: nothing half-done reached the store.
    other = fresh(make_mount, s3_store)
    assert sorted(os.listdir(other.path)) == ["keep", "old.bin"]
    assert (other.path / "old.bin").read_bytes() == b"old"

    # Stopped with the store still down: the log stays journaled; the next mount
    # replays it in order once the store answers.
    proc = run_ckptfs("umount", str(root), "--timeout", "3", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stay journaled" in proc.stderr
    store_proxy.proxy.mode = "pass"
    mnt.start("--store-timeout", "5", durability="async")
    run_ckptfs("wait", str(root), check=True, timeout=120)
    assert mnt.status()["fs"]["pending_metadata"] == 0

    assert eventually(lambda: sorted(os.listdir(other.path)) ==
                      ["checkpoint-1", "checkpoint-2", "checkpoint-3", "old.bin"]), \
        os.listdir(other.path)
    assert (other.path / "checkpoint-1" / "model.bin").read_bytes() == weights
    assert (other.path / "checkpoint-1" / "optim.bin").read_bytes() == optim
    assert (other.path / "old.bin").read_bytes() == b"new"   # removed, then created anew
    assert sorted(os.listdir(other.path / "checkpoint-2")) == ["model.bin",
                                                               "trainer_state.json"]
    assert not (other.path / "tmp-checkpoint-1").exists()
    assert sorted(os.listdir(root)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3",
                                        "old.bin"]


def test_mv_never_waits_for_uploads_and_the_renamed_tree_lands_whole(local_store, make_mount,
                                                                     tmp_path):
    """Uploads are slowed down (0.3 s per chunk PUT); ``mv`` returns while they are
    pending; an observer polling the store never sees the new name without all of its
    files."""
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    root = mnt.path
    tmp = root / "step-5.tmp"
    tmp.mkdir()
    run_ckptfs("wait", str(root), check=True, timeout=120)
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "chunks/",
                                              "kind": "delay", "delay": 0.3}]}))
    names = [f"shard-{i}.bin" for i in range(8)]
    for name in names:
        (tmp / name).write_bytes(os.urandom(64 << 10))

    seen_half: list[str] = []
    seen_whole = threading.Event()
    stop = threading.Event()
    entry = local_store.root / "dirs" / "root" / "step-5"

    def observe() -> None:
        while not stop.is_set():
            try:
                dir_id = json.loads(entry.read_text())["id"]
            except (FileNotFoundError, ValueError):
                time.sleep(0.005)
                continue
            present = [n for n in names
                       if (local_store.root / "dirs" / dir_id / n).exists()]
            if len(present) != len(names):
                seen_half.append(f"{len(present)}/{len(names)}")
            else:
                seen_whole.set()
            time.sleep(0.005)

    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    try:
        os.rename(tmp, root / "step-5")
        # Read through the stats xattr, not the CLI: starting a Python process took
        # longer than the slowed uploads on a loaded machine (the test failed on main).
        pending = mnt.stats()["pending_uploads"]
        assert pending >= 1, "mv waited for the uploads below it"
        run_ckptfs("wait", str(root), check=True, timeout=120)
        assert seen_whole.wait(30)
    finally:
        stop.set()
        observer.join(5)
    assert not seen_half, f"the store showed step-5 incomplete: {seen_half[:5]}"
    assert sorted(os.listdir(fresh(make_mount, local_store).path / "step-5")) == names


def test_two_nodes_making_one_directory_share_it(store, make_mount):
    """Ranks on two nodes ``makedirs`` the same checkpoint directory.  Node b's store is
    slow (its first create of the name takes 3 s), so b makes the directory locally
    (local-first) and its rank saves into it; when b's record reaches the store it finds
    a's directory there and joins it: both ranks' files end up in one directory."""
    a = make_mount(store, name="a", durability="async")
    b = make_mount(store, name="b", durability="async", extra=("--metadata-ttl", "3600"),
                   faults={"rules": [{"op": "put_if_absent", "prefix": "dirs/root/run-7",
                                      "kind": "delay", "delay": 3, "times": 1}]})
    os.listdir(b.path)                     # b knows the root without run-7
    os.makedirs(a.path / "run-7", exist_ok=True)
    (a.path / "run-7" / "rank0.bin").write_bytes(b"\x00" * 4096)
    os.makedirs(b.path / "run-7", exist_ok=True)
    (b.path / "run-7" / "rank1.bin").write_bytes(b"\x01" * 4096)
    for m in (a, b):
        run_ckptfs("wait", str(m.path), check=True, timeout=120)
    assert "joined its directory" in (b.state_dir / "ckptfs.log").read_text()
    other = fresh(make_mount, store)
    assert sorted(os.listdir(other.path / "run-7")) == ["rank0.bin", "rank1.bin"]
    assert (other.path / "run-7" / "rank1.bin").read_bytes() == b"\x01" * 4096
    for m in (a, b):   # both nodes see the joined directory
        assert eventually(lambda: sorted(os.listdir(m.path / "run-7")) ==
                          ["rank0.bin", "rank1.bin"]), os.listdir(m.path / "run-7")


@pytest.mark.expect_log_errors(r"store timeout: ", r"store closed: ", r"store error: ",
                               r"failed after \d+ attempts")
def test_writers_wait_for_uploads_past_max_staged(store_proxy, s3_store, make_mount):
    """With the store down, closed-but-unuploaded bytes stop growing at --max-staged:
    the next writer waits (status says so) and goes on once uploads drain."""
    mnt = make_mount(store_proxy, durability="async",
                     extra=("--store-timeout", "5", "--max-staged", "4M"))
    os.listdir(mnt.path)
    store_proxy.proxy.mode = "hang"
    parts = [os.urandom(3 * MiB) for _ in range(3)]
    done: list[int] = []

    def save() -> None:
        for i, data in enumerate(parts):
            (mnt.path / f"part-{i}.bin").write_bytes(data)
            done.append(i)

    writer = threading.Thread(target=save, daemon=True)
    writer.start()
    assert eventually(lambda: mnt.status()["fs"]["writers_waiting_for_uploads"] == 1, 60)
    fs = mnt.status()["fs"]
    assert done == [0, 1] and fs["staged_bytes"] == 6 * MiB and fs["max_staged"] == 4 * MiB
    assert writer.is_alive()
    store_proxy.proxy.mode = "pass"
    writer.join(120)
    assert done == [0, 1, 2]
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    other = fresh(make_mount, s3_store)
    for i, data in enumerate(parts):
        assert (other.path / f"part-{i}.bin").read_bytes() == data


@pytest.mark.expect_log_errors(r"store timeout: ", r"store closed: ", r"store error: ",
                               r"failed after \d+ attempts")
def test_a_writer_held_past_max_staged_can_be_killed(store_proxy, s3_store, make_mount):
    """Hostile run E: a writer waiting for uploads past --max-staged while the store was
    away could not be killed, not even by SIGKILL (state D for as long as the store
    stayed away, over 10 minutes once): the kernel waits for the daemon's answer to a
    request it is working on.  Now the wait answers EINTR once the writer is being
    killed, and the killed writer's file is left unpublished."""
    mnt = make_mount(store_proxy, durability="async",
                     extra=("--store-timeout", "5", "--max-staged", "4M"))
    os.listdir(mnt.path)
    store_proxy.proxy.mode = "hang"
    script = ("import os, sys\n"
              "for i in range(3):\n"
              "    with open(os.path.join(sys.argv[1], f'part-{i}.bin'), 'wb') as f:\n"
              "        f.write(os.urandom(3 << 20))\n")
    writer = subprocess.Popen([sys.executable, "-c", script, str(mnt.path)])
    try:
        assert eventually(lambda: mnt.status()["fs"]["writers_waiting_for_uploads"] == 1, 60)
        writer.kill()
        writer.wait(timeout=10)         # before: still in state D after 30 s
    finally:
        writer.kill()
    assert eventually(lambda: mnt.status()["fs"]["writers_waiting_for_uploads"] == 0, 10)
    store_proxy.proxy.mode = "pass"
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    other = fresh(make_mount, s3_store)
    assert sorted(os.listdir(other.path)) == ["part-0.bin", "part-1.bin"]


def test_a_joined_checkpoint_waits_for_the_joining_nodes_writer(local_store, make_mount):
    """Node b makes checkpoint-7 locally (its store is slow), opens its shard and joins
    node a's checkpoint-7 once its record reaches the store: its seal lease moves to the
    shared directory, so a's seal waits for b's writer instead of sealing without it."""
    a = make_mount(local_store, name="a", durability="async")
    b = make_mount(local_store, name="b", durability="async", extra=("--metadata-ttl", "3600"),
                   faults={"rules": [{"op": "put_if_absent", "prefix": "dirs/root/checkpoint-7",
                                      "kind": "delay", "delay": 3, "times": 1}]})
    os.listdir(b.path)
    os.makedirs(a.path / "checkpoint-7", exist_ok=True)
    os.makedirs(b.path / "checkpoint-7", exist_ok=True)
    shard = os.urandom(64 << 10)
    with open(b.path / "checkpoint-7" / "rank1.bin", "wb") as f:
        f.write(shard[:4096])
        f.flush()
        assert eventually(lambda: "joined its directory" in
                          (b.state_dir / "ckptfs.log").read_text(), 30)
        (a.path / "checkpoint-7" / "rank0.bin").write_bytes(b"rank0")
        (a.path / "checkpoint-7" / "trainer_state.json").write_text("{}")   # seals
        assert eventually(lambda: [p["path"] for p in a.status()["pending_seals"]] ==
                          ["/checkpoint-7"], 30), a.status()["pending_seals"]
        assert "checkpoint-7" not in os.listdir(make_mount(local_store, name="c").path)
        f.write(shard[4096:])
    run_ckptfs("wait", str(b.path), check=True, timeout=120)
    other = make_mount(local_store, name="d")
    assert eventually(lambda: "checkpoint-7" in os.listdir(other.path), 60)
    assert sorted(os.listdir(other.path / "checkpoint-7")) == ["rank0.bin", "rank1.bin",
                                                               "trainer_state.json"]
    assert (other.path / "checkpoint-7" / "rank1.bin").read_bytes() == shard


@pytest.mark.expect_log_errors(r"store timeout: ", r"store closed: ", r"store error: ",
                               r"failed after \d+ attempts")
def test_a_save_beside_a_reader_of_a_version_the_store_has_not_got_leaves_the_reader_whole(
        store_proxy, s3_store, make_mount):
    """The store hangs, so the version a reader opened is not uploaded: a save over it
    in place on the same node went on in place after 2 s, and the reader read its
    version cut at the new size.  The name now moves to a fresh inode that takes the
    owed version over (decision 0031, addendum of stop 49)."""
    mnt = make_mount(store_proxy, durability="async", extra=("--store-timeout", "5"))
    os.listdir(mnt.path)
    store_proxy.proxy.mode = "hang"
    v1, v2 = os.urandom(MiB), os.urandom(100)
    (mnt.path / "latest.pt").write_bytes(v1)
    fd = os.open(mnt.path / "latest.pt", os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == v1[:10]
        (mnt.path / "latest.pt").write_bytes(v2)
        assert os.fstat(fd).st_size == len(v1)
        data = bytearray()
        while chunk := os.pread(fd, MiB, len(data)):
            data += chunk
        assert bytes(data) == v1, f"the reader read {len(data)} of its {len(v1)} bytes"
    finally:
        os.close(fd)
    assert (mnt.path / "latest.pt").read_bytes() == v2
    assert "saved over while a reader" not in \
        (mnt.state_dir / "ckptfs.log").read_text(errors="replace")
    store_proxy.proxy.mode = "pass"
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    other = fresh(make_mount, s3_store)
    assert (other.path / "latest.pt").read_bytes() == v2
