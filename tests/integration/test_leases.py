"""Issue 15: a seal waits for every writer on every node (cluster seal leases,
docs/decisions/0004-cluster-seal-leases.md).  Three mounts of one store, each with its
own state dir, stand for three nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ckptfs.store import open_store

from support.mounts import eventually, run_ckptfs

FAST = ("--lease-ttl", "1")          # renew every 0.33 s, dead after 2 s unrenewed
REQUESTS = ("puts", "gets", "lists", "deletes", "heads")


def listing(path):
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return None


def hf_rank0(ckpt) -> dict[str, bytes]:
    """Rank 0 of the HF Trainer: weights, then the completion mark."""
    files = {"model.safetensors": os.urandom(64 << 10),
             "trainer_state.json": json.dumps({"global_step": 4}).encode()}
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
    return files


def raw_store(spec, monkeypatch):
    for key, value in spec.env.items():
        monkeypatch.setenv(key, value)
    return open_store(spec.url)


def lease_keys(spec, monkeypatch) -> list[str]:
    return [o.key for o in raw_store(spec, monkeypatch).list("leases/")]


HOLDER = r"""
import sys
files = {}
for line in sys.stdin:
    op, path, *data = line.split()
    if op == "open":
        files[path] = open(path, "wb", buffering=0)
    elif op == "write":
        files[path].write(bytes.fromhex(data[0]))
    elif op == "close":
        files.pop(path).close()
    print("ok", flush=True)
"""


class Writer:
    """A separate process that opens, writes and closes files when told.  The test
    process itself spawns `ckptfs status` and friends: a descriptor it held would be
    inherited by those children and closed at their exec (a FUSE flush)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _do(self, *words) -> None:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def open(self, path) -> None:
        self._do("open", path)

    def write(self, path, data: bytes) -> None:
        self._do("write", path, data.hex())

    def close(self, path) -> None:
        self._do("close", path)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def three(store, make_mount, *extra, c_extra=()):
    a = make_mount(store, name="a", extra=extra)
    b = make_mount(store, name="b", extra=extra)
    c = make_mount(store, name="c", extra=(*extra, *c_extra))
    return a, b, c


def test_seal_waits_for_a_writer_on_another_node(store, make_mount):
    """The issue's reproduction: rank 7 on node B still writes while rank 0 on node A
    closes trainer_state.json.  Node C shows nothing until B closes, then all of it."""
    a, b, c = three(store, make_mount)
    (a.path / "out" / "checkpoint-4").mkdir(parents=True)
    ckpt_b = b.path / "out" / "checkpoint-4"
    assert eventually(ckpt_b.is_dir)
    rng = os.urandom(8192)
    writer = Writer()
    rank7 = ckpt_b / "rng_state_7.pth"
    try:
        writer.open(rank7)
        writer.write(rank7, rng[:4096])
        files = hf_rank0(a.path / "out" / "checkpoint-4")
        time.sleep(2.5)
        assert listing(c.path / "out") == []
        assert listing(a.path / "out") == []
        pending = a.status()["pending_seals"]
        assert [p["path"] for p in pending] == ["/out/checkpoint-4"]
        assert pending[0]["waiting_for"] == [b.status()["node_id"]]
        assert pending[0]["dead"] == []
        writer.write(rank7, rng[4096:])
        writer.close(rank7)
    finally:
        writer.stop()
    files["rng_state_7.pth"] = rng
    assert eventually(lambda: listing(c.path / "out") == ["checkpoint-4"], timeout=30)
    assert listing(c.path / "out" / "checkpoint-4") == sorted(files)
    for name, data in files.items():
        assert (c.path / "out" / "checkpoint-4" / name).read_bytes() == data
    assert eventually(lambda: a.status()["pending_seals"] == [])


def _hold_then_crash(store, make_mount, monkeypatch, kill_daemon: bool):
    a, b, c = three(store, make_mount, *FAST, c_extra=("--gc-grace", "6"))
    (a.path / "out" / "checkpoint-4").mkdir(parents=True)
    ckpt_b = b.path / "out" / "checkpoint-4"
    assert eventually(ckpt_b.is_dir)
    b_node = b.status()["node_id"]
    writer = Writer()
    rank7 = ckpt_b / "rng_state_7.pth"
    try:
        writer.open(rank7)
        writer.write(rank7, os.urandom(4096))
        hf_rank0(a.path / "out" / "checkpoint-4")
        if kill_daemon:
            b.kill()
    finally:
        writer.kill()
    crashed = time.monotonic()

    def dead_reported():
        pending = a.status()["pending_seals"]
        return pending and pending[0]["dead"] == [b_node] and pending[0]

    report = eventually(dead_reported, timeout=30)
    assert report and report["path"] == "/out/checkpoint-4", a.status()["pending_seals"]
    assert listing(c.path / "out") == []
    assert listing(a.path / "out") == []
    assert any(k.endswith(f"/{b_node}") for k in lease_keys(store, monkeypatch))
    time.sleep(max(0.0, 8 - (time.monotonic() - crashed)))   # past C's 6 s gc grace
    assert listing(c.path / "out") == []
    proc = run_ckptfs("gc", str(c.path))
    assert proc.returncode == 0, proc.stderr
    assert "removed staged tree /out/checkpoint-4" in proc.stdout
    assert lease_keys(store, monkeypatch) == []
    # A's pending seal finds the directory gone and gives up; nothing is ever listed.
    assert eventually(lambda: a.status()["pending_seals"] == [], timeout=30)
    assert listing(a.path / "out") == []
    assert eventually(lambda: not (c.path / "out" / "checkpoint-4").exists())


