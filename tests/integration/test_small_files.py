"""Small files (issue 25 item 4): what the cuts on their path must keep.  An async close,
chmod, utime, mkdir, rename and unlink no longer wait for an fsync of the journal
(meta/journalsync.py); what they did must still survive a crash of the daemon and reach
the store.  ``status --json`` counts the kernel's requests by operation.  Timing is
measured by tools/small_files.py and ``ckptfs bench``, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from support.mounts import fresh, run_ckptfs

KiB = 1024


def small_tree(root, dirs: int = 2, files: int = 10) -> dict[str, tuple[bytes, int]]:
    """``dirs`` x ``files`` files of 4 KiB: relative path -> (bytes, mode)."""
    tree = {}
    for d in range(dirs):
        (root / f"d{d}").mkdir(parents=True)
        for f in range(files):
            rel = f"d{d}/f{f}"
            data = os.urandom(4 * KiB)
            (root / rel).write_bytes(data)
            mode = 0o640 if f % 2 else 0o600
            os.chmod(root / rel, mode)
            os.utime(root / rel, ns=(10**18, 10**18 + f))
            tree[rel] = (data, mode)
    return tree


def seen(root) -> dict[str, tuple[bytes, int]]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = (open(path, "rb").read(),
                                                os.stat(path).st_mode & 0o777)
    return out


@pytest.mark.expect_log_errors(r"failed after \d+ attempts: injected transient fault")
def test_a_tree_copied_just_before_a_daemon_sigkill_is_kept_and_published(
        s3_store, make_mount, tmp_path):
    control = tmp_path / "faults.json"      # nothing reaches the store before the crash
    control.write_text(json.dumps({"rules": [{"op": "put", "prefix": "chunks/",
                                              "kind": "transient"}]}))
    # the daemon's data path: its counters show every file written through it
    mnt = make_mount(s3_store, durability="async", faults={"control_file": str(control)},
                     extra=("--passthrough", "off"))
    src = tmp_path / "src"
    tree = small_tree(src)
    subprocess.run(["cp", "-a", str(src), str(mnt.path / "tree")], check=True)
    os.rename(mnt.path / "tree/d0/f0", mnt.path / "tree/d0/renamed")
    os.unlink(mnt.path / "tree/d1/f1")
    tree["d0/renamed"] = tree.pop("d0/f0")
    del tree["d1/f1"]
    status = mnt.status()
    requests = status["fuse_requests"]
    # Every file was created, written and closed through this daemon.
    assert requests["create"] >= 20 and requests["write"] >= 20 and requests["flush"] >= 20
    assert requests["rename"] == 1 and requests["unlink"] == 1
    mnt.kill()                              # at once: no umount, no drain
    control.write_text(json.dumps({"rules": []}))
    mnt.start(durability="async")
    assert seen(mnt.path / "tree") == tree
    run_ckptfs("wait", str(mnt.path), check=True)
    other = fresh(make_mount, s3_store)
    assert seen(other.path / "tree") == tree
    assert os.stat(other.path / "tree/d1/f3").st_mtime_ns == 10**18 + 3


MiB = 1 << 20


def test_du_counts_the_blocks_a_sparse_file_holds(local_store, make_mount):
    """st_blocks (what ``du`` adds up) is the staging file's allocation while the file is
    staged here, and its chunks but those of zeros once it is only in the store; a dense
    file is never counted as less than its data."""
    mnt = make_mount(local_store, durability="async")
    with open(mnt.path / "sparse", "wb") as f:
        f.truncate(40 * MiB)
        f.seek(20 * MiB)
        f.write(b"x" * 4096)
    with open(mnt.path / "dense", "wb") as f:
        f.write(os.urandom(3 * MiB))
    sparse, dense = os.stat(mnt.path / "sparse"), os.stat(mnt.path / "dense")
    assert sparse.st_size == 40 * MiB and sparse.st_blocks * 512 <= 64 * KiB
    assert dense.st_blocks * 512 >= 3 * MiB
    run_ckptfs("wait", str(mnt.path), check=True)
    other = fresh(make_mount, local_store)          # remote only: counted from the chunks
    sparse, dense = os.stat(other.path / "sparse"), os.stat(other.path / "dense")
    # Of five 8 MiB chunks, four are zeros: one holds data.
    assert sparse.st_size == 40 * MiB and sparse.st_blocks * 512 == 8 * MiB
    assert dense.st_blocks * 512 >= 3 * MiB
    assert (other.path / "sparse").read_bytes()[20 * MiB:20 * MiB + 4096] == b"x" * 4096


def test_a_sparse_file_reopened_for_writing_keeps_its_holes(local_store, make_mount):
    """Reopened with ``r+`` on this node (its previous version copied) and on a fresh
    node (materialized from its chunks), a sparse file's working version holds its data,
    not its holes (fsstress filled a state dir with 24 GB of them)."""
    mnt = make_mount(local_store, durability="async")
    for name in ("here", "there"):
        with open(mnt.path / name, "wb") as f:
            f.truncate(40 * MiB)
            f.seek(20 * MiB)
            f.write(b"x" * 4096)
    run_ckptfs("wait", str(mnt.path), check=True)
    other = fresh(make_mount, local_store)
    for node, name in ((mnt, "here"), (other, "there")):
        with open(node.path / name, "r+b") as f:
            f.write(b"y")
            f.flush()
            held = os.fstat(f.fileno()).st_blocks * 512
        # At most the one 8 MiB chunk that holds data (written whole when materialized)
        # and the block the new byte went to.
        assert held <= 9 * MiB, f"{node.path.name}/{name}: {held} bytes held for 4 KiB"
        data = (node.path / name).read_bytes()
        assert data[:1] == b"y" and data[20 * MiB:20 * MiB + 4096] == b"x" * 4096
        assert len(data) == 40 * MiB and not any(data[1:20 * MiB])


def staging_spares(mnt) -> list[str]:
    return [name for name in os.listdir(mnt.state_dir / "staging") if name.startswith(".spare.")]


def test_spare_staging_files_serve_creates_and_never_outlive_their_daemon(local_store,
                                                                          make_mount):
    """A create renames an empty file made ahead (data/spares.py) instead of creating
    one on the request path; the spares left at an unmount are removed, and a killed
    daemon's at the next start, with every file written through them intact."""
    mnt = make_mount(local_store, durability="async")
    written = {f"f{i}": os.urandom(100 + i) for i in range(40)}
    for name, data in written.items():
        (mnt.path / name).write_bytes(data)
    assert staging_spares(mnt), "no spare staging files while mounted"
    assert mnt.status()["staging_spares"]["taken"] >= 30
    mnt.kill()
    assert staging_spares(mnt)                  # left by the crash
    mnt.start(durability="async")
    assert {n: (mnt.path / n).read_bytes() for n in written} == written
    run_ckptfs("wait", str(mnt.path), check=True)
    mnt.stop()
    assert staging_spares(mnt) == []
    other = fresh(make_mount, local_store)
    assert {n: (other.path / n).read_bytes() for n in written} == written
