"""Issue 9 §5-6: hostile store data stays EIO for the offending name only."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess

import pytest

from support.mounts import run_ckptfs


def _entry(local_store, dir_id: str, name: str, doc: dict) -> None:
    path = local_store.root / "dirs" / dir_id / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _dir_id(local_store, dir_id: str, name: str) -> str:
    return json.loads((local_store.root / "dirs" / dir_id / name).read_text())["id"]


@pytest.mark.expect_log_errors(r"corrupt entry .* has the same directory id as", r"corrupt entry .* names its own ancestor")
def test_directory_id_loops_and_aliases_answer_eio(local_store, make_mount):
    a = make_mount(local_store, name="a")
    (a.path / "top" / "mid").mkdir(parents=True)
    (a.path / "top" / "mid" / "f").write_bytes(b"data")
    top = _dir_id(local_store, "root", "top")
    mid = _dir_id(local_store, top, "mid")
    # An entry deep down that names its ancestor: an endless tree.
    _entry(local_store, mid, "loop", {"v": 1, "type": "dir", "mode": 0o755, "id": top})
    # Two names in one directory with one id: one directory twice.
    _entry(local_store, top, "alias", {"v": 1, "type": "dir", "mode": 0o755, "id": mid})
    b = make_mount(local_store, name="b")
    found = subprocess.run(["find", str(b.path)], capture_output=True, text=True, timeout=60)
    listed = sorted(os.path.relpath(p, b.path) for p in found.stdout.split())
    # One of the two names of the aliased directory is shown (with its content, once),
    # the other answers EIO; the loop is never followed.
    shown = "alias" if "top/alias" in listed else "mid"
    hidden = "mid" if shown == "alias" else "alias"
    assert listed == [".", "top", f"top/{shown}", f"top/{shown}/f"], listed
    for bad in (b.path / "top" / shown / "loop", b.path / "top" / hidden):
        with pytest.raises(OSError) as info:
            os.stat(bad)
        assert info.value.errno == errno.EIO
    proc = run_ckptfs("prefetch", str(b.path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (b.path / "top" / shown / "f").read_bytes() == b"data"


def test_setuid_and_setgid_bits_from_the_store_are_dropped(local_store, make_mount):
    a = make_mount(local_store, name="a")
    (a.path / "tool").write_bytes(b"#!/bin/sh\n")
    doc = json.loads((local_store.root / "dirs" / "root" / "tool").read_text())
    doc["mode"] = 0o6755
    _entry(local_store, "root", "tool", doc)
    b = make_mount(local_store, name="b")
    mode = os.stat(b.path / "tool").st_mode
    assert stat.S_IMODE(mode) == 0o755


def test_names_over_255_bytes_answer_enametoolong(store, make_mount):
    mnt = make_mount(store)
    long = "x" * 256
    for call in (lambda: os.stat(mnt.path / long), lambda: os.unlink(mnt.path / long),
                 lambda: os.chmod(mnt.path / long, 0o600),
                 lambda: os.truncate(mnt.path / long, 0),
                 lambda: os.rename(mnt.path / long, mnt.path / "y"),
                 lambda: os.rmdir(mnt.path / long), lambda: open(mnt.path / long, "wb")):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == errno.ENAMETOOLONG


def test_known_names_answer_from_local_metadata_while_the_store_hangs(local_store, make_mount,
                                                                      tmp_path):
    import threading
    import time
    control = tmp_path / "faults.json"
    control.write_text('{"rules": []}')
    mnt = make_mount(local_store, durability="async",
                     faults={"rules": [], "control_file": str(control)})
    (mnt.path / "run").mkdir()
    (mnt.path / "run" / "model.bin").write_bytes(b"weights")
    os.listdir(mnt.path / "run")
    # The store stops answering listings and entry reads (30 s each, longer than the
    # bound below).
    control.write_text(json.dumps({"rules": [
        {"op": "list", "kind": "delay", "delay": 30},
        {"op": "get", "prefix": "dirs/", "kind": "delay", "delay": 30}]}))
    time.sleep(1.5)   # past the metadata TTL: the next lookups want a fresh listing
    results = {}

    def work():
        results["ls"] = sorted(os.listdir(mnt.path / "run"))
        results["stat"] = os.stat(mnt.path / "run" / "model.bin").st_size
        results["read"] = (mnt.path / "run" / "model.bin").read_bytes()
        (mnt.path / "run" / "new.bin").write_bytes(b"saved while the store hangs")
        results["new"] = (mnt.path / "run" / "new.bin").read_bytes()

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(20)   # a correctness bound (the store would take 30 s per call)
    assert not worker.is_alive(), f"hung; got only {results}"
    assert results["ls"] == ["model.bin"]
    assert results["stat"] == 7 and results["read"] == b"weights"
    assert results["new"] == b"saved while the store hangs"
    control.write_text('{"rules": []}')
    assert run_ckptfs("wait", str(mnt.path), timeout=120).returncode == 0
    fresh = make_mount(local_store, name="fresh")
    assert (fresh.path / "run" / "new.bin").read_bytes() == b"saved while the store hangs"
