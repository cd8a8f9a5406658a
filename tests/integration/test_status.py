"""Status people can read (issue 12 part 3): ``ckptfs status`` prints a short summary,
``--json`` the daemon's full report (with its pid), ``--watch`` refreshes; progress of
long commands stays quiet when stderr is not a terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support.mounts import eventually, run_ckptfs


@pytest.mark.expect_log_errors(r"injected transient fault")
def test_human_status_shows_pending_and_errors(local_store, make_mount, tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": [{"op": op, "prefix": "dirs/root/slow",
                                              "kind": "transient"}
                                             for op in ("put", "put_if_absent")]}))
    mnt = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    (mnt.path / "slow").write_bytes(b"s" * 300_000)
    assert eventually(lambda: mnt.status()["fs"]["failing_uploads"])

    proc = run_ckptfs("status", str(mnt.path), check=True)
    text = proc.stdout
    print(text)
    assert not text.lstrip().startswith("{")
    assert f"pid {mnt.pid}" in text
    assert local_store.url in text and "async" in text
    assert "pending     1 upload(s), 293.0 KiB, oldest" in text
    assert "failing     1 upload(s): " in text and "injected transient fault" in text
    assert "transient" in text and "store error(s)" in text
    assert "cache" in text
    assert len(text.splitlines()) <= 12

    doc = json.loads(run_ckptfs("status", "--json", str(mnt.path), check=True).stdout)
    assert doc["pid"] == mnt.pid and doc["fs"]["pending_uploads"] == 1
    assert doc["oldest_pending_s"] >= 0 and doc["pending_bytes"] == 300_000

    control.write_text(json.dumps({"rules": []}))
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    text = run_ckptfs("status", str(mnt.path), check=True).stdout
    assert "pending     0 upload(s), 0 B" in text and "failing" not in text


def test_status_watch_refreshes(local_store, make_mount):
    mnt = make_mount(local_store)
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "status", "--watch",
                             "--interval", "0.2", str(mnt.path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        headers = 0
        deadline = time.monotonic() + 60
        while headers < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            headers += line.startswith("ckptfs on ")
            if headers == 2:
                (mnt.path / "f").write_bytes(b"x" * 2048)
        assert headers == 3, proc.stderr.read() if proc.poll() is not None else ""
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_progress_is_quiet_without_a_terminal(local_store, make_mount):
    a = make_mount(local_store, name="a")
    (a.path / "d").mkdir()
    (a.path / "d" / "big").write_bytes(os.urandom(3 << 20))
    b = make_mount(local_store, name="b")
    for args in (("prefetch", str(b.path / "d")), ("wait", str(b.path)),
                 ("gc", "--dry-run", str(b.path))):
        proc = run_ckptfs(*args, check=True)
        assert proc.stderr == "", (args, proc.stderr)
    assert "prefetched 1 file(s)" in run_ckptfs("prefetch", str(b.path / "d")).stdout
