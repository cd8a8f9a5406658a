"""LocalStore takes every legal entry name: its own temp and lock files never collide
with a key, and listing never returns them."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from ckptfs.store import AccessDenied, LocalStore, StoreError, TransientStoreError
from ckptfs.store import local as local_module

NAMES = [".tmp-model.bin", ".tmp-x", ".tmp-", ".ckptfs-tmp", ".ckptfs-lock", "a.tmp"]


@pytest.mark.parametrize("name", NAMES)
def test_entry_named_like_a_temp_file_is_listed(tmp_path, name):
    store = LocalStore(tmp_path)
    key = f"dirs/root/{name}"
    store.put(key, b"body")
    assert [o.key for o in store.list("dirs/root/")] == [key]
    assert [o.key for o in store.list("")] == [key]
    assert store.get(key)[0] == b"body"
    assert store.put_if_absent(f"dirs/root/sub{name}", b"x")
    assert sorted(o.key for o in store.list("dirs/")) == sorted([key, f"dirs/root/sub{name}"])


def test_temp_files_never_listed_and_never_left_in_key_directories(tmp_path):
    store = LocalStore(tmp_path)
    stop = threading.Event()
    seen: set[str] = set()
    for i in range(5):
        store.put(f"dirs/root/f{i}", b"first")

    def writer():
        i = 0
        while not stop.is_set():
            store.put(f"dirs/root/f{i % 5}", b"x" * 10000)
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(200):
            seen.update(o.key for o in store.list(""))
    finally:
        stop.set()
        t.join()
    assert seen <= {f"dirs/root/f{i}" for i in range(5)}
    assert sorted(p.name for p in (tmp_path / "dirs" / "root").iterdir()) == \
        [f"f{i}" for i in range(5)]


@pytest.mark.parametrize("key", [".ckptfs-tmp/x", ".ckptfs-lock", "/abs", "dirs/../x"])
def test_keys_that_would_reach_the_store_s_own_files_are_refused(tmp_path, key):
    store = LocalStore(tmp_path)
    with pytest.raises(StoreError):
        store.put(key, b"x")


@pytest.mark.parametrize("err, kind, words", [
    (errno.ENOSPC, TransientStoreError, "store directory full"),
    (errno.EDQUOT, TransientStoreError, "store directory full"),
    (errno.EIO, TransientStoreError, "cannot write the store directory"),
    (errno.EROFS, AccessDenied, "cannot write the store directory"),
])
def test_a_full_or_failing_store_directory_is_a_store_error_and_leaves_no_temp_file(
        tmp_path, monkeypatch, err, kind, words):
    # fsx filled a file:// store's disk: the raw OSError went past the retry policy and
    # the store's health (status said nothing; the log said "fsync failed unexpectedly")
    # and the half-written temp file stayed.  Delayed allocation reports ENOSPC at fsync.
    store = LocalStore(tmp_path)

    def failing_fsync(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(local_module.os, "fsync", failing_fsync)
    for call in (lambda: store.put("dirs/root/f", b"x" * 1000),
                 lambda: store.put_if_absent("dirs/root/g", b"y" * 1000)):
        with pytest.raises(kind, match=words):
            call()
    monkeypatch.undo()
    assert os.listdir(tmp_path / LocalStore.TMP_DIR) == []
    assert [o.key for o in store.list("")] == []


def test_a_read_only_store_directory_is_a_store_error_for_every_write(tmp_path, monkeypatch):
    """A store directory remounted read-only refuses the temp file, its cleanup and the
    lock file alike.  The cleanup's raw EROFS replaced the store error, and went past
    the retry layer and status: async ``mkdir`` failed with EROFS, ``wait`` did not name
    the store (hostile run E)."""
    store = LocalStore(tmp_path)
    etag = store.put("dirs/root/f", b"x")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(local_module.os, "fsync", read_only)
    monkeypatch.setattr(local_module.os, "open", read_only)
    monkeypatch.setattr(local_module.Path, "unlink", read_only)
    for call in (lambda: store.put("dirs/root/g", b"y"),
                 lambda: store.put_if_absent("dirs/root/h", b"z"),
                 lambda: store.delete("dirs/root/f", if_match=etag)):
        with pytest.raises(AccessDenied, match="cannot write the store directory"):
            call()
    monkeypatch.undo()
    assert store.get("dirs/root/f")[0] == b"x"
