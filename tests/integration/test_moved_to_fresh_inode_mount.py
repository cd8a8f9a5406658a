"""A save beside a lingering passthrough reader moves the name to a fresh inode and
answers ESTALE (decision 0019, "Built (stop 42)"), on real mounts: a listing taken
across the move, O_RDWR, attributes right after, rename and unlink of the name while
the reader reads, readers opening the name in a loop across the moves."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading

import pytest

from support.mounts import eventually, run_ckptfs

MiB = 1 << 20


def _kernel_path(mount) -> None:
    doc = mount.status()
    assert doc["data_path"] == {"path": "kernel passthrough", "reason": None}, doc["data_path"]


def _lingering_reader(node, name: str = "latest.pt", fill: bytes = b"b"):
    """A passthrough save of ``name`` with a reader that joined it; its version in the
    store (``ckptfs wait``)."""
    path = node.path / name
    with open(path, "wb") as writer:
        writer.write(fill * MiB)
        writer.flush()
        reader = open(path, "rb")
    assert reader.read(4096) == fill * 4096
    run_ckptfs("wait", str(node.path), check=True)
    return path, reader


def test_a_listing_opened_before_the_move_names_the_fresh_inode(local_store, make_mount):
    """``ls`` (opendir, then getdents) across the save: the daemon's listing is taken
    at opendir, and its READDIRPLUS reply after the move gave the kernel a dentry of the
    name for the old, nameless inode (nlink 0) for the entry timeout: the name showed
    nlink 0, a reader's open of it answered ENOENT, and once the lingering reader had
    closed a writer's open answered ENOENT too.  A listing now names what holds each
    name when it answers."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path, reader = _lingering_reader(node)
    dfd = os.open(node.path, os.O_RDONLY | os.O_DIRECTORY)      # opendir: listed now
    try:
        with open(path, "wb") as writer:                        # the name moves
            writer.write(b"c" * MiB)
        assert "latest.pt" in os.listdir(dfd)                   # READDIRPLUS, after
    finally:
        os.close(dfd)
    seen: dict[str, object] = {"nlink": os.stat(path).st_nlink}
    try:
        with open(path, "rb") as again:
            seen["read"] = again.read(1)
    except OSError as exc:
        seen["read"] = errno.errorcode[exc.errno]
    reader.close()
    try:
        with open(path, "r+b") as writer:
            writer.write(b"d")
        seen["write"] = "ok"
    except OSError as exc:
        seen["write"] = errno.errorcode[exc.errno]
    assert seen == {"nlink": 1, "read": b"c", "write": "ok"}, seen


def test_a_save_beside_a_lingering_reader_then_open_rdwr(local_store, make_mount):
    """O_RDWR without O_TRUNC (no passthrough, a writer): it moves the name too, then
    copies the saved version out of the store into its working version."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path, reader = _lingering_reader(node)
    try:
        with open(path, "r+b") as writer:
            writer.seek(10)
            writer.write(b"X")
        assert reader.read(10) == b"b" * 10
        assert os.stat(path).st_ino != os.fstat(reader.fileno()).st_ino
    finally:
        reader.close()
    data = path.read_bytes()
    assert data == b"b" * 10 + b"X" + b"b" * (MiB - 11)


def test_plain_o_trunc_and_attributes_right_after(local_store, make_mount):
    """Plain O_TRUNC (no O_CREAT), then chmod/utime/setxattr on the name: the name's
    inode has them, the reader's old inode keeps its own; a fresh node sees the new
    ones; the old inode's staging file goes at the reader's close."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path, reader = _lingering_reader(node)
    os.setxattr(path, "user.tag", b"one")
    run_ckptfs("wait", str(node.path), check=True)
    old_ino = os.fstat(reader.fileno()).st_ino
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, b"c" * 100)
        finally:
            os.close(fd)
        os.chmod(path, 0o600)
        os.utime(path, ns=(1_000_000_000, 2_000_000_000))
        os.setxattr(path, "user.tag", b"two")
        st = os.stat(path)
        assert st.st_ino != old_ino
        assert (st.st_mode & 0o777, st.st_mtime_ns, st.st_size) == \
            (0o600, 2_000_000_000, 100)
        assert os.getxattr(path, "user.tag") == b"two"
        assert reader.read(100) == b"b" * 100
        assert os.getxattr(f"/proc/self/fd/{reader.fileno()}", "user.tag") == b"one"
    finally:
        reader.close()
    run_ckptfs("wait", str(node.path), check=True)
    staging = node.state_dir / "staging"
    eventually(lambda: not [p for p in os.listdir(staging)
                            if p.split(".")[0] == str(old_ino)])
    assert not [p for p in os.listdir(staging) if p.split(".")[0] == str(old_ino)]
    other = make_mount(local_store, name="fresh")
    st = os.stat(other.path / "latest.pt")
    assert (st.st_mode & 0o777, st.st_mtime_ns, st.st_size) == (0o600, 2_000_000_000, 100)
    assert os.getxattr(other.path / "latest.pt", "user.tag") == b"two"


