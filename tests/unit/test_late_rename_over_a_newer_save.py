"""A rename that lands late must not write over another node's newer save.

An async node journals ``rename tmp -> dst`` and tells the caller it is done; the store
follows later (an outage, a slow log).  If meanwhile another node saved ``dst`` -- and
was told it is saved -- the late move wrote the renamed file over that save: its target
step compared against the ETag it read *then*, not against what the rename replaced
when it was made.  The serial order that keeps to when each was acknowledged is "A
renames, then B saves over the name": the name holds B's save and ``tmp`` is gone (as a
late removal leaves a newer save, stop 41).  When A has since renamed the file on
(``dst -> final``), that order gives ``final`` A's file and ``dst`` B's save.  Where
another node made the name something else than a file (a directory), no serial order
has both: A's file is kept as ``dst.ckptfs-conflict-<node>``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, reached, two_cores

pytestmark = pytest.mark.trio

A_DATA = b"A's renamed file " * 300
B_DATA = b"B's newer save " * 200


async def save_over(node: Core, ino: int, data: bytes) -> None:
    handle = await node.fs.open(ino, os.O_WRONLY | os.O_TRUNC, node.me())
    await node.fs.write(handle.fh, 0, data)
    await node.fs.flush(handle.fh)
    await node.fs.release(handle.fh)


async def contents(node: Core) -> dict[str, bytes | str]:
    """Every name in the root as ``node`` lists it afresh: a file's bytes, or
    ``"<dir>"``."""
    await node.fs.refresh_dir(ROOT_INO, force=True)
    out: dict[str, bytes | str] = {}
    for name in await node.names():
        ino = await node.resolve(name)
        out[name] = "<dir>" if node.fs.getattr(ino).type == "dir" else await node.load(ino)
    return out


@asynccontextmanager
async def nodes(tmp_path) -> AsyncIterator[tuple[Core, Core, MemoryStore]]:
    """Two async nodes over one in-memory store; their listings wait for a refresh."""
    store = MemoryStore()
    config = Config(durability="async", metadata_ttl=3600.0, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        yield a, b, store


async def both_know(a: Core, b: Core, dst: bool = True) -> None:
    """A saves ``tmp`` (and ``dst``); both nodes know them."""
    await a.save(ROOT_INO, b"tmp", A_DATA)
    if dst:
        await a.save(ROOT_INO, b"dst", b"the version both nodes know")
    await a.fs.wait_idle()
    await b.fs.refresh_dir(ROOT_INO, force=True)


async def late_rename(a: Core, store: MemoryStore) -> Any:
    """A renames ``tmp`` to ``dst`` (acknowledged); its move waits at the claim: the
    gate to release."""
    claim = store.gate("put", prefix="dirs/root/tmp")
    await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
    await reached(claim)
    return claim


async def settle(a: Core, b: Core, claim: Any) -> None:
    """B's steps land, then A's move goes on."""
    with trio.fail_after(30):
        await b.fs.wait_idle()
    claim.release()
    with trio.fail_after(60):
        await a.fs.wait_idle()


@pytest.mark.parametrize("target", ["replaced", "new"])
async def test_a_late_rename_leaves_another_nodes_newer_save(tmp_path, target: str):
    """``replaced``: A's rename replaced the ``dst`` both nodes knew, and B saved over
    it.  ``new``: ``dst`` did not exist when A renamed, and B then made it."""
    async with nodes(tmp_path) as (a, b, store):
        await both_know(a, b, dst=target == "replaced")
        claim = await late_rename(a, store)
        if target == "replaced":
            await save_over(b, await b.resolve("dst"), B_DATA)
        else:
            await b.save(ROOT_INO, b"dst", B_DATA)
        await settle(a, b, claim)
        for node in (a, b):
            assert await contents(node) == {"dst": B_DATA}, \
                "the late rename wrote over B's save (or left tmp)"


async def test_a_late_rename_renamed_on_since_ends_where_its_node_put_it(tmp_path):
    async with nodes(tmp_path) as (a, b, store):
        await both_know(a, b)
        claim = await late_rename(a, store)
        await a.fs.rename(ROOT_INO, b"dst", ROOT_INO, b"final", 0)
        await save_over(b, await b.resolve("dst"), B_DATA)
        await settle(a, b, claim)
        for node in (a, b):
            assert await contents(node) == {"dst": B_DATA, "final": A_DATA}


async def test_a_late_rename_over_its_own_nodes_newer_save_is_no_conflict(tmp_path):
    """A saves the renamed file again before the move lands (its publish goes to the
    new name first): the move finds its own node's save there, not another's."""
    async with nodes(tmp_path) as (a, b, store):
        await both_know(a, b)
        ino = await a.resolve("tmp")
        claim = await late_rename(a, store)
        await save_over(a, ino, B_DATA)
        await trio.sleep(0.5)
        claim.release()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        for node in (a, b):
            assert await contents(node) == {"dst": B_DATA}


async def test_a_late_rename_renamed_away_and_back_leaves_the_newer_save(tmp_path):
    """``tmp -> dst``, ``dst -> x``, ``x -> dst`` on A while its first move waits; B saves
    ``dst`` after them.  The first move goes on through a transit name, the last one
    meets B's save: the name keeps it, as after A's three renames and then B's save."""
    async with nodes(tmp_path) as (a, b, store):
        await both_know(a, b)
        claim = await late_rename(a, store)
        await a.fs.rename(ROOT_INO, b"dst", ROOT_INO, b"x", 0)
        await a.fs.rename(ROOT_INO, b"x", ROOT_INO, b"dst", 0)
        await save_over(b, await b.resolve("dst"), B_DATA)
        await settle(a, b, claim)
        for node in (a, b):
            assert await contents(node) == {"dst": B_DATA}


async def test_a_late_rename_over_a_directory_made_meanwhile_keeps_both(tmp_path):
    """B makes ``dst`` a directory after A's rename (and ``dst.ckptfs-conflict-<A>``
    too): no serial order has both, so A's file is kept under the next free conflict
    name and B's names stay."""
    async with nodes(tmp_path) as (a, b, store):
        await both_know(a, b, dst=False)
        taken = b"dst.ckptfs-conflict-" + a.fs.st.leases.node_id.encode()[:12]
        claim = await late_rename(a, store)
        await b.fs.mkdir(ROOT_INO, b"dst", 0o755, 0, 0)
        await b.save(ROOT_INO, taken, b"a name of B's")
        await settle(a, b, claim)
        for node in (a, b):
            assert await contents(node) == {"dst": "<dir>", taken.decode(): b"a name of B's",
                                            taken.decode() + "-2": A_DATA}