@pytest.mark.expect_log_errors(r"lease on \S+ is dead", r"was abandoned: this node's lease")
def test_killed_writer_on_another_node_keeps_checkpoint_staged_for_gc(store, make_mount,
                                                                       monkeypatch):
    _hold_then_crash(store, make_mount, monkeypatch, kill_daemon=False)


@pytest.mark.expect_log_errors(r"lease on \S+ is dead", r"was abandoned: this node's lease")
def test_killed_daemon_on_another_node_keeps_checkpoint_staged_for_gc(store, make_mount,
                                                                       monkeypatch):
    _hold_then_crash(store, make_mount, monkeypatch, kill_daemon=True)


def test_deepspeed_pointer_written_first_waits_for_the_other_node(store, make_mount):
    """DeepSpeed: every rank writes its shards into global_step10; rank 0 writes `latest`
    as soon as its own part is done, while a rank on node B still writes."""
    a, b, c = three(store, make_mount)
    (a.path / "run").mkdir()
    assert eventually((b.path / "run").is_dir)
    os.makedirs(a.path / "run" / "global_step10")
    os.makedirs(b.path / "run" / "global_step10", exist_ok=True)
    shards = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": os.urandom((256 << 10) + r)
              for r in range(2)}
    name0, name1 = sorted(shards)
    (a.path / "run" / "global_step10" / name0).write_bytes(shards[name0])
    writer = Writer()
    rank1 = b.path / "run" / "global_step10" / name1
    try:
        writer.open(rank1)
        writer.write(rank1, shards[name1][:1000])
        (a.path / "run" / "latest").write_text("global_step10")
        time.sleep(2.5)
        # Neither the checkpoint nor the pointer naming it shows anywhere yet: a loader
        # following `latest` must not reach an incomplete checkpoint.
        assert listing(c.path / "run") == []
        assert "global_step10" not in listing(a.path / "run")
        assert not (c.path / "run" / "latest").exists()
        writer.write(rank1, shards[name1][1000:])
        writer.close(rank1)
    finally:
        writer.stop()
    assert eventually(lambda: listing(c.path / "run") == ["global_step10", "latest"],
                      timeout=30)
    assert listing(c.path / "run" / "global_step10") == sorted(shards)
    for name, data in shards.items():
        assert (c.path / "run" / "global_step10" / name).read_bytes() == data


def test_queued_async_upload_on_another_node_holds_the_seal(store, make_mount):
    """Async durability: B's file is closed but its upload is still queued when A's mark
    closes.  The lease stays until B's file is published."""
    a = make_mount(store, name="a")
    b = make_mount(store, name="b", durability="async", faults={"rules": [
        {"op": "put", "prefix": "chunks/", "kind": "delay", "delay": 3}]})
    c = make_mount(store, name="c")
    (a.path / "checkpoint-6").mkdir()
    assert eventually((b.path / "checkpoint-6").is_dir)
    shard = os.urandom(1 << 20)
    (b.path / "checkpoint-6" / "rng_state_1.pth").write_bytes(shard)   # returns at once
    files = hf_rank0(a.path / "checkpoint-6")
    time.sleep(1.5)
    assert listing(c.path) == []
    assert b.status()["held_leases"] != []
    assert eventually(lambda: listing(c.path) == ["checkpoint-6"], timeout=60)
    assert listing(c.path / "checkpoint-6") == sorted([*files, "rng_state_1.pth"])
    assert (c.path / "checkpoint-6" / "rng_state_1.pth").read_bytes() == shard


def test_renamed_staged_directory_stays_staged_until_leases_clear(store, make_mount):
    """Decision 0004: a rename still moves the directory at once (writers elsewhere carry
    on: they write by directory id) but it is listed only when no node writes below it."""
    a, b, c = three(store, make_mount)
    (a.path / "step.orbax-checkpoint-tmp").mkdir()
    tmp_b = b.path / "step.orbax-checkpoint-tmp"
    assert eventually(tmp_b.is_dir)
    writer = Writer()
    shard = tmp_b / "shard-1"
    try:
        writer.open(shard)
        writer.write(shard, b"x" * 1000)
        (a.path / "step.orbax-checkpoint-tmp" / "shard-0").write_bytes(b"y" * 1000)
        os.rename(a.path / "step.orbax-checkpoint-tmp", a.path / "step")
        assert (a.path / "step").is_dir()
        assert listing(a.path) == []
        time.sleep(1.5)
        assert listing(c.path) == []
        writer.write(shard, b"x" * 1000)
        writer.close(shard)
    finally:
        writer.stop()
    assert eventually(lambda: listing(c.path) == ["step"], timeout=30)
    assert listing(c.path / "step") == ["shard-0", "shard-1"]
    assert (c.path / "step" / "shard-1").read_bytes() == b"x" * 2000