def test_rename_and_unlink_of_the_name_while_the_reader_reads(local_store, make_mount):
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path, reader = _lingering_reader(node)
    try:
        with open(path, "wb") as writer:
            writer.write(b"c" * MiB)
        os.rename(path, node.path / "kept.pt")
        assert reader.read(MiB) == b"b" * (MiB - 4096)
        with open(node.path / "kept.pt", "rb") as f:
            assert f.read() == b"c" * MiB
        path.write_bytes(b"e" * 10)
        os.unlink(path)
        assert not path.exists()
    finally:
        reader.close()
    run_ckptfs("wait", str(node.path), check=True)
    other = make_mount(local_store, name="fresh")
    assert sorted(os.listdir(other.path)) == ["kept.pt"]
    assert (other.path / "kept.pt").read_bytes() == b"c" * MiB


def test_readers_hammering_the_name_across_the_moves(local_store, make_mount):
    """Readers opening the name in a loop while saves move it: no open of the name
    may fail (the name is never removed)."""
    node = make_mount(local_store, durability="async")
    _kernel_path(node)
    path = node.path / "latest.pt"
    path.write_bytes(b"a" * MiB)
    stop = threading.Event()
    errors: list[str] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                fd = os.open(path, os.O_RDONLY)
                os.close(fd)
            except OSError as exc:
                errors.append(errno.errorcode[exc.errno])

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    writer_errors: list[str] = []
    try:
        for round_ in range(6):
            fill = bytes([ord("b") + round_])
            try:
                p, reader = _lingering_reader(node, fill=fill)
            except OSError as exc:
                writer_errors.append(f"save {round_}: {errno.errorcode[exc.errno]}")
                continue
            try:
                with open(path, "wb") as writer:
                    writer.write(b"z" * 1000)
            except OSError as exc:
                writer_errors.append(f"next save {round_}: {errno.errorcode[exc.errno]}")
            finally:
                reader.close()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert (errors, writer_errors) == ([], []), (sorted(set(errors)), len(errors),
                                                 writer_errors)


@pytest.mark.expect_log_errors(r"failed after \d+ attempts")    # (the store refusing)
def test_a_daemon_killed_after_the_move_keeps_the_new_save_and_drops_the_old_inode(
        local_store, make_mount, tmp_path):
    """SIGKILL after the name moved and the next save closed (the store refusing its
    upload), the reader still holding the old inode: started again on its state, the
    name holds the new save (its writer was told it is saved), the save reaches the
    store, and the old, nameless inode's staging file is gone (recovery drops a
    nameless file that owes nothing)."""
    control = tmp_path / "faults-kill.json"
    control.write_text(json.dumps({"rules": []}))
    node = make_mount(local_store, durability="async", faults={"control_file": str(control)})
    _kernel_path(node)
    path, reader = _lingering_reader(node)
    old_ino = os.fstat(reader.fileno()).st_ino
    try:
        control.write_text(json.dumps({"rules": [{"op": "put", "kind": "transient"}]}))
        with open(path, "wb") as writer:
            writer.write(b"c" * MiB)
        assert os.stat(path).st_ino != old_ino
        assert run_ckptfs("wait", str(node.path), "--timeout", "2").returncode != 0
        node.kill()
    finally:
        with contextlib.suppress(OSError):   # ENOTCONN: its flush meets the dead mount
            reader.close()
    control.write_text(json.dumps({"rules": []}))
    node.start(durability="async")
    assert path.read_bytes() == b"c" * MiB
    run_ckptfs("wait", str(node.path), check=True, timeout=120)
    staging = node.state_dir / "staging"
    assert not [p for p in os.listdir(staging) if p.split(".")[0] == str(old_ino)], \
        sorted(os.listdir(staging))
    other = make_mount(local_store, name="fresh")
    assert (other.path / "latest.pt").read_bytes() == b"c" * MiB
