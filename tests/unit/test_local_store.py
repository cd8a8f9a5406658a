"""LocalStore takes every legal entry name: its own temp and lock files never collide
with a key, and listing never returns them."""

from __future__ import annotations

import threading

import pytest

from ckptfs.store import LocalStore, StoreError

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
