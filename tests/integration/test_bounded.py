"""Issue 9: bounded and clear under store faults and bad input.  A store that accepts
connections and never answers, or answers 503 forever, or goes away while uploads are
pending, never hangs a writer, an unmount or a SIGTERM past its bound; every failure
says what happened in one line; the daemon stays up.  Real FUSE mounts, real SeaweedFS
behind a fault-injecting TCP proxy (tests/proxy.py)."""

from __future__ import annotations

import errno
import os
import re
import time

import pytest

from conftest import eventually, run_ckptfs

MiB = 1 << 20


def fresh(make_mount, store, name="fresh"):
    return make_mount(store, name=name)


def daemon_log(mnt) -> str:
    return (mnt.state_dir / "ckptfs.log").read_text(errors="replace")


@pytest.mark.expect_log_errors(r"store timeout: ", r"upload failed")
def test_sync_close_against_a_hanging_store_fails_within_the_timeout(store_proxy, s3_store,
                                                                     make_mount):
    mnt = make_mount(store_proxy, extra=("--store-timeout", "5"))
    data = os.urandom(20 * MiB)
    f = open(mnt.path / "model.bin", "wb")     # the name is looked up while the store answers
    store_proxy.proxy.mode = "hang"
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        with f:
            f.write(data)
    elapsed = time.monotonic() - started
    print(f"sync close of 20 MiB against a hanging store: EIO after {elapsed:.1f} s")
    assert info.value.errno == errno.EIO
    assert elapsed < 60, elapsed               # bounded: 397 s before the deadline
    # One line names the operation and the key that timed out (a chunk of model.bin).
    timeouts = [line for line in daemon_log(mnt).splitlines()
                if re.search(r"ERROR ckptfs.store: store timeout: (put|exists) chunks/", line)]
    assert timeouts, daemon_log(mnt)
    # The daemon stays up; once the store answers again, work goes on.
    assert mnt.status()["ok"]
    store_proxy.proxy.mode = "pass"
    (mnt.path / "after.bin").write_bytes(b"store is back")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=120)
    other = fresh(make_mount, s3_store)
    assert eventually(lambda: (other.path / "model.bin").exists())   # retried in background
    assert (other.path / "model.bin").read_bytes() == data
    assert (other.path / "after.bin").read_bytes() == b"store is back"
