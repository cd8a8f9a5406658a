"""A daemon with few descriptors writes thousands of files (issue item 6): staging
descriptors stay bounded, so creates keep working, ``ckptfs wait`` answers and
``ckptfs umount`` returns; the daemon never holds more descriptors than its limit."""

from __future__ import annotations

import os
import resource
import time

import pytest

from support.mounts import run_ckptfs

LIMIT = 300        # the daemon's RLIMIT_NOFILE, soft and hard
FILES = 2000


def low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_thousands_of_files_under_a_low_descriptor_limit(local_store, make_mount,
                                                          durability):
    mnt = make_mount(local_store, durability=durability, preexec_fn=low_fd_limit)
    with open(f"/proc/{mnt.pid}/limits") as f:
        assert any(line.startswith("Max open files") and f" {LIMIT} " in line
                   for line in f), "the daemon does not run under the low limit"
    most = 0
    for i in range(FILES):
        with open(mnt.path / f"f{i:05d}.bin", "wb") as f:
            f.write(b"x" * 100 + str(i).encode())
        if i % 100 == 0:
            most = max(most, daemon_fds(mnt.pid))
    most = max(most, daemon_fds(mnt.pid))
    print(f"{durability}: {FILES} files, at most {most} daemon descriptors (limit {LIMIT})")
    assert most < LIMIT
    proc = run_ckptfs("wait", str(mnt.path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (mnt.path / "f01999.bin").read_bytes() == b"x" * 100 + b"1999"
    assert len(os.listdir(mnt.path)) == FILES
    started = time.monotonic()
    proc = run_ckptfs("umount", str(mnt.path), "--timeout", "30", timeout=300)
    print(f"umount --timeout 30: {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stderr
    mnt._wait_exit()           # gone, or a zombie of an exited process
    assert not os.path.ismount(mnt.path)
    assert len(list((local_store.root).rglob("*"))) > FILES    # the store has them
