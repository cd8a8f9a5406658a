"""Spare staging files (data/spares.py): a create takes an empty file made ahead by a
worker thread, renamed into place; none ready, it creates as before.  A spare is never
a version, never leaks, and a killed daemon's are removed at start."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs.data.spares import SpareFiles, is_spare
from ckptfs.data.staging import Staging

pytestmark = pytest.mark.trio


def spare_names(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if is_spare(name))


async def filled(spares: SpareFiles, nursery: trio.Nursery) -> None:
    await nursery.start(spares.run)
    with trio.fail_after(10):
        while spares.ready() < spares.keep:
            await trio.sleep(0.001)


async def test_a_create_takes_a_spare_and_the_spares_are_refilled(tmp_path):
    spares = SpareFiles(tmp_path / "staging", keep=8)
    staging = Staging(tmp_path / "staging", tmp_path / "abandoned", spares=spares)
    async with trio.open_nursery() as nursery:
        await filled(spares, nursery)
        assert len(spare_names(staging.root)) == 8
        before = time.time_ns()
        for ino in range(1, 7):
            fd = staging.create_empty(ino, 1)
            os.pwrite(fd, b"x" * ino, 0)
        assert spares.taken == 6 and spares.missed == 0
        # Renamed, not created: six spares fewer (until the refill), each version holds
        # exactly its own bytes, with its own times, not the spare's.
        for ino in range(1, 7):
            assert staging.path(ino, 1).read_bytes() == b"x" * ino
            assert os.stat(staging.path(ino, 1)).st_mtime_ns >= before - 10_000_000
        assert sorted(staging.versions()) == [(ino, 1) for ino in range(1, 7)]
        # Below half: a worker refills them.
        with trio.fail_after(10):
            while spares.ready() < spares.keep:
                await trio.sleep(0.001)
        assert len(spare_names(staging.root)) == 8
        nursery.cancel_scope.cancel()
    spares.clear()
    assert spare_names(staging.root) == []
    assert sorted(staging.versions()) == [(ino, 1) for ino in range(1, 7)]


async def test_with_no_spare_ready_a_create_makes_its_file(tmp_path):
    spares = SpareFiles(tmp_path / "staging", keep=4)      # never run: none ready
    staging = Staging(tmp_path / "staging", tmp_path / "abandoned", spares=spares)
    fd = staging.create_empty(5, 2)
    os.pwrite(fd, b"abc", 0)
    assert staging.path(5, 2).read_bytes() == b"abc"
    assert spares.missed == 1 and spares.taken == 0


async def test_a_spare_gone_under_it_falls_back_to_a_create(tmp_path):
    spares = SpareFiles(tmp_path / "staging", keep=2)
    staging = Staging(tmp_path / "staging", tmp_path / "abandoned", spares=spares)
    async with trio.open_nursery() as nursery:
        await filled(spares, nursery)
        nursery.cancel_scope.cancel()
    for name in spare_names(staging.root):
        os.unlink(staging.root / name)       # someone cleaned the state dir by hand
    fd = staging.create_empty(9, 1)
    os.pwrite(fd, b"kept", 0)
    assert staging.path(9, 1).read_bytes() == b"kept"
    assert spares.taken == 1


async def test_a_create_replaces_an_older_file_of_that_version(tmp_path):
    spares = SpareFiles(tmp_path / "staging", keep=2)
    staging = Staging(tmp_path / "staging", tmp_path / "abandoned", spares=spares)
    staging.path(3, 4).write_bytes(b"old bytes")
    async with trio.open_nursery() as nursery:
        await filled(spares, nursery)
        nursery.cancel_scope.cancel()
    fd = staging.create_empty(3, 4)
    assert os.fstat(fd).st_size == 0 and staging.size(3, 4) == 0
    assert spares.taken == 1


async def test_spares_a_killed_daemon_left_are_removed_and_nothing_else(tmp_path):
    root = tmp_path / "staging"
    root.mkdir()
    (root / ".spare.17").write_bytes(b"")
    (root / ".spare.3").write_bytes(b"")
    (root / "12.1").write_bytes(b"a version")
    spares = SpareFiles(root)
    assert spares.clear() == 2
    assert os.listdir(root) == ["12.1"]


async def test_with_the_disk_refusing_creates_takes_find_none_and_nothing_breaks(tmp_path):
    spares = SpareFiles(tmp_path / "gone", keep=4)     # no such directory: every create fails
    async with trio.open_nursery() as nursery:
        await nursery.start(spares.run)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(3):
            assert spares.take() is None
            await trio.testing.wait_all_tasks_blocked()
        assert spares.missed == 3
        # The directory appears (space again): the next take's refill fills it.
        (tmp_path / "gone").mkdir()
        assert spares.take() is None
        with trio.fail_after(10):
            while spares.ready() < 4:
                await trio.sleep(0.001)
        assert spares.take() is not None
        nursery.cancel_scope.cancel()
