"""A rename whose target name changes while the rename waits (for the target's lock, or
for the log) is decided again, as if it had come a moment later: it used to fail with
EAGAIN, which no program expects from rename(2) (``torch.save``'s temp-file-and-rename,
a Hugging Face save, an `mv`).  Through FUSE the kernel's directory locks keep other
requests out of both directories; what still changes a name meanwhile is the node's own
background work: here a killed writer's never-closed file at the target goes away."""

from __future__ import annotations

import pytest
import trio

from ckptfs.meta.namespace import ROOT_INO
from support.core import WRITE_NEW, me

pytestmark = pytest.mark.trio


@pytest.fixture(params=["sync", "async"])
def core_config(request) -> dict:
    return {"durability": request.param, "upload_hold": 0.0}


@pytest.mark.parametrize("round_", range(12))
async def test_a_rename_over_a_name_that_goes_meanwhile_still_renames(core, round_):
    fs = core.fs
    await core.save(ROOT_INO, b"x", b"new")
    await fs.wait_idle()
    handle, _ = await fs.create(ROOT_INO, b"t", 0o644, WRITE_NEW, 0, 0, me())
    fs.died_unclean = lambda opener: True       # its writer "was killed"

    async def writer_dies() -> None:
        await fs.flush(handle.fh)
        await fs.release(handle.fh)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer_dies)
        nursery.start_soon(fs.rename, ROOT_INO, b"x", ROOT_INO, b"t", 0)
    await fs.wait_idle()
    assert await core.names() == ["t"]
    assert await core.load(await core.resolve("t")) == b"new"
