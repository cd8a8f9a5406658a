"""The close decision reads the opener's mount table (which mount points show our
device in its namespace) at every close.  Reading and parsing ``mountinfo`` was most of
a small file's close (py-spy: 56 of 104 samples of ``flush`` in a ``cp -a``), and it
grows with the node's mounts (hundreds on a Kubernetes node).  ``MountTables`` keeps it
per mount namespace and reads it again only when the kernel says that table changed."""

from __future__ import annotations

import os
import subprocess

import pytest

from ckptfs.procstat import MountTables, _mounts_of_device, device_of_mount

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


def test_the_table_matches_a_fresh_read_and_is_not_read_again_unchanged():
    root_dev = device_of_mount(b"/")
    assert root_dev is not None
    tables = MountTables()
    first = tables.of(os.getpid(), root_dev)
    assert first == _mounts_of_device(os.getpid(), root_dev) and first
    reads = tables.reads
    for _ in range(50):
        assert tables.of(os.getpid(), root_dev) == first
    assert tables.reads == reads, "read again with nothing changed"


@needs_root
def test_a_mount_made_or_removed_in_the_namespace_is_seen_at_the_next_call(tmp_path):
    tables = MountTables()
    target = tmp_path / "m"
    target.mkdir()
    root_dev = device_of_mount(b"/")
    assert tables.of(os.getpid(), root_dev)          # cached, with its poll descriptor
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)],
                   check=True)
    try:
        dev = device_of_mount(os.fsencode(target))
        assert dev is not None
        seen = tables.of(os.getpid(), dev)
        assert list(seen.values()) == [os.fsencode(target)]
        assert seen == _mounts_of_device(os.getpid(), dev)
    finally:
        subprocess.run(["umount", str(target)], check=True)
    assert tables.of(os.getpid(), dev) == {}, "an unmounted mount point is still known"


def test_a_process_that_is_gone_has_no_table():
    tables = MountTables()
    child = subprocess.Popen(["true"])
    child.wait()
    assert tables.of(child.pid, b"0:1") == {}


def test_descriptors_kept_are_bounded():
    tables = MountTables(keep=2)
    dev = device_of_mount(b"/")
    children = [subprocess.Popen(["unshare", "--mount", "sleep", "30"])
                for _ in range(3)] if os.geteuid() == 0 else []
    try:
        for child in children:
            for _ in range(100):             # until unshare has exec'd sleep
                if os.readlink(f"/proc/{child.pid}/ns/mnt") != \
                        os.readlink("/proc/self/ns/mnt"):
                    break
                import time
                time.sleep(0.01)
            tables.of(child.pid, dev)
        tables.of(os.getpid(), dev)
        assert tables.held() <= 2
    finally:
        for child in children:
            child.kill()
            child.wait()
        tables.close()
    assert tables.held() == 0
