"""Issue 14, part 2: no checkpoint is hidden forever by surprise.  A staged directory
that nothing on this node is writing (no open writer, no pending upload below it) and
that nobody sealed within ``stale_staged_after`` is reported once in the log and in
``ckptfs status``; ``ckptfs status --staged`` lists this node's staged directories."""

from __future__ import annotations

import os
import time

from support.mounts import eventually, run_ckptfs


def stale_paths(mnt) -> list[str]:
    return sorted(item["path"] for item in mnt.status()["stale_staged"])


def staged_listing(mnt) -> dict[str, tuple[float, str]]:
    """``ckptfs status --staged``: one line per staged directory: age, state, path."""
    proc = run_ckptfs("status", "--staged", str(mnt.path), check=True)
    out = {}
    for line in proc.stdout.splitlines()[1:]:
        age, state, path = line.split(None, 2)
        out[path] = (float(age.rstrip("s")), state)
    return out


def log_lines(mnt, needle: str) -> list[str]:
    text = (mnt.state_dir / "ckptfs.log").read_text(errors="replace")
    return [line for line in text.splitlines() if needle in line]


def test_stale_staged_reported_once_listed_and_gone_when_sealed(local_store, make_mount):
    mnt = make_mount(local_store, extra=("--stale-staged-after", "0.5"))
    done = mnt.path / "run" / "checkpoint-5"           # a save nobody sealed
    done.mkdir(parents=True)
    (done / "model.safetensors").write_bytes(b"w" * 1000)
    busy = mnt.path / "run" / "global_step3"           # a save still being written
    busy.mkdir()
    writer = open(busy / "shard.pt", "wb")
    writer.write(b"s" * 1000)
    writer.flush()
    try:
        assert eventually(lambda: stale_paths(mnt) == [str(done)]), mnt.status()
        listing = staged_listing(mnt)
        assert listing[str(done)][1] == "stale" and listing[str(done)][0] >= 0.5
        assert listing[str(busy)][1] == "writing"
        assert eventually(lambda: log_lines(mnt, str(done)))   # logged by the watch
        time.sleep(2)                                  # many scans later: still one report
        reports = log_lines(mnt, str(done))
        assert len(reports) == 1, reports
        assert f"ckptfs commit {done}" in reports[0] and "profile" in reports[0]
        assert stale_paths(mnt) == [str(done)]         # the open writer keeps its dir quiet
        assert log_lines(mnt, str(busy)) == []
    finally:
        writer.close()
    assert eventually(lambda: stale_paths(mnt) == sorted([str(done), str(busy)]))
    assert eventually(lambda: len(log_lines(mnt, str(busy))) == 1)   # logged by the watch
    assert run_ckptfs("commit", str(done)).returncode == 0
    assert eventually(lambda: stale_paths(mnt) == [str(busy)])
    assert str(done) not in staged_listing(mnt)
    assert os.listdir(mnt.path / "run") == ["checkpoint-5"]


def test_pending_upload_below_is_not_stale(local_store, make_mount):
    faults = {"rules": [{"op": "put", "prefix": "chunks/", "kind": "delay", "delay": 4}]}
    mnt = make_mount(local_store, durability="async", faults=faults,
                     extra=("--stale-staged-after", "0.3"))
    ckpt = mnt.path / "checkpoint_9"
    ckpt.mkdir()
    (ckpt / "w.pt").write_bytes(os.urandom(100_000))   # closed; its upload is held back
    checked_while_pending = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        status = mnt.status()
        if status["fs"]["pending_uploads"]:
            assert status["stale_staged"] == [], status
            checked_while_pending += 1
        time.sleep(0.2)
    assert checked_while_pending >= 3
    assert eventually(lambda: stale_paths(mnt) == [str(ckpt)], timeout=30)


def test_status_without_staged_dirs_and_default_threshold(local_store, make_mount):
    mnt = make_mount(local_store)
    (mnt.path / "checkpoint-1").mkdir()
    (mnt.path / "checkpoint-1" / "trainer_state.json").write_text("{}")   # sealed
    (mnt.path / "checkpoint-2").mkdir()                                   # staged, fresh
    status = mnt.status()
    assert status["stale_staged"] == [] and status["stale_staged_after"] == 600.0
    listing = staged_listing(mnt)
    assert list(listing) == [str(mnt.path / "checkpoint-2")]
    assert listing[str(mnt.path / "checkpoint-2")][1] == "idle"
