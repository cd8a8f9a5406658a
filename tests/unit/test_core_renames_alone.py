"""A lone async node renaming against itself (issue item 2), in the core over the
in-memory store: random creates (file, FIFO, symlink) with a chown, renames over them and
back, chowns and unlinks in two directories, while every store call takes a random
moment.  No other node writes the store, so nothing this node did may ever be undone by
the store's answer: after every step each name resolves to the inode the model says, with
its owner; once the log drains, the store holds exactly the local namespace; and a fresh
listing of the store changes nothing here."""

from __future__ import annotations

import os
import random
import stat
import time

import pytest
import trio

from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.format.remote import Entry, chunk_key, dir_prefix, decode_name, inode_key
from support.core import reached

pytestmark = pytest.mark.trio
CS = 64 << 10
NAMES = [b"x", b"y", b"z"]


@pytest.fixture(params=[0.0, 0.02], ids=["ttl0", "ttl20ms"])
def core_config(request) -> dict:
    # metadata_ttl 0: every lookup lists the store again when its directory is not busy,
    # so a store answer that disagrees with this node shows at once.  A short TTL: a
    # lookup in a directory changed here within it lists in the background without
    # waiting, and that listing may begin after the step that started it journaled its
    # record (test_core_listing_after_removal.py).
    return {"durability": "async", "chunk_size": CS, "stale_wait": 5.0,
            "metadata_ttl": request.param}


def store_view(store, dir_id: str) -> dict[bytes, tuple]:
    """What the store holds in a directory: name -> (type, uid, content)."""
    out = {}
    prefix = dir_prefix(dir_id)
    for obj in store.list(prefix):
        rest = obj.key[len(prefix):]
        if "/" in rest:
            continue
        entry = Entry.from_json(store.get(obj.key)[0])
        if entry.type == "link":        # a hard-linked name: its shared inode object
            entry = Entry.from_json(store.get(inode_key(entry.link))[0])
        if entry.type == "file":
            what = b"".join(store.get(chunk_key(sha))[0] for sha, _ in entry.chunks)
        elif entry.type == "symlink":
            what = entry.target
        else:
            what = b""
        out[decode_name(rest)] = (entry.type, entry.uid, what)
    return out


async def two_dirs_under_jitter(core, rnd: random.Random, most: float) -> dict[str, int]:
    """Directories ``a`` and ``b`` (sticky, open to all) under the root, and from now on
    every store call takes a random moment up to ``most`` seconds, so the log, the
    publish queue and the direct calls interleave differently at each step."""
    core.store.before(lambda call: time.sleep(rnd.random() * most))
    return {dname: (await core.fs.mkdir(ROOT_INO, dname.encode(), 0o1777, 0, 0)).ino
            for dname in ("a", "b")}


async def check_names(fs, dirs: dict, model: dict, step: str) -> None:
    for dname, dino in dirs.items():
        for name in NAMES:
            want = model.get((dname, name))
            try:
                got = await fs.lookup(dino, name)
            except FsError as exc:
                assert want is None, f"{step}: {dname}/{name!r}: {exc} (want inode {want})"
                continue
            assert want is not None, f"{step}: {dname}/{name!r} is inode {got.ino}, want none"
            assert got.ino == want["ino"], \
                f"{step}: {dname}/{name!r} is inode {got.ino}, want {want['ino']}"
            assert got.uid == want["uid"], f"{step}: {dname}/{name!r} uid {got.uid}"


