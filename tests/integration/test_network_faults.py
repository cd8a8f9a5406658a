"""Connection resets between the daemon and a real S3 server, through a loopback proxy:
retried with backoff; the file is published whole; the daemon stays up."""

from __future__ import annotations

import os


def test_connection_resets_are_retried(store_proxy, s3_store, make_mount):
    proxy = store_proxy.proxy
    mnt = make_mount(store_proxy)
    data = os.urandom(20 << 20)
    before = mnt.store_stats()["retries"]
    proxy.reset_all_and_next(3)      # a blip: open connections die, then 3 more
    (mnt.path / "a.bin").write_bytes(data)
    (mnt.path / "b.bin").write_bytes(data[::-1])
    stats = mnt.store_stats()
    assert proxy.resets_done == 3
    assert stats["retries"] > before
    assert (mnt.path / "a.bin").read_bytes() == data
    other = make_mount(s3_store, name="direct")
    assert (other.path / "a.bin").read_bytes() == data
    assert (other.path / "b.bin").read_bytes() == data[::-1]
