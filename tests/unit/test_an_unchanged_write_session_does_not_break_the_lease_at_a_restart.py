"""Found by a review (stop 50). a writer
that opens an owed file below a staged directory and closes it without writing (``touch
shard.bin``; beside a reader the open first moves the name and hands the owed version
over, ``taken.hand_owed_version_to``, and the kernel's retry opens the fresh inode)
ends its session unchanged (``Publish._end_session_unchanged``): the closed version
stays, but ``max_ver`` stays one past ``ver``.  At the next start
``HeldLeases.restore`` takes ``max_ver > ver`` for "a writer was cut off by the
restart": the file is marked broken, the lease is left to die, and since the file is
not put back in ``file_dir`` its later publish never forgives the name
(``HeldLeases.settle``).  The shard's closed version lands whole, the completion mark
is saved, and the checkpoint is never sealed ("the checkpoint is incomplete and stays
staged").  Not specific to the hand-over (the ``False`` case has no reader), but the
hand-over's retry open is one way in."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import AccessDenied, MemoryStore
from support.core import WRITE_NEW, Core, open_core, reached
from test_save_beside_a_reader_on_its_node import OLD

pytestmark = pytest.mark.trio

CONFIG = Config(durability="async", upload_hold=0.0, metadata_ttl=0.0, lease_ttl=3.0)


async def touch(core: Core, ino: int) -> None:
    handle = await core.fs.open(ino, os.O_WRONLY, core.me())
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)


@pytest.mark.parametrize("beside_a_reader", [True, False])
async def test_a_checkpoint_is_sealed_after_a_restart_that_cut_no_writer(
        tmp_path, beside_a_reader: bool):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, CONFIG) as fs:
        await fs.st.nursery.start(fs.leases.run)
        core = Core(fs, store)
        ck = await fs.mkdir(ROOT_INO, b"checkpoint-3", 0o755, 0, 0)
        with trio.fail_after(30):
            await fs.wait_idle()
        uploading = store.gate("put", prefix="chunks/", times=1000)
        shard = await core.save(ck.ino, b"shard.bin", OLD)
        await reached(uploading)                            # owed to the store
        if beside_a_reader:
            await fs.open(shard, os.O_RDONLY, core.me())
        try:
            await touch(core, shard)
        except FsError as exc:                              # the name moved: the
            assert exc.errno == errno.ESTALE and beside_a_reader    # kernel's retry
            await touch(core, (await fs.lookup(ck.ino, b"shard.bin")).ino)
        shutil.copytree(tmp_path / "a", tmp_path / "restarted")   # the daemon stops
        dead = store.fail("*", AccessDenied("the daemon is gone"), times=-1)
        uploading.release()
    dead.remove()
    async with open_core(tmp_path / "restarted", store, CONFIG) as fs:
        fs.restore_leases()                                 # (as the daemon does)
        await fs.st.nursery.start(fs.leases.run)
        core = Core(fs, store)
        ck_ino = await core.resolve("checkpoint-3")
        await core.save(ck_ino, b"trainer_state.json", b'{"global_step": 3}')  # the mark
        with trio.fail_after(30):
            await fs.wait_idle()
        shard_landed = not fs.st.queue.queued
        await trio.sleep(1.0)
        broken = [h["broken"] for h in fs.leases.held_report()]
    async with open_core(tmp_path / "other", store, CONFIG) as fs:
        shown = await Core(fs, store).names()
    assert shard_landed
    assert shown == ["checkpoint-3"], \
        f"every file of checkpoint-3 is in the store and its mark saved, but it is " \
        f"never sealed: this node's lease is broken for {broken} after a restart " \
        f"that cut no writer"


@pytest.mark.parametrize("new_file", [False, True], ids=["saved before", "new file"])
async def test_a_writer_the_restart_cut_off_still_breaks_the_lease(tmp_path, new_file):
    """What the rule is for: a shard being written when the daemon stopped (its
    working version unclosed) is lost, so the checkpoint must not be sealed without
    it, whatever else lands.  A new file is removed by the restart (it was never
    closed): its name breaks the lease all the same (it was skipped, and the
    checkpoint sealed without it)."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, CONFIG) as fs:
        await fs.st.nursery.start(fs.leases.run)
        core = Core(fs, store)
        ck = await fs.mkdir(ROOT_INO, b"checkpoint-3", 0o755, 0, 0)
        if new_file:
            await core.save(ck.ino, b"config.json", b"{}")
            writer, _ = await fs.create(ck.ino, b"shard.bin", 0o644, WRITE_NEW, 0, 0,
                                        core.me())
        else:
            shard = await core.save(ck.ino, b"shard.bin", OLD)
            with trio.fail_after(30):
                await fs.wait_idle()
            writer = await fs.open(shard, os.O_WRONLY | os.O_TRUNC, core.me())
        await fs.write(writer.fh, 0, b"half of the next shard")
        shutil.copytree(tmp_path / "a", tmp_path / "restarted")   # the daemon dies
        dead = store.fail("*", AccessDenied("the daemon is gone"), times=-1)
    dead.remove()
    async with open_core(tmp_path / "restarted", store, CONFIG) as fs:
        fs.restore_leases()
        await fs.st.nursery.start(fs.leases.run)
        core = Core(fs, store)
        ck_ino = await core.resolve("checkpoint-3")
        if not new_file:
            assert await core.load(await core.resolve("checkpoint-3/shard.bin")) == OLD
        await core.save(ck_ino, b"trainer_state.json", b'{"global_step": 3}')  # the mark
        with trio.fail_after(30):
            await fs.wait_idle()
        broken = [h["broken"] for h in fs.leases.held_report()]
    assert broken == [["shard.bin"]], broken
    async with open_core(tmp_path / "other", store, CONFIG) as fs:
        assert await Core(fs, store).names() == [], "sealed without the cut-off shard"
