"""Two crossing renames, one of them of a hard-linked file's name, on two nodes (sync).

Found by the model test's race step once it made hard links (soak seed 1215331): A
renames ``f1`` over ``f0``; B, whose view still has ``f0`` as a name of its hard-linked
file (``f0`` = ``f2``), renames ``f0`` to ``f1``.  In the only serial order that lets
both succeed (A's first), B's rename moves what ``f0`` holds then -- A's file -- to
``f1``.  B's claim on ``f0`` took A's file entry for its own link entry: it wrote its
link over it, and A's file -- saved, renamed, both acknowledged -- was gone from the
store.  A name of a hard-linked file that holds another file now is moved as that
file's entry, as a plain file's rename moves whatever file entry it finds.
"""

from __future__ import annotations

import json

import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import two_cores


def run(tmp_path, body) -> None:
    """Sync, two nodes: B's hard-linked file ``f0`` = ``f2``, A's plain ``f1``; A has
    listed all three, B (its listing older) only its own two."""
    async def main() -> None:
        store = MemoryStore()
        async with two_cores(tmp_path, store, Config(durability="sync",
                                                     metadata_ttl=30.0)) as (a, b):
            linked = await b.save(ROOT_INO, b"f0", b"v5 linked")
            await b.fs.link(linked, ROOT_INO, b"f2")
            await a.save(ROOT_INO, b"f1", b"v4 plain")
            assert await a.names() == ["f0", "f1", "f2"]
            assert await b.names() == ["f0", "f2"]
            await body(a, b, store)
    trio.run(main)


def test_a_linked_name_renamed_after_another_node_renamed_a_file_over_it(tmp_path):
    async def body(a, b, store) -> None:
        await a.fs.rename(ROOT_INO, b"f1", ROOT_INO, b"f0", 0)
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)   # B's view: f0 linked
        keys = sorted(o.key for o in store.list("dirs/root/"))
        assert keys == ["dirs/root/f1", "dirs/root/f2"], keys
        f1 = json.loads(store.get("dirs/root/f1")[0])
        assert f1["type"] == "file" and f1["size"] == len(b"v4 plain"), \
            "B's rename lost A's file (its link went over it)"
        assert json.loads(store.get("dirs/root/f2")[0])["type"] == "link"
    run(tmp_path, body)


def test_a_name_renamed_after_another_node_renamed_a_linked_name_over_it(tmp_path):
    """The other way round: B renames ``f0`` (a name of its hard-linked file) over
    ``f1``; A, whose view still has ``f1`` as its plain file, renames ``f1`` to ``f0``.
    Serially (B's first) A's rename moves what ``f1`` holds then -- B's link -- to
    ``f0``.  It answered ENOENT: the name held a link, which its claim did not take."""
    async def body(a, b, store) -> None:
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
        await a.fs.rename(ROOT_INO, b"f1", ROOT_INO, b"f0", 0)   # A's view: f1 plain
        keys = sorted(o.key for o in store.list("dirs/root/"))
        assert keys == ["dirs/root/f0", "dirs/root/f2"], keys
        for name in ("f0", "f2"):
            assert json.loads(store.get(f"dirs/root/{name}")[0])["type"] == "link"
    run(tmp_path, body)


def test_an_exchange_of_a_linked_name_another_node_filled_with_a_file_swaps_that_file(
        tmp_path):
    """RENAME_EXCHANGE the same way: A renames ``f1`` over ``f0``; B, whose view still has
    ``f0`` as a name of its hard-linked file, exchanges ``f0`` and its ``f3``.
    Serially (A's first) the exchange swaps what ``f0`` holds then -- A's file -- with
    ``f3``.  It answered ENOENT, which no serial order gives."""
    from ckptfs.core.state import RENAME_EXCHANGE

    async def body(a, b, store) -> None:
        await b.save(ROOT_INO, b"f3", b"v6 B's plain")
        await a.fs.rename(ROOT_INO, b"f1", ROOT_INO, b"f0", 0)
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f3", RENAME_EXCHANGE)
        keys = sorted(o.key for o in store.list("dirs/root/"))
        assert keys == ["dirs/root/f0", "dirs/root/f2", "dirs/root/f3"], keys
        f0 = json.loads(store.get("dirs/root/f0")[0])
        f3 = json.loads(store.get("dirs/root/f3")[0])
        assert f0["type"] == "file" and f0["size"] == len(b"v6 B's plain")
        assert f3["type"] == "file" and f3["size"] == len(b"v4 plain"), \
            "the exchange lost A's file"
        assert json.loads(store.get("dirs/root/f2")[0])["type"] == "link"
        seen: list[bytes] = []
        for _ in range(50):   # a listing begun before the exchange applies nothing
            await b.fs.refresh_dir(ROOT_INO, force=True)
            seen = [await b.load(await b.resolve(n)) for n in ("f3", "f0")]
            if seen == [b"v4 plain", b"v6 B's plain"]:
                break
            await trio.sleep(0.05)
        assert seen == [b"v4 plain", b"v6 B's plain"], "B's view after its exchange"
    run(tmp_path, body)
