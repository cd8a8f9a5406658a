"""When the journal reaches the disk (``meta/journalsync.py``, issue 25 item 4): callers of
one batch share one fsync; an async-mode close, setattr, mkdir, rename or unlink does not
wait for one (it is committed, which a daemon crash cannot undo: the SIGKILL test is
tests/integration/test_small_files.py); an ``fsync`` waits for it."""

from __future__ import annotations

import threading

import trio

from ckptfs.core import Config
from ckptfs.meta.journalsync import JournalSync
from ckptfs.meta.namespace import ROOT_INO, Namespace
from ckptfs.store.memory import MemoryStore
from support.core import WRITE_NEW, me, open_core


class HeldSync:
    """A stand-in for ``Namespace.sync`` that blocks (in its worker thread) until
    released, and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, *args: object) -> None:
        self.calls += 1
        self.entered.set()
        self.release.wait(30)


def test_callers_of_one_batch_share_one_fsync():
    sync = HeldSync()
    journal = JournalSync(sync)

    async def main() -> None:
        done: list[int] = []

        async def caller(i: int) -> None:
            await journal.now()
            done.append(i)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller, 0)
            await trio.to_thread.run_sync(sync.entered.wait, 30)   # the first sync runs
            for i in range(1, 8):
                nursery.start_soon(caller, i)
            await trio.sleep(0.05)
            assert done == []            # nobody returns before its changes are on disk
            sync.release.set()
        assert sorted(done) == list(range(8))

    trio.run(main)
    # The first caller's sync, then one more for the seven that came while it ran.
    assert sync.calls == journal.syncs == 2


def test_soon_does_not_wait_and_many_share_one_background_fsync():
    sync = HeldSync()
    sync.release.set()
    journal = JournalSync(sync, delay=0.05)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for _ in range(100):
                journal.soon()
            assert journal.pending()
            with trio.fail_after(30):
                while journal.pending():
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert sync.calls == 1


def test_async_changes_do_not_wait_for_the_fsync_and_fsync_does(tmp_path, monkeypatch):
    """With the journal's fsync stuck, an async save (create, write, close), chmod,
    mkdir, rename and unlink all return; an fsync of a file waits until it is done."""
    sync = HeldSync()
    monkeypatch.setattr(Namespace, "sync", lambda self: sync())

    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path, store, Config(durability="async")) as fs:
            with trio.fail_after(30):      # a guard against a hang, not a timing assert
                d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
                handle, inode = await fs.create(d.ino, b"f", 0o644, WRITE_NEW, 0, 0, me())
                await fs.write(handle.fh, 0, b"x" * 4096)
                await fs.flush(handle.fh)
                await fs.release(handle.fh)
                await fs.setattr(inode.ino, mode=0o600, mtime_ns=10**18)
                await fs.rename(d.ino, b"f", d.ino, b"g", 0)
                handle2, other = await fs.create(d.ino, b"h", 0o644, WRITE_NEW, 0, 0, me())
                await fs.flush(handle2.fh)
                await fs.release(handle2.fh)
                await fs.unlink(d.ino, b"h")
            assert fs.getattr(inode.ino).mode == 0o600
            # An explicit fsync is the durability request: it waits for the disk.
            handle, _ = await fs.create(d.ino, b"s", 0o644, WRITE_NEW, 0, 0, me())
            await fs.write(handle.fh, 0, b"y")
            fsynced = trio.Event()

            async def fsync() -> None:
                await fs.fsync(handle.fh, False)
                fsynced.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fsync)
                await trio.to_thread.run_sync(sync.entered.wait, 30)
                await trio.sleep(0.05)
                assert not fsynced.is_set()
                sync.release.set()
            assert fsynced.is_set()
            await fs.flush(handle.fh)
            await fs.release(handle.fh)

    trio.run(main)


def test_an_fsync_with_nothing_committed_since_the_last_one_runs_none(tmp_path):
    """A file's ``fsync`` after the background sync already covered its create (the
    usual case of a save) costs no second fsync of the journal; a commit since does."""
    ns = Namespace(tmp_path / "meta")
    calls: list[int] = []

    def sync() -> None:
        calls.append(ns.commits())
        ns.sync()

    journal = JournalSync(sync, committed=ns.commits)

    async def main() -> None:
        inode = ns.get(ROOT_INO)
        ns.save(inode)
        await journal.now()
        assert len(calls) == 1
        await journal.now()                 # nothing new: no fsync
        journal.soon()
        await journal.now()
        assert len(calls) == 1
        before = ns.commits()
        ns.save(inode)                      # a commit: the next fsync must run
        assert ns.commits() > before
        await journal.now()
        assert len(calls) == 2 and journal.syncs == 2

    try:
        trio.run(main)
    finally:
        ns.close()


def test_an_async_fsync_syncs_the_staging_file_and_the_journal_side_by_side():
    """Neither fsync waits for the other (they were one after the other); both end
    before it returns, and a failure is raised as itself (an errno), not as a group."""
    from ckptfs.core.fsync import side_by_side
    from ckptfs.errors import FsError

    async def main() -> None:
        started: list[str] = []
        both = trio.Event()

        async def step(name: str) -> None:
            started.append(name)
            if len(started) == 2:
                both.set()
            with trio.fail_after(5):
                await both.wait()       # each waits until the other has started
            started.append(f"{name} done")

        await side_by_side(lambda: step("staging"), lambda: step("journal"))
        assert sorted(started[2:]) == ["journal done", "staging done"]

        async def fails() -> None:
            raise FsError(5, "the disk failed")

        try:
            await side_by_side(fails, lambda: trio.sleep(0.01))
        except FsError as exc:
            assert exc.errno == 5
        else:
            raise AssertionError("the failure was not raised")

    trio.run(main)