@pytest.mark.parametrize("links", [False, True], ids=["", "with-links"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_a_lone_node_never_loses_its_own_renames(core, seed, links):
    """``links``: hard links too (a name made for an inode already named; both names
    share one model record, so a chown of one shows under the other)."""
    fs, store = core.fs, core.store
    rnd = random.Random(seed)
    dirs = await two_dirs_under_jitter(core, rnd, 0.004)
    model: dict[tuple[str, bytes], dict] = {}
    counter = 0

    async def create(where: tuple[str, bytes]) -> None:
        nonlocal counter
        counter += 1
        parent, name = dirs[where[0]], where[1]
        kind = rnd.choice(["file", "fifo", "symlink"])
        if kind == "file":
            data = b"%d" % counter * rnd.randint(1, 3)
            ino = await core.save(parent, name, data)
            model[where] = {"ino": ino, "type": "file", "what": data}
        elif kind == "fifo":
            inode = await fs.mknod(parent, name, stat.S_IFIFO | 0o644, 0, 0, 0)
            model[where] = {"ino": inode.ino, "type": "fifo", "what": b""}
        else:
            target = b"t%d" % counter
            inode = await fs.symlink(parent, name, target, 0, 0)
            model[where] = {"ino": inode.ino, "type": "symlink", "what": target}
        model[where]["uid"] = 0
        await chown(where)

    async def chown(where: tuple[str, bytes]) -> None:
        uid = rnd.randint(1, 60000)
        await fs.setattr(model[where]["ino"], uid=uid)
        model[where]["uid"] = uid

    async def rename(src: tuple[str, bytes], dst: tuple[str, bytes]) -> None:
        await fs.rename(dirs[src[0]], src[1], dirs[dst[0]], dst[1], 0)
        if model.get(dst) is not model[src]:    # two names of one inode: nothing moves
            model[dst] = model.pop(src)

    async def link(src: tuple[str, bytes], dst: tuple[str, bytes]) -> None:
        await fs.link(model[src]["ino"], dirs[dst[0]], dst[1])
        model[dst] = model[src]

    for step in range(60):
        src = rnd.choice([w for w in model] or [("a", b"x")])
        if src not in model:
            await create(src)
        dst = (rnd.choice("ab"), rnd.choice(NAMES))
        if dst == src:
            continue
        if links and dst not in model and rnd.random() < 0.3:
            await link(src, dst)
            await check_names(fs, dirs, model, f"step {step} link {src}->{dst}")
            continue
        op = rnd.random()
        if op < 0.5:
            if dst not in model:
                await create(dst)
            await rename(src, dst)              # over the target just made
            await check_names(fs, dirs, model, f"step {step} rename {src}->{dst}")
            await chown(dst)
            if rnd.random() < 0.6:
                await rename(dst, src)          # and back
                await check_names(fs, dirs, model, f"step {step} back {dst}->{src}")
                await chown(src)
        elif op < 0.7:
            await rename(src, dst)
        elif op < 0.85:
            await chown(src)
        else:
            await fs.unlink(dirs[src[0]], src[1])
            del model[src]
        await check_names(fs, dirs, model, f"step {step}")
        if rnd.random() < 0.1:
            await fs.wait_idle()
    with trio.fail_after(60):
        await fs.wait_idle()
    for dname, dino in dirs.items():
        want = {name: ({"fifo": "fifo"}.get(m["type"], m["type"]), m["uid"], m["what"])
                for (d, name), m in model.items() if d == dname}
        assert store_view(store, fs.ns.get(dino).dir_id) == want, f"store's {dname}/"
    await check_names(fs, dirs, model, "after the log drained")


async def test_a_publish_of_a_renamed_file_waits_for_its_move(core):
    """A file's new version is uploading when it is renamed: its entry must not land
    under the new name before the log moved the older version there (the move would
    then carry the older version over the newer one)."""
    fs, store = core.fs, core.store
    a = await fs.mkdir(ROOT_INO, b"a", 0o755, 0, 0)
    b = await fs.mkdir(ROOT_INO, b"b", 0o755, 0, 0)
    ino = await core.save(a.ino, b"x", b"old" * 100)
    await core.save(ROOT_INO, b"other", b"o")
    await fs.wait_idle()
    uploading = store.gate("put", prefix="chunks/")      # the new version's upload waits
    h = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
    await fs.write(h.fh, 0, b"new" * 100)
    await fs.flush(h.fh)
    await fs.release(h.fh)
    await reached(uploading)
    # An earlier record of the log waits for the store: the move waits behind it.
    earlier = store.gate("get", prefix="dirs/root/other")
    await fs.unlink(ROOT_INO, b"other")
    await reached(earlier)
    await fs.rename(a.ino, b"x", b.ino, b"y", 0)
    uploading.release()
    await trio.sleep(0.5)          # the publish, if it does not wait, lands meanwhile
    earlier.release()
    with trio.fail_after(30):
        await fs.wait_idle()
    assert store_view(store, b.dir_id) == {b"y": ("file", 0, b"new" * 100)}
    assert store_view(store, a.dir_id) == {}
    r = await fs.open((await fs.lookup(b.ino, b"y")).ino, os.O_RDONLY, core.me())
    assert await fs.read(r.fh, 0, 1000) == b"new" * 100
    await fs.release(r.fh)


@pytest.mark.parametrize("core_config", [{"durability": d, "chunk_size": CS}
                                         for d in ("sync", "async")])
@pytest.mark.parametrize("then", ["close", "move away", "unlink"])
async def test_a_new_file_renamed_over_a_published_one_before_its_close(core, then):
    """The target's entry stays until the new file's closed version lands; if the name
    moves away or goes first, the store follows this node: nothing comes back."""
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"t", b"old")
    await fs.wait_idle()
    h, inode = await fs.create(ROOT_INO, b"n", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                               core.me())
    await fs.write(h.fh, 0, b"new")
    await fs.rename(ROOT_INO, b"n", ROOT_INO, b"t", 0)
    await fs.wait_idle()
    assert store_view(store, "root") == {b"t": ("file", 0, b"old")}
    want = {b"t": ("file", 0, b"new")}
    if then == "move away":
        await fs.rename(ROOT_INO, b"t", ROOT_INO, b"elsewhere", 0)
        want = {b"elsewhere": ("file", 0, b"new")}
    elif then == "unlink":
        await fs.unlink(ROOT_INO, b"t")
        want = {}
    await fs.flush(h.fh)
    await fs.release(h.fh)
    with trio.fail_after(30):
        await fs.wait_idle()
    assert store_view(store, "root") == want
    await trio.sleep(fs.config.metadata_ttl + 0.1)
    assert sorted(name for name, _ in await fs.listdir(ROOT_INO)) == sorted(want)
