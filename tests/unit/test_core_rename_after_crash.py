"""A rename whose store steps a daemon crash cut short after its claim (decision 0006
step 2) is finished by the next run of the daemon.  The claim it finds on the old key is
its own, not another node's: the replay took it for another node's rename, logged
"lost a race", and dropped the journaled rename -- after a restart the node showed the
old name again (found by the soak, seed 991202: async, save, wait, rename, SIGKILL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.format.remote import entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import Core, open_core

pytestmark = pytest.mark.trio


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_rename_cut_short_after_its_claim_is_finished_after_a_restart(
        tmp_path: Path, durability: str):
    store = MemoryStore(gate_limit=30)
    config = Config(durability=durability, upload_hold=0.0, store_timeout=1.0)
    old, new = entry_key("root", b"t"), entry_key("root", b"u")
    async with open_core(tmp_path, store, config) as fs:
        core = Core(fs, store)
        await core.save(ROOT_INO, b"t", b"closed version")
        await fs.wait_idle()
        # The claim lands; the PUT under the new name does not (the daemon dies there).
        # (A target with no entry is written with put_if_absent, decision 0006.)
        dying = [store.fail(op, TransientStoreError("the daemon dies here"), prefix=new,
                            times=1000) for op in ("put", "put_if_absent")]
        with trio.move_on_after(5):
            try:
                await fs.rename(ROOT_INO, b"t", ROOT_INO, b"u", 0)
            except FsError:
                pass                     # sync: the rename's own store step failed
        while not any(c.op in ("put", "put_if_absent") and c.key == new
                      for c in store.calls):
            await trio.sleep(0.01)
    for hook in dying:
        hook.remove()                    # the store answers again
    async with open_core(tmp_path, store, config) as fs:
        core = Core(fs, store)
        with trio.fail_after(20):
            await fs.wait_idle()
            await fs.refresh_dir(ROOT_INO, force=True)
        names = await core.names()
        if durability == "async":        # the rename was journaled: it must happen
            assert names == ["u"], names
        assert names in (["t"], ["u"])   # sync: done or not, never both, never neither
        assert store.exists(old) != store.exists(new)
        assert await core.load(await core.resolve(names[0])) == b"closed version"