def test_pending_seal_survives_a_restart_of_the_sealing_daemon(store, make_mount):
    a, b, c = three(store, make_mount)
    (a.path / "checkpoint-2").mkdir()
    assert eventually((b.path / "checkpoint-2").is_dir)
    writer = Writer()
    rank1 = b.path / "checkpoint-2" / "rng_state_1.pth"
    try:
        writer.open(rank1)
        writer.write(rank1, b"r" * 100)
        hf_rank0(a.path / "checkpoint-2")
        assert eventually(lambda: a.status()["pending_seals"] != [])
        a.stop()
        a.start()
        assert [p["path"] for p in a.status()["pending_seals"]] == ["/checkpoint-2"]
        time.sleep(1.5)
        assert listing(c.path) == []
        writer.close(rank1)
    finally:
        writer.stop()
    assert eventually(lambda: listing(c.path) == ["checkpoint-2"], timeout=30)
    assert listing(c.path / "checkpoint-2") == ["model.safetensors", "rng_state_1.pth",
                                                "trainer_state.json"]


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in REQUESTS}


def test_lease_costs_nothing_per_file(store, make_mount):
    """One PUT and one DELETE per node per checkpoint, whatever the number of files; a
    second file opened under a leased directory costs no request at all."""
    m = make_mount(store, extra=("--metadata-ttl", "600"))

    def save(dirname: str, n: int) -> dict:
        d = m.path / dirname
        d.mkdir()
        before = m.store_stats()
        for i in range(n):
            (d / f"shard-{i}").write_bytes(os.urandom(1000))
        assert eventually(lambda: m.status()["held_leases"] == [])
        return _delta(before, m.store_stats())

    plain1, plain8 = save("plain-1", 1), save("plain-8", 8)
    ckpt1, ckpt8 = save("checkpoint-1", 1), save("checkpoint-8", 8)
    per_file = {k: (plain8[k] - plain1[k]) / 7 for k in REQUESTS}
    lease = {k: ckpt1[k] - plain1[k] for k in REQUESTS}
    assert lease == {"puts": 1, "gets": 0, "lists": 0, "deletes": 1, "heads": 0}
    assert {k: ckpt8[k] - plain8[k] for k in REQUESTS} == lease
    assert {k: ckpt8[k] - ckpt1[k] for k in REQUESTS} == {k: 7 * per_file[k] for k in REQUESTS}

    d = m.path / "checkpoint-9"
    d.mkdir()
    (d / "warm").write_bytes(b"w")           # the directory's listing is now cached
    writer = Writer()
    try:
        writer.open(d / "a")
        before = m.store_stats()
        lease_before = m.status()["lease_requests"]
        writer.open(d / "b")
        assert _delta(before, m.store_stats()) == {k: 0 for k in REQUESTS}
        assert m.status()["lease_requests"] == lease_before
        writer.close(d / "a")
        writer.close(d / "b")
    finally:
        writer.stop()


def test_commit_reports_a_pending_seal(local_store, make_mount):
    a, b, c = three(local_store, make_mount)
    (a.path / "checkpoint-5").mkdir()
    assert eventually((b.path / "checkpoint-5").is_dir)
    writer = Writer()
    part = b.path / "checkpoint-5" / "part"
    try:
        writer.open(part)
        writer.write(part, b"p")
        proc = run_ckptfs("commit", str(a.path / "checkpoint-5"))
        assert proc.returncode == 3, (proc.stdout, proc.stderr)
        assert b.status()["node_id"] in proc.stdout
        assert "seal pending" in proc.stdout
        writer.close(part)
    finally:
        writer.stop()
    assert eventually(lambda: listing(c.path) == ["checkpoint-5"], timeout=30)


def test_fsync_on_directory_waits_for_leases(local_store, make_mount):
    a, b, c = three(local_store, make_mount)
    (a.path / "checkpoint_7").mkdir()
    assert eventually((b.path / "checkpoint_7").is_dir)
    writer = Writer()
    part = b.path / "checkpoint_7" / "part"
    try:
        writer.open(part)
        writer.write(part, b"p")
        fd = os.open(a.path / "checkpoint_7", os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)
        time.sleep(1.5)
        assert listing(c.path) == []
        writer.close(part)
    finally:
        writer.stop()
    assert eventually(lambda: listing(c.path) == ["checkpoint_7"], timeout=30)
