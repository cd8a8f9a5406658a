"""``ckptfs fsck --store URL`` against a real SeaweedFS (issue 25, item 3): a store a
real mount wrote is clean, also while a mount writes, renames and removes beside the
check; a chunk deleted behind the filesystem's back names the damaged file by path and
a node that still holds it puts it back (``--repair --state-dir``); corrupt bytes are
found by ``--full`` only; what cannot be checked is exit 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

from ckptfs.cli.commands import main
from ckptfs.format.chunkid import chunk_id
from ckptfs.format.remote import chunk_key
from support.mounts import eventually, one_line_failure, run_ckptfs
from support.s3_direct import direct_store

KiB = 1 << 10


@pytest.fixture
def fsck(monkeypatch, capsys):
    """``ckptfs fsck`` in this process (the command's own ``main``: a fresh interpreter
    per call would cost seconds of imports on a busy machine); the last test runs it
    as a process too."""
    def run(spec, *extra: str, url: str | None = None) -> subprocess.CompletedProcess:
        for name, value in spec.env.items():
            monkeypatch.setenv(name, value)
        args = ["fsck", "--store", url or spec.url, *extra]
        capsys.readouterr()
        code = main(args)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)
    return run


def raw_store(spec):
    return direct_store(spec.seaweed, prefix=spec.url.split("/", 3)[3])


def write_tree(root) -> dict[str, bytes]:
    files = {"ckpt/step-1/model.bin": os.urandom(96 * KiB),
             "ckpt/step-1/config.json": b'{"layers": 2}',
             "notes.txt": b"hello"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_fsck_finds_a_lost_chunk_by_path_and_a_node_puts_it_back(s3_store, make_mount, fsck):
    node = make_mount(s3_store)
    files = write_tree(node.path)
    proc = fsck(s3_store, "--full")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "result: clean"

    store = raw_store(s3_store)
    lost = chunk_id(files["ckpt/step-1/model.bin"])     # a new store names chunks by BLAKE3
    key = chunk_key(lost)
    store.delete(key)
    proc = fsck(s3_store)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert f"DAMAGED /ckpt/step-1/model.bin: 1 chunk(s) missing (first: {lost})" in lines
    assert [line for line in lines if line.startswith("DAMAGED")] == \
        [f"DAMAGED /ckpt/step-1/model.bin: 1 chunk(s) missing (first: {lost})"]
    assert lines[-1] == "result: DAMAGE: 1 damaged file, 1 missing chunk"

    proc = fsck(s3_store, "--repair", "--state-dir", str(node.state_dir), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["clean"] and report["damaged_files"] == [] and report["missing_chunks"] == []
    assert [r["chunk"] for r in report["repaired"]] == [lost]
    assert store.get(key)[0] == files["ckpt/step-1/model.bin"]

    # Other bytes of the same length under a chunk's key: only --full reads them.
    small = chunk_id(files["ckpt/step-1/config.json"])
    store.put(chunk_key(small), b'{"layers": 3}')
    proc = fsck(s3_store)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = fsck(s3_store, "--full")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"DAMAGED /ckpt/step-1/config.json: 1 chunk(s) corrupt (first: {small})" \
        in proc.stdout.splitlines()


def test_fsck_beside_a_live_mount_reports_no_damage(s3_store, make_mount, fsck):
    """In async mode: uploads, publishes, renames and removals all reach the store in
    the background while fsck reads it."""
    node = make_mount(s3_store, durability="async")
    write_tree(node.path)
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]                                   # writer's rounds finished

    def writer() -> None:
        """Publishes, renames files and directories, removes files, until stopped."""
        try:
            i = 0
            while not stop.is_set():
                d = node.path / f"d{i}"
                d.mkdir()
                (d / "f").write_bytes(os.urandom(4 * KiB) + str(i).encode())
                os.rename(d / "f", d / "g")
                if i:
                    prev = node.path / f"d{i - 1}"
                    if i % 2:
                        os.unlink(prev / "g")
                    os.rename(prev, node.path / f"m{i - 1}")
                i += 1
                done[0] = i
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        eventually(lambda: done[0] >= 2)
        before = done[0]
        proc = fsck(s3_store, "--full")
        after = done[0]
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert after > before, "the writer made no progress while fsck ran"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DAMAGED" not in proc.stdout and "DANGLING" not in proc.stdout


def test_fsck_that_cannot_run_says_why_in_one_line(s3_store, fsck):
    proc = run_ckptfs("fsck", "--store", "ftp://somewhere/x")     # as a process
    assert proc.returncode == 2
    assert "bad store URL" in one_line_failure(proc, "ckptfs: fsck: ")
    proc = fsck(s3_store)                          # a prefix no mount ever used
    assert proc.returncode == 2
    assert "no ckptfs.json marker" in one_line_failure(proc, "ckptfs: fsck: ")
    proc = fsck(s3_store, url="s3://no-such-bucket-here/x")
    assert proc.returncode == 2
    assert "does not exist" in one_line_failure(proc, "ckptfs: fsck: ")
    proc = fsck(s3_store, "--endpoint-url", "http://127.0.0.1:1", "--timeout", "5")
    assert proc.returncode == 2
    assert "store unreachable" in one_line_failure(proc, "ckptfs: fsck: ")
    proc = fsck(s3_store, "--repair")
    assert proc.returncode == 2
    assert "--state-dir" in one_line_failure(proc, "ckptfs: fsck: ")
