"""A model test of two nodes at core level: two ``Filesystem`` instances over ONE
in-memory store (each its own namespace, staging and cache), driven by random programs
of saves, overwrites, renames, unlinks, mkdirs and rmdirs on either node, of files
opened and held open (never closed yet; new ones, or closed ones opened with
``O_TRUNC``) that are renamed, renamed over, unlinked and closed later, of chmods and
utimes (every node shows the same mode and mtime of each closed file, the ones set
since, and while a file is held open for writing the mtime its closed version had:
soak seed 1215482), of readers held open across steps (each reads the version it opened,
and shows no name the other node moved away: soak seed 1215394), and of a node stopped
where it is and started again on its state (nothing open on it; its async journal may
be pending), in sync and async durability, with or without FUSE passthrough
(``support/kernel.py`` plays the kernel: a passthrough handle's bytes go to its
staging file unseen, the kernel's one-backing-file rule is checked at every open, and
the size right after a writer's last release must be the bytes it wrote), and with
store messages lost both ways now and then (``lose_messages``: a request that never
acted, or a reply lost after it did, retried by the daemon's ``RetryingStore``; the
outcome must not change).  The FUSE
model test (tests/integration/test_model.py) affords a few dozen examples; without
FUSE this one runs hundreds.

A program switches nodes only after the node it leaves is idle and the node it enters
has refreshed its directories (what a user sees after ``ckptfs wait`` and the metadata
TTL), so the pure model is sequential; in between, one node's async journal piles up.
Checked: safety — every read, on the acting node after each step, returns one closed
version whole (its header names it, its bytes are that version's); convergence — once
both nodes are idle and refreshed, both show exactly the model's tree and contents.  A
file held open with no closed version yet shows empty on its node and not at all on the
other -- unless it was renamed over a closed version, which the other node goes on
seeing under that name until the file's own version lands (DESIGN.md promise 2).

Knows the façade's public methods and tests/support; nothing behind the façade.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import random
import re
import time
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.core import Config, Filesystem
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.errors import FsError
from ckptfs.store import MemoryStore, TransientStoreError
from ckptfs.store.memory import Call
from ckptfs.store.retry import RetryingStore
from ckptfs.store.retrypolicy import RetryPolicy
from support.core import WRITE_NEW, Core, open_core
from support.kernel import KernelCore
from support.watchdog import Watchdog

CS = 16 << 10
SIZES = (0, 100, CS, CS + 7, 2 * CS + 1)
DIRS = ("", "d0", "d1")
NAMES = ("f0", "f1", "f2")
STEP_LIMIT = 60.0               # seconds one step of a program may take
SLOW_PROGRAM = 10.0             # a program this long is printed (shown on a failure)
RESTORED = ".restored"          # a directory put back beside its name (decision 0028)
RESTORED_NAME = re.compile(r"^(d\d)\.restored-[0-9a-f]{8}$")
# Taken out of the environment, like test_model.py's knobs: daemons the integration tests
# start inherit it, and ckptfs refuses CKPTFS_* settings it does not know.
EXAMPLES = int(os.environ.pop("CKPTFS_CORE_MODEL_EXAMPLES", "200"))


def version_bytes(vid: int, size: int) -> bytes:
    """Version ``vid`` of ``size`` bytes: a header naming it, then bytes only it has."""
    header = f"v{vid:06d}:{size:06d};".encode()
    body = (header + bytes(range(vid % 251, vid % 251 + 1)) * 64) * (size // 64 + 2)
    return (header + body)[:size] if size >= len(header) else header[:size]


def which_version(data: bytes) -> int | None:
    """The version ``data`` is, whole, or None for torn or foreign bytes (an empty or
    tiny version is matched by its exact bytes by the caller)."""
    if len(data) < 15 or not data.startswith(b"v"):
        return None
    try:
        vid, size = int(data[1:7]), int(data[8:14])
    except ValueError:
        return None
    return vid if version_bytes(vid, size) == data else None


@dataclass
class Writer:
    """A file opened for writing on ``node`` and not closed yet: nothing written until
    its close writes version ``vid`` of ``size`` bytes."""
    node: int
    fh: int
    path: str | None              # None once unlinked or renamed over
    vid: int
    size: int
    held: tuple[int, int] | None = None   # the closed version other nodes see at path
    # opened with O_TRUNC over a closed file of its own: that version (``held``) and
    # its attributes move with the file's renames until the close
    trunc: bool = False
    mode: int | None = None     # a chmod of a new file held open: its close shows it


@dataclass
class Reader:
    """A closed version opened for reading on ``node`` and held across steps: whatever
    happens to its name meanwhile, it reads version ``vid`` of ``size`` bytes whole until
    it is closed (DESIGN.md promise 2)."""
    node: int
    fh: int
    path: str
    vid: int
    size: int


@dataclass
class Model:
    dirs: set[str] = field(default_factory=lambda: {""})
    files: dict[str, tuple[int, int]] = field(default_factory=dict)   # path: (vid, size)
    writers: list[Writer] = field(default_factory=list)
    readers: list[Reader] = field(default_factory=list)
    # The names of each hard-linked file: one set per file that was ever linked (a file
    # left with one name stays a linked file, its entry a link to its inode object).
    links: list[set[str]] = field(default_factory=list)
    # Attributes set by chmod and utime that every node must show (a path's entry goes
    # where its file goes; a save's close sets a new mtime, which the nodes must only
    # agree on).
    modes: dict[str, int] = field(default_factory=dict)
    mtimes: dict[str, int] = field(default_factory=dict)

    def move_attrs(self, src: str, dst: str) -> None:
        for known in (self.modes, self.mtimes):
            known.pop(dst, None)
            if src in known:
                known[dst] = known.pop(src)

    def drop_attrs(self, path: str) -> None:
        self.modes.pop(path, None)
        self.mtimes.pop(path, None)

    def remap_attrs(self, src: str, dst: str) -> None:
        """Directory ``src`` is ``dst`` now."""
        for known in (self.modes, self.mtimes):
            moved = {(dst + p[len(src):] if p.startswith(src + "/") else p): v
                     for p, v in known.items()}
            known.clear()
            known.update(moved)

    def linked_with(self, path: str) -> set[str]:
        """Every name of the file at ``path`` (just ``path`` if it has one)."""
        return next((g for g in self.links if path in g), {path})

    def is_linked(self, path: str) -> bool:
        return any(path in g for g in self.links)

    def unname(self, path: str) -> None:
        """``path`` no longer names its file (unlinked, renamed over, moved away)."""
        for g in self.links:
            g.discard(path)
        self.links = [g for g in self.links if g]

    def rename_name(self, src: str, dst: str) -> None:
        self.unname(dst)
        for g in self.links:
            if src in g:
                g.discard(src)
                g.add(dst)

    def writer_at(self, path: str) -> Writer | None:
        return next((w for w in self.writers if w.path == path), None)

    def busy_under(self, d: str) -> bool:
        return any(w.path is not None and w.path.startswith(d + "/") for w in self.writers)


def join(d: str, name: str) -> str:
    return f"{d}/{name}" if d else name


def parent_of(path: str) -> tuple[str, str]:
    head, _, name = path.rpartition("/")
    return head, name


# A step of a race, on closed files: sources and targets by index as in ``step``.
race_op = st.one_of(
    st.tuples(st.just("rename"), st.integers(0, 7),
              st.one_of(st.tuples(st.sampled_from(DIRS), st.sampled_from(NAMES)),
                        st.integers(0, 7))),
    st.tuples(st.just("unlink"), st.integers(0, 7)),
    st.tuples(st.just("save"), st.sampled_from(DIRS), st.sampled_from(NAMES),
              st.sampled_from(SIZES)),
    st.tuples(st.just("mkdir"), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("rmdir"), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("mvdir"), st.sampled_from(DIRS[1:]), st.sampled_from(DIRS[1:])),
    # a new file opened before the race (no entry in the store yet: the other node's
    # listing does not show it) and written and closed in it
    st.tuples(st.just("close"), st.sampled_from(DIRS), st.sampled_from(NAMES),
              st.sampled_from(SIZES)))

# One step on each node at the same time (``Run.race``), with store calls delayed at
# random (seeded) so their store steps interleave; or two names renamed onto each other
# (a cycle), or one after the other (a chain).
race_step = st.one_of(
    st.tuples(st.just("race"), st.just(0), race_op, race_op, st.integers(0, 2 ** 16)),
    st.builds(lambda k, j, cycle, seed: ("race", 0, ("rename", k, j),
                                         ("rename", j, k) if cycle
                                         else ("rename", j, ("", "f2")), seed),
              st.integers(0, 7), st.integers(0, 7), st.booleans(), st.integers(0, 2 ** 16)),
    # a file held open in a directory the other node removes or renames meanwhile
    st.builds(lambda d, name, size, other, seed: (
        "race", 0, ("close", d, name, size),
        ("rmdir", d) if other == d else ("mvdir", d, other), seed),
        st.sampled_from(DIRS[1:]), st.sampled_from(NAMES), st.sampled_from(SIZES),
        st.sampled_from(DIRS[1:]), st.integers(0, 2 ** 16)))

save_step = st.tuples(st.just("save"), st.integers(0, 1), st.sampled_from(DIRS),
                      st.sampled_from(NAMES), st.sampled_from(SIZES))
step = st.one_of(
    save_step, save_step,       # twice as likely: most steps need a file to act on
    # rename and unlink name their source by index among the names that exist
    # (``Run.existing``): drawn blindly, a rename almost never found a file.
    st.tuples(st.just("rename"), st.integers(0, 1), st.integers(0, 7),
              st.one_of(st.tuples(st.sampled_from(DIRS), st.sampled_from(NAMES)),
                        st.integers(0, 7))),      # a new name, or over an existing one
    st.tuples(st.just("unlink"), st.integers(0, 1), st.integers(0, 7)),
    st.tuples(st.just("mkdir"), st.integers(0, 1), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("rmdir"), st.integers(0, 1), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("mvdir"), st.integers(0, 1), st.sampled_from(DIRS[1:]),
              st.sampled_from(DIRS[1:])),
    st.tuples(st.just("open"), st.integers(0, 1), st.sampled_from(DIRS),
              st.sampled_from(NAMES), st.sampled_from(SIZES)),
    # (True: the writer's process exits holding the file twice: a second descriptor is
    # opened, then both are flushed before either is released, as the kernel does)
    st.tuples(st.just("close"), st.integers(0, 1), st.integers(0, 3), st.booleans()),
    # open a new file and rename it at once over the k-th name: a save's temp file
    # renamed into place before its close
    st.tuples(st.just("open_over"), st.integers(0, 1), st.integers(0, 7),
              st.sampled_from(SIZES)),
    # a file held open leaves its name before its close: moved to a new name, unlinked
    st.tuples(st.just("open_away"), st.integers(0, 1), st.integers(0, 3),
              st.sampled_from(["rename", "unlink"])),
    # a reader opens the k-th closed file and holds it; a reader reads all and closes
    st.tuples(st.just("read_open"), st.integers(0, 1), st.integers(0, 7)),
    st.tuples(st.just("read_close"), st.integers(0, 1), st.integers(0, 3)),
    # an existing closed file opened with O_TRUNC and held (nothing written until its
    # close, which writes a new version of the size drawn)
    st.tuples(st.just("trunc"), st.integers(0, 1), st.integers(0, 7),
              st.sampled_from(SIZES)),
    # chmod or utime of the k-th name the node may act on (a closed file, or one it
    # holds open)
    st.tuples(st.just("attr"), st.integers(0, 1), st.integers(0, 7),
              st.sampled_from(["chmod", "utime"]), st.integers(0, 3)),
    # a node stops (a crash at its next await) and starts again on its state
    st.tuples(st.just("restart"), st.integers(0, 1)),
    # a hard link to the k-th closed file under a new name
    st.tuples(st.just("link"), st.integers(0, 1), st.integers(0, 7),
              st.tuples(st.sampled_from(DIRS), st.sampled_from(NAMES))),
    race_step,
)
MAX_READERS = 3


class Run:
    """One program over two nodes and the model it must match."""

    def __init__(self, nodes: list[KernelCore],
                 restart: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.nodes = nodes
        self.restart = restart
        self.restarted: list[int] = []
        self.model = Model()
        self.vid = 0
        self.current = 0

    async def switch_to(self, n: int) -> None:
        if n != self.current:
            await self.nodes[self.current].fs.wait_idle()
            await self.refresh(self.nodes[n])
            self.current = n

    async def refresh(self, node: Core) -> None:
        """List the root and every directory the node shows (after a race the model's
        directories are not known yet)."""
        await node.fs.refresh_dir(ROOT_INO, force=True)
        for d in DIRS[1:]:
            if d in await node.names():
                await node.fs.refresh_dir(await node.resolve(d), force=True)

    async def do(self, op: tuple) -> None:
        kind, n = op[0], op[1]
        if kind == "race":
            await self.race(op[2], op[3], op[4])
            return
        for each in self.nodes:
            each.deliver()          # the invalidation queues got there (support/kernel.py)
        await self.switch_to(n)
        node, m = self.nodes[n], self.model
        fs: Filesystem = node.fs
        if kind in ("open", "close", "trunc"):
            await self.do_writer(op)
        elif kind == "attr":
            await self.do_attr(op)
        elif kind in ("read_open", "read_close"):
            await self.do_reader(op)
        elif kind == "restart":
            # Only a node with nothing open: its async journal may still be pending.
            if self.restart is not None and \
                    not any(h.node == n for h in m.writers) and \
                    not any(h.node == n for h in m.readers):
                await self.restart(n)
                self.restarted.append(n)
                await self.refresh(self.nodes[n])
        elif kind == "open_away":
            mine = sorted(w.path for w in m.writers if w.node == n and w.path is not None)
            if mine:
                path = mine[op[2] % len(mine)]
                if op[3] == "unlink":
                    await self.do(("unlink", n, self.index_of(n, path)))
                else:
                    free = next(f"m{i}" for i in range(99) if f"m{i}" not in m.files
                                and not m.writer_at(f"m{i}"))
                    await self.do(("rename", n, self.index_of(n, path), ("", free)))
        elif kind == "open_over":
            target = self.existing(n, op[2])
            temp = next((join("", f"t{i}") for i in range(9)
                         if join("", f"t{i}") not in m.files and not m.writer_at(f"t{i}")))
            if target is not None:
                await self.do(("open", n, "", temp, op[3]))
                await self.do(("rename", n, self.index_of(n, temp), self.index_of(n, target)))
        elif kind == "save":
            d, name, size = op[2], op[3], op[4]
            if d in m.dirs and join(d, name) not in m.dirs and not m.writer_at(join(d, name)):
                self.vid += 1
                ino = await node.save(await node.resolve(d), name.encode(),
                                      version_bytes(self.vid, size))
                for path in m.linked_with(join(d, name)):   # a save writes the linked file
                    m.files[path] = (self.vid, size)
                    m.mtimes.pop(path, None)                # (its close's time)
                await self.check_read(node, join(d, name), ino)
        elif kind == "link":
            names = sorted(m.files)
            d, name = op[3]
            dst = join(d, name)
            if names and d in m.dirs and dst not in m.files and dst not in m.dirs \
                    and not m.writer_at(dst):
                src = names[op[2] % len(names)]
                await fs.link(await node.resolve(src), await node.resolve(d), name.encode())
                m.files[dst] = m.files[src]
                for known in (m.modes, m.mtimes):
                    if src in known:
                        known[dst] = known[src]
                group = m.linked_with(src)
                if group not in m.links:
                    m.links.append(group)
                group.add(dst)
                await self.check_read(node, dst, await node.resolve(dst))
        elif kind == "rename":
            src = self.existing(n, op[2])
            dst = op[3] if isinstance(op[3], tuple) else self.existing(n, op[3])
            if src is None or dst is None:
                return
            dst_dir, dst_name = dst if isinstance(dst, tuple) else parent_of(dst)
            dst = join(dst_dir, dst_name)
            moving, replaced = m.writer_at(src), m.writer_at(dst)
            if dst_dir in m.dirs and src != dst \
                    and (replaced is None or replaced.node == n):
                if moving is not None and dst in m.files and \
                        fs.st.config.durability == "async":
                    # Whether dst's last version has landed (the one the name then
                    # holds on to) is a race of async mode the model cannot call.
                    await fs.wait_idle()
                src_dir, src_name = parent_of(src)
                await fs.rename(await node.resolve(src_dir), src_name.encode(),
                                await node.resolve(dst_dir), dst_name.encode(), 0)
                if replaced is not None:              # an unclosed file renamed over
                    replaced.path = None
                if moving is not None and moving.trunc:
                    # Its closed version's entry moves with it (over whatever dst was).
                    moving.path = dst
                    m.files.pop(dst, None)
                    m.unname(dst)
                    m.move_attrs(src, dst)
                elif moving is not None:                # it leaves the name it held
                    moving.path = dst
                    linked = m.is_linked(dst)
                    moving.held = m.files.pop(dst, None) or \
                        (replaced.held if replaced is not None else None)
                    if linked:
                        # A linked name renamed over is counted out of its file at once
                        # (decision 0008): no closed version is held under it.
                        moving.held = None
                    m.unname(dst)
                    m.drop_attrs(src)       # (the other nodes see dst's old entry)
                    m.drop_attrs(dst)
                elif src in m.linked_with(dst) and src != dst:
                    pass        # two names of one file: rename(2) does nothing
                else:
                    m.files[dst] = m.files.pop(src)
                    m.rename_name(src, dst)
                    m.move_attrs(src, dst)
                    await self.check_read(node, dst, await node.resolve(dst))
                if replaced is not None:
                    replaced.held = None
        elif kind == "unlink":
            path = self.existing(n, op[2])
            if path is not None:
                writer = m.writer_at(path)
                d, name = parent_of(path)
                await fs.unlink(await node.resolve(d), name.encode())
                m.drop_attrs(path)
                if writer is not None:
                    writer.path, writer.held = None, None
                else:
                    del m.files[path]
                    m.unname(path)
        elif kind == "mkdir":
            if op[2] not in m.dirs:
                await fs.mkdir(ROOT_INO, op[2].encode(), 0o755, 0, 0)
                m.dirs.add(op[2])
        elif kind == "rmdir":
            if op[2] in m.dirs and not any(p.startswith(op[2] + "/") for p in m.files) \
                    and not m.busy_under(op[2]):
                await fs.rmdir(ROOT_INO, op[2].encode())
                m.dirs.discard(op[2])
        elif kind == "mvdir":
            src, dst = op[2], op[3]
            # A file the other node holds open in it moves with it (that node's view
            # included: decision 0028's addendum of stop 33).
            if src in m.dirs and dst not in m.dirs:
                await fs.rename(ROOT_INO, src.encode(), ROOT_INO, dst.encode(), 0)
                m.dirs = (m.dirs - {src}) | {dst}
                m.files = {(dst + p[len(src):] if p.startswith(src + "/") else p): v
                           for p, v in m.files.items()}
                m.links = [{(dst + p[len(src):] if p.startswith(src + "/") else p)
                            for p in g} for g in m.links]
                m.remap_attrs(src, dst)
                for w in m.writers:
                    if w.path is not None and w.path.startswith(src + "/"):
                        w.path = dst + w.path[len(src):]

    async def race(self, op_a: tuple, op_b: tuple, jitter: int) -> None:
        """``op_a`` on node a and ``op_b`` on node b at the same time, on closed files
        (and on a new file each node may hold open from before the race: its close),
        both nodes idle and refreshed first; once idle again, both must show one serial
        order's result (whatever each step answered: async answers before the store
        decides, as the FUSE model test also allows)."""
        m = self.model
        if m.writers or m.links:
            return                    # the race is about closed files with one name each
        m.modes.clear()     # (the serial orders below do not follow attributes)
        m.mtimes.clear()
        for node in self.nodes:
            await node.fs.wait_idle()
        for node in self.nodes:
            await self.refresh(node)
        for op in (op_a, op_b):
            if op[0] == "close" and op[1] and op[1] not in m.dirs:
                await self.nodes[0].fs.mkdir(ROOT_INO, op[1].encode(), 0o755, 0, 0)
                m.dirs.add(op[1])     # a directory for the held file (model: serial)
        for node in self.nodes:
            await node.fs.wait_idle()
        for node in self.nodes:
            await self.refresh(node)
        steps = [self._race_step(op) for op in (op_a, op_b)]
        if None in steps or self._renamed_over_an_open_file(steps):
            return
        steps = [await self._open_for_race(node, one) for node, one in zip(self.nodes, steps)]
        for node in self.nodes:
            await node.fs.wait_idle()
        for node in self.nodes:
            await self.refresh(node)
        rng = random.Random(jitter)

        def delay(call: Call) -> None:
            time.sleep(rng.uniform(0, 0.004))
        hook = self.nodes[0].store.before(delay)
        try:
            async with trio.open_nursery() as nursery:
                for node, one in zip(self.nodes, steps):
                    nursery.start_soon(self._race_act, node, one)
        finally:
            hook.remove()
        candidates = [self._serial(steps[i], steps[j]) for i, j in ((0, 1), (1, 0))]
        restored = self._restored_outcome(steps)
        if restored is not None:
            candidates.append(restored)
        for node in self.nodes:
            await node.fs.wait_idle()
        trees = []
        for node in self.nodes:
            await self.refresh(node)
            trees.append(await self.tree(node))
        for dirs, files in candidates:
            m.dirs, m.files = dirs, files
            if trees == [self.expected(0), self.expected(1)]:
                break
        else:
            raise AssertionError(f"race {steps}: no serial order gives {trees}; "
                                 f"store keys {self.nodes[0].store.keys()}")
        await self._remove_restored()
        self.current = 0

    def _restored_outcome(self, steps: list[tuple]
                          ) -> tuple[set[str], dict[str, tuple[int, int]]] | None:
        """The outcomes of a step into a directory the other step replaced with a
        rename over it (``mvdir`` onto an empty directory).  The kernel hands ckptfs the
        directory by inode, so the step acts on the replaced directory, not on the one
        that now has its name: a rename into it answers ENOENT and does nothing (as a
        ``renameat`` with a descriptor of a removed directory does); a file closed or
        saved in it brings it back beside the moved one as ``<name>.restored-<id>``
        (decision 0028): not a serial order, as the rename had answered, but nothing
        lost."""
        moves = [s for s in steps if s[0] == "mvdir"]
        others = [s for s in steps if s[0] in ("close", "save", "rename")]
        if not moves or not others:
            return None
        _, src, dst = moves[0]
        other = others[0]
        into = other[2] if other[0] == "rename" else other[1]
        if src not in self.model.dirs or dst not in self.model.dirs or \
                parent_of(into)[0] != dst:
            return None
        dirs, files = self._serial(moves[0], ("none",))
        if other[0] == "rename":
            return dirs, files
        files[join(dst + RESTORED, parent_of(into)[1])] = other[2]
        return dirs | {dst + RESTORED}, files

    async def _remove_restored(self) -> None:
        """Take a restored directory away again (node a, ``rm -r``), so the programme
        goes on over the model's directories only."""
        m, node = self.model, self.nodes[0]
        gone = [d for d in m.dirs if d.endswith(RESTORED)]
        if not gone:
            return
        for name in await node.names():
            if RESTORED_NAME.match(name):
                ino = await node.resolve(name)
                for child in await node.names(ino):
                    await node.fs.unlink(ino, child.encode())
                await node.fs.rmdir(ROOT_INO, name.encode())
        m.dirs -= set(gone)
        m.files = {p: v for p, v in m.files.items()
                   if not any(p.startswith(d + "/") for d in gone)}
        for one in self.nodes:
            await one.fs.wait_idle()
            await self.refresh(one)

    def _race_step(self, op: tuple) -> tuple | None:
        """A race step with its paths resolved in the model (None: nothing to do)."""
        m = self.model
        if op[0] == "save":
            self.vid += 1
            return ("save", join(op[1], op[2]), (self.vid, op[3]))
        if op[0] in ("mkdir", "rmdir", "mvdir"):
            return op if op[0] != "mvdir" or op[1] != op[2] else None
        if op[0] == "close":
            path = join(op[1], op[2])
            if (op[1] and op[1] not in m.dirs) or path in m.files or path in m.dirs:
                return None
            self.vid += 1
            return ("close", path, (self.vid, op[3]))
        names = sorted(m.files)
        if not names:
            return None
        src = names[op[1] % len(names)]
        if op[0] == "unlink":
            return ("unlink", src)
        dst = join(*op[2]) if isinstance(op[2], tuple) else names[op[2] % len(names)]
        if dst == src:
            return None
        return ("rename", src, dst)

    @staticmethod
    def _renamed_over_an_open_file(steps: list[tuple]) -> bool:
        """A rename onto the name of a file the other node holds open: on a local file
        system the open file would lose its name; ckptfs's close publishes under it
        (last close wins).  Not a race this model judges."""
        opened = {s[1] for s in steps if s[0] == "close"}
        return any(s[0] == "rename" and s[2] in opened for s in steps)

    async def _open_for_race(self, node: Core, step: tuple) -> tuple:
        """A close step's file, created and held open on its node before the race."""
        if step[0] != "close":
            return step
        d, name = parent_of(step[1])
        handle, _ = await node.create(await node.resolve(d), name.encode(), 0o644, WRITE_NEW)
        return (*step, handle.fh)

    def _serial(self, first: tuple, second: tuple
                ) -> tuple[set[str], dict[str, tuple[int, int]]]:
        """The tree after ``first`` then ``second`` (a step that would fail does
        nothing).  A file held open for a close step has its name from the start (its
        directory is not empty); its version lands at the close's place in the order."""
        dirs, files = set(self.model.dirs), dict(self.model.files)
        opened = {s[1]: s[1] for s in (first, second) if s[0] == "close"}

        def under(d: str) -> list[str]:
            return [p for p in [*files, *opened.values()] if p.startswith(d + "/")]
        for step in (first, second):
            kind = step[0]
            if kind == "save" and parent_of(step[1])[0] in dirs:
                files[step[1]] = step[2]
            elif kind == "close":
                files[opened[step[1]]] = step[2]
            elif kind == "unlink" and step[1] in files:
                del files[step[1]]
            elif kind == "rename" and step[1] in files and parent_of(step[2])[0] in dirs:
                files[step[2]] = files.pop(step[1])
            elif kind == "mkdir":
                dirs.add(step[1])
            elif kind == "rmdir" and step[1] in dirs and not under(step[1]):
                dirs.discard(step[1])
            elif kind == "mvdir" and step[1] in dirs and not (step[2] in dirs
                                                              and under(step[2])):
                dirs = (dirs - {step[1]}) | {step[2]}
                files = {(step[2] + p[len(step[1]):] if p.startswith(step[1] + "/")
                          else p): v for p, v in files.items()}
                opened = {k: (step[2] + p[len(step[1]):] if p.startswith(step[1] + "/")
                              else p) for k, p in opened.items()}
        return dirs, files

    @staticmethod
    async def _race_act(node: Core, step: tuple) -> None:
        fs = node.fs
        try:
            if step[0] == "save":
                d, name = parent_of(step[1])
                await node.save(await node.resolve(d), name.encode(),
                                version_bytes(*step[2]))
            elif step[0] == "close":
                await node.write(step[3], 0, version_bytes(*step[2]))
                await fs.flush(step[3])
                await node.release(step[3])
            elif step[0] == "unlink":
                d, name = parent_of(step[1])
                await fs.unlink(await node.resolve(d), name.encode())
            elif step[0] == "mkdir":
                await fs.mkdir(ROOT_INO, step[1].encode(), 0o755, 0, 0)
            elif step[0] == "rmdir":
                await fs.rmdir(ROOT_INO, step[1].encode())
            elif step[0] == "mvdir":
                await fs.rename(ROOT_INO, step[1].encode(), ROOT_INO, step[2].encode(), 0)
            else:
                (sd, sn), (dd, dn) = parent_of(step[1]), parent_of(step[2])
                await fs.rename(await node.resolve(sd), sn.encode(),
                                await node.resolve(dd), dn.encode(), 0)
        except FsError as exc:
            # What a serial order answers too: the other node's step took the name
            # first, or filled or made the directory.
            if exc.errno not in (errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY):
                raise

    def _names(self, n: int) -> list[str]:
        """The names node ``n`` may rename or unlink: closed files, and files it holds
        open itself."""
        return sorted(self.model.files) + sorted(
            w.path for w in self.model.writers if w.node == n and w.path is not None)

    def existing(self, n: int, k: int) -> str | None:
        """The ``k``-th (modulo) of ``_names(n)``."""
        names = self._names(n)
        return names[k % len(names)] if names else None

    def index_of(self, n: int, path: str) -> int:
        return self._names(n).index(path)

    async def do_writer(self, op: tuple) -> None:
        """open: create a new file and hold it open, writing nothing; close: write the
        held file's version and close it (it lands under the name it has then)."""
        n, node, m = op[1], self.nodes[op[1]], self.model
        if op[0] == "open":
            d, name, size = op[2], op[3], op[4]
            path = join(d, name)
            if d in m.dirs and path not in m.dirs and path not in m.files \
                    and not m.writer_at(path):
                handle, _ = await node.create(await node.resolve(d), name.encode(), 0o644,
                                              WRITE_NEW)
                self.vid += 1
                m.writers.append(Writer(n, handle.fh, path, self.vid, size))
            return
        if op[0] == "trunc":
            names = [p for p in sorted(m.files) if not m.is_linked(p)]
            if names:
                path = names[op[2] % len(names)]
                ino = await node.resolve(path)
                # (the closed version keeps its mtime while the file is open: every
                # node shows it until the close)
                m.mtimes.setdefault(path, node.fs.getattr(ino).mtime_ns)
                # (by name: beside a reader of it here, the name moves to a fresh inode
                # and the open answers ESTALE, which the kernel retries by name)
                handle = await node.open_by_name(path, os.O_WRONLY | os.O_TRUNC)
                self.vid += 1
                m.writers.append(Writer(n, handle.fh, path, self.vid, op[3],
                                        held=m.files.pop(path), trunc=True))
            return
        mine = [w for w in m.writers if w.node == n]
        if not mine:
            return
        w = mine[op[2] % len(mine)]
        fhs = [w.fh]
        if len(op) > 3 and op[3] and w.path is not None:
            again = await node.open(node.fs.st.handles[w.fh].ino, os.O_RDWR)
            fhs.append(again.fh)
        await node.write(w.fh, 0, version_bytes(w.vid, w.size))
        for fh in fhs:
            await node.fs.flush(fh)
        for fh in fhs:
            await node.release(fh)
        m.writers.remove(w)
        if w.path is not None:
            m.files[w.path] = (w.vid, w.size)
            m.mtimes.pop(w.path, None)      # (its close's time)
            if w.mode is not None:
                m.modes[w.path] = w.mode
            await self.check_read(node, w.path, await node.resolve(w.path))

    async def do_attr(self, op: tuple) -> None:
        """chmod or utime on node ``n`` of a closed file or one it holds open; a
        linked file's every name shows it."""
        n, node, m = op[1], self.nodes[op[1]], self.model
        path = self.existing(n, op[2])
        if path is None:
            return
        ino = await node.resolve(path)
        writer = m.writer_at(path)
        if writer is not None and not writer.trunc:
            # A new file held open: other nodes see what its name held before (if
            # anything) until its close, which shows the mode (and a new mtime).
            if op[3] == "chmod":
                writer.mode = (0o600, 0o640, 0o644, 0o755)[op[4]]
                await node.fs.setattr(ino, mode=writer.mode)
            else:
                await node.fs.setattr(ino, mtime_ns=1_600_000_000_000_000_000 + op[4])
            return
        if op[3] == "chmod":
            mode = (0o600, 0o640, 0o644, 0o755)[op[4]]
            await node.fs.setattr(ino, mode=mode)
            for p in m.linked_with(path):
                m.modes[p] = mode
        else:
            self.vid += 1       # (a time no other step gave)
            mtime = 1_700_000_000_000_000_000 + self.vid * 1000 + op[4]
            await node.fs.setattr(ino, mtime_ns=mtime)
            for p in m.linked_with(path):
                m.mtimes[p] = mtime
        assert node.fs.getattr(ino).mode & 0o7777 == m.modes.get(path, node.fs.getattr(
            ino).mode & 0o7777)

    async def do_reader(self, op: tuple) -> None:
        """read_open: open the k-th closed file for reading and hold it; read_close: read
        a held reader's whole file from the start (its version, whatever happened to the
        name since) and close it."""
        n, node, m = op[1], self.nodes[op[1]], self.model
        if op[0] == "read_open":
            names = sorted(m.files)
            if not names or len(m.readers) >= MAX_READERS:
                return
            path = names[op[2] % len(names)]
            handle = await node.open(await node.resolve(path), os.O_RDONLY)
            m.readers.append(Reader(n, handle.fh, path, *m.files[path]))
            return
        mine = [r for r in m.readers if r.node == n]
        if mine:
            await self.finish_reader(mine[op[2] % len(mine)])

    async def finish_reader(self, r: Reader) -> None:
        node = self.nodes[r.node]
        data = await node.read(r.fh, 0, r.size + 1)
        await node.release(r.fh)
        self.model.readers.remove(r)
        assert data == version_bytes(r.vid, r.size), \
            ("a reader of", r.path, "node", "ab"[r.node], len(data), r.vid, r.size)

    async def check_read(self, node: Core, path: str, ino: int) -> None:
        vid, size = self.model.files[path]
        data = await node.load(ino)
        if size >= 15:
            assert which_version(data) == vid, (path, data[:20], vid)
        assert data == version_bytes(vid, size), (path, len(data), vid, size)

    async def converge(self) -> None:
        for node in self.nodes:
            await node.fs.wait_idle()
        for i, node in enumerate(self.nodes):
            await self.refresh(node)
            assert await self.tree(node) == self.expected(i), f"node {'ab'[i]}"
            nlinks = {p: node.fs.getattr(await node.resolve(p)).nlink for p in self.model.files}
            assert nlinks == {p: len(self.model.linked_with(p)) for p in self.model.files}, \
                (f"node {'ab'[i]}: link counts", self.model.links)
        await self.check_attributes()
        for r in list(self.model.readers):     # held open through it all
            await self.finish_reader(r)

    async def check_attributes(self) -> None:
        """Every node shows the same mode and mtime for each closed file, and those a
        chmod or utime set since (a file held open for writing: the closed version the
        other node sees)."""
        m = self.model
        seen: list[dict[str, tuple[int, int]]] = []
        for node in self.nodes:
            attrs = {}
            for p in m.files:
                a = node.fs.getattr(await node.resolve(p))
                attrs[p] = (a.mode & 0o7777, a.mtime_ns)
            seen.append(attrs)
        assert seen[0] == seen[1], ("nodes disagree on attributes", seen)
        for p, (mode, mtime) in seen[0].items():
            assert mode == m.modes.get(p, mode), (p, oct(mode), oct(m.modes[p]))
            assert mtime == m.mtimes.get(p, mtime), (p, mtime, m.mtimes[p])
        for w in m.writers:
            if w.path is None or w.held is None or not w.trunc:
                continue
            other = self.nodes[1 - w.node]
            a = other.fs.getattr(await other.resolve(w.path))
            assert a.mode & 0o7777 == m.modes.get(w.path, a.mode & 0o7777), \
                ("a file held open: its closed version's mode", w.path)
            assert a.mtime_ns == m.mtimes.get(w.path, a.mtime_ns), \
                ("a file held open: its closed version's mtime", w.path, a.mtime_ns,
                 m.mtimes[w.path])

    def expected(self, node: int) -> dict[str, object]:
        tree: dict[str, object] = {d: "dir" for d in self.model.dirs if d}
        tree.update({p: (vid if size >= 15 else "tiny", size)
                     for p, (vid, size) in self.model.files.items()})
        for w in self.model.writers:
            if w.path is not None and w.node == node:
                tree[w.path] = ("tiny", 0)                     # nothing written yet
            elif w.path is not None and w.held is not None:
                vid, size = w.held
                tree[w.path] = (vid if size >= 15 else "tiny", size)
        return tree

    async def tree(self, node: Core) -> dict[str, object]:
        """What ``node`` shows: the model's directories, and a restored one
        (``_restored_outcome``) under its name without its id."""
        seen: dict[str, object] = {}
        restored = [n for n in await node.names() if RESTORED_NAME.match(n)]
        for d in [*DIRS, *restored]:
            if d and d not in seen:
                continue
            for name in await node.names(await node.resolve(d) if d else ROOT_INO):
                path = join(d, name)
                ino = await node.resolve(path)
                if node.fs.getattr(ino).type == "dir":
                    seen[path] = "dir"
                else:
                    data = await node.load(ino)
                    seen[path] = (which_version(data) if len(data) >= 15 else "tiny",
                                  len(data))
        return {RESTORED_NAME.sub(r"\1" + RESTORED, p.split("/")[0]) +
                p[len(p.split("/")[0]):]: v for p, v in seen.items()}


def lose_messages(store: MemoryStore, rate: float, seed: int) -> None:
    """Store calls fail now and then as on a real network, both ways: the request is
    lost (nothing acted), or the reply is (the call acted -- a PUT landed, a DELETE
    deleted -- and its caller does not know).  Both are transient errors, retried by
    the store's ``RetryingStore`` as in the daemon: a program's outcome must not
    change, whatever its compare-and-swaps and put-if-absents meet on the retry."""
    rng = random.Random(seed)

    def request_lost(call: Call) -> None:
        if rng.random() < rate:
            raise TransientStoreError(f"injected: the {call.op} request was lost")

    def reply_lost(call: Call) -> None:
        if call.error is None and rng.random() < rate:
            raise TransientStoreError(f"injected: the {call.op} reply was lost")
    store.before(request_lost)
    store.after(reply_lost)


def retrying(store: MemoryStore, faults: float) -> object:
    """The store as a node's core gets it: behind the daemon's retry layer when
    messages get lost (fast retries, no limit but a deadline), else as it is."""
    if not faults:
        return store
    return RetryingStore(store, RetryPolicy(attempts=None, base_delay=0.001,
                                            max_delay=0.01, jitter=True, deadline=30.0))


async def run_program(base: Path, durability: str, program: list[tuple],
                      ttl: float = 0.0, *, kernel: bool = False, faults: float = 0.0,
                      fault_seed: int = 0) -> Run:
    """``ttl``: the metadata TTL.  0: every lookup lists again and waits for it; above
    0, a lookup in a directory the node changed within it lists in the background and
    goes on (the window where a listing begins after the step that started it).
    ``kernel``: the nodes use FUSE passthrough where the core chooses it (async mode),
    its bytes read and written as the kernel would (``support/kernel.py``).
    ``faults``: the share of store requests, and of replies, lost (``lose_messages``)."""
    store = MemoryStore(gate_limit=30)
    if faults:
        lose_messages(store, faults, fault_seed)
    config = Config(durability=durability, chunk_size=CS, metadata_ttl=ttl,
                    stale_wait=0.5)
    dog = Watchdog(after=STEP_LIMIT / 3)
    started = time.monotonic()
    async def node(i: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Node ``i``, in a task of its own (its nursery must nest in no other's): runs
        until its ``stop`` is set."""
        stop, done = trio.Event(), trio.Event()
        try:
            async with open_core(base / "ab"[i], retrying(store, faults), config) as fs:
                core = KernelCore(fs, store)
                if kernel:
                    core.use_passthrough()
                task_status.started((core, stop, done))
                try:
                    await stop.wait()
                finally:
                    core.close_all()
        finally:
            done.set()

    async with trio.open_nursery() as nodes:
        running = [await nodes.start(node, 0), await nodes.start(node, 1)]

        async def restart(i: int) -> None:
            """Node ``i`` stops where it is (its tasks cancelled at their next await, as
            a crash would leave its state dir) and starts again on the same state."""
            running[i][1].set()
            await running[i][2].wait()
            running[i] = await nodes.start(node, i)
            run.nodes[i] = running[i][0]

        async with trio.open_nursery() as watching:
            watching.start_soon(dog.run)
            run = Run([running[0][0], running[1][0]], restart)
            # A program that hangs is a failure with the step it hung in, not a stuck
            # suite; a slow step prints where every task waits (support/watchdog.py).
            for op in program:
                with trio.fail_after(STEP_LIMIT), dog.step(op):
                    await run.do(op)
            with trio.fail_after(STEP_LIMIT), dog.step("converge"):
                await run.converge()
            watching.cancel_scope.cancel()
        for _, stop, _ in running:
            stop.set()
    took = time.monotonic() - started
    if took > SLOW_PROGRAM:
        print(f"slow program: {took:.1f} s, {durability}, ttl {ttl}: {program}", flush=True)
    return run


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(durability=st.sampled_from(["sync", "async"]),
       program=st.lists(step, min_size=6, max_size=40),
       ttl=st.sampled_from([0.0, 0.02]), kernel=st.booleans(),
       faults=st.sampled_from([0.0, 0.0, 0.03, 0.1]), fault_seed=st.integers(0, 1 << 16))
def test_two_nodes_over_one_store_converge_and_never_show_a_torn_file(
        tmp_path, caplog, durability, program, ttl, kernel, faults, fault_seed):
    caplog.clear()
    with tempfile.TemporaryDirectory(dir=tmp_path) as base:
        trio.run(functools.partial(run_program, kernel=kernel, faults=faults,
                                   fault_seed=fault_seed),
                 Path(base), durability, program, ttl)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors          # a legitimate program logs no error


@settings(max_examples=EXAMPLES // 2, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(durability=st.sampled_from(["sync", "async"]),
       program=st.lists(st.one_of(save_step, race_step, race_step), min_size=4, max_size=16),
       kernel=st.booleans())
def test_two_nodes_racing_end_in_one_serial_order(tmp_path, caplog, durability, program,
                                                  kernel):
    """Races more often than the program above draws them: saves, then steps on both
    nodes at once (found: two nodes renaming two names onto each other kept both)."""
    caplog.clear()
    with tempfile.TemporaryDirectory(dir=tmp_path) as base:
        trio.run(functools.partial(run_program, kernel=kernel), Path(base), durability,
                 program, 0.0)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# Found by the test above (shrunk to this program): a node that knew d0 refreshed after
# another node renamed d0 to d1 and made a new d0, took the renamed directory for a
# corrupt entry (the same directory id as its stale d0), logged an ERROR and answered EIO
# for d1 until a later refresh.
def test_a_directory_renamed_and_its_name_reused_by_another_node_is_no_corrupt_entry(
        tmp_path, caplog):
    program = [("mkdir", 0, "d0"), ("save", 1, "", "f0", 0), ("mvdir", 0, "d0", "d1"),
               ("mkdir", 0, "d0")]
    trio.run(run_program, tmp_path, "sync", program)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# Found by the test above (session of 2026-12-02): in async mode a save closed while the
# background publish of the file's previous version was still dropping its staged pages
# (it awaits after its entry landed) was marked published with it, so that version was
# never uploaded: the node itself showed the previous (empty) version after a refresh.
def test_a_version_closed_while_the_previous_one_finishes_publishing_is_published(
        tmp_path, caplog):
    program = [("save", 0, "", "f0", 0), ("save", 0, "", "f0", 0), ("save", 0, "", "f0", 0),
               ("save", 0, "", "f0", 16384)]
    trio.run(run_program, tmp_path, "async", program)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# Found by the racing test above (stop 32, with close races): an rmdir of d1 that met
# another node's rename claim on d1's entry deleted the claimed entry, found a name
# below it and put it back, so d1 and the renamed d0 named one directory id ("corrupt
# entry b'd1' ... same directory id").  The rmdir now leaves a claimed entry to its
# rename.  The jitter seeds vary the interleaving: 16 of 20 failed before the fix.
@pytest.mark.parametrize("jitter", range(8))
def test_an_rmdir_meeting_a_rename_claim_leaves_the_directory_to_the_rename(
        tmp_path, caplog, jitter):
    program = [("save", 0, "", "f0", 0), ("save", 0, "", "f0", 0),
               ("race", 0, ("close", "d0", "f0", 0), ("mvdir", "d0", "d1"), 0),
               ("race", 0, ("rename", 0, ("", "f0")), ("rename", 0, ("", "f0")), 0),
               ("race", 0, ("rmdir", "d1"), ("mvdir", "d1", "d0"), jitter),
               ("save", 0, "d0", "f0", 0)]
    trio.run(run_program, tmp_path, "sync", program)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# The model let a directory move only when the other node held no file open in it; the
# soak then found (seed 1215015) that the node holding the file lost it from its view
# once it listed the move, and could not publish it at its close (the listing had
# deleted its inode of the directory).  With and without another save of the writer's
# node before the move; sync and async.  All four failed before the fix.
@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("save_before_move", [False, True])
def test_a_file_held_open_in_a_directory_the_other_node_moves_lands_there(
        tmp_path, caplog, durability, save_before_move):
    program = [("mkdir", 0, "d0"), ("open", 1, "d0", "f0", 16384)]
    program += [("save", 1, "", "f1", 0)] if save_before_move else []
    program += [("mvdir", 0, "d0", "d1"), ("save", 1, "", "f2", 0), ("close", 1, 0)]
    trio.run(run_program, tmp_path, durability, program)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# The restart step, alone: node A stops with its async journal pending (a save, a rename,
# a directory) and starts again on its state; both nodes converge to the model.
def test_a_node_restarted_with_its_journal_pending_converges(tmp_path, caplog):
    program = [("mkdir", 0, "d0"), ("save", 0, "d0", "f0", 2 * CS + 1),
               ("rename", 0, 0, ("", "f1")), ("restart", 0), ("save", 1, "", "f2", 100),
               ("restart", 1), ("unlink", 0, 0)]
    run = trio.run(run_program, tmp_path, "async", program)
    assert run.restarted == [0, 1]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# The close step whose process exits holding the file twice (flushes before releases),
# alone: the last release decides the close the flushes passed on (decision 0005's
# addendum of stop 43; all four failed with the release abandoning it).
# With passthrough (``kernel``, soak seed 1215482): right after the last release the
# daemon answered the size it had seen written -- none, the kernel wrote every byte.
@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("in_dir", ["", "d0"])
@pytest.mark.parametrize("kernel", [False, True], ids=["daemon", "kernel"])
def test_a_close_at_an_exit_holding_the_file_twice_lands(tmp_path, caplog, durability,
                                                           in_dir, kernel):
    program = [("mkdir", 0, "d0"), ("open", 0, in_dir, "f0", 2 * CS + 1),
               ("close", 0, 0, True), ("save", 1, "", "f2", 100)]
    trio.run(functools.partial(run_program, kernel=kernel), tmp_path, durability, program)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# Found by the test above once it drew hard links: A links f0 as f1, B saves through f0,
# A renames a file it holds open over f0 (counting f0 out of the shared object).  B's
# next listing kept f0: the object it fetched for f1 had a new ETag, which the listing
# took for "this node published it since the listing began" and kept the vanished name.
@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_linked_name_another_node_counted_out_goes_at_the_next_listing(
        tmp_path, caplog, durability):
    program = [("save", 0, "", "f0", 0), ("link", 0, 0, ("", "f1")),
               ("save", 1, "", "f0", 0), ("open_over", 0, 0, 0)]
    trio.run(run_program, tmp_path, durability, program, 0.02)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


# Found by the test above (stop 44; shrunk to this program, and timing-dependent: about
# one run in thirty failed): both nodes rename d1 over an empty d0 at once.  The second
# claim took the first one's over (same target), then gave way at the target (the
# first one's removal mark on d0) and put d1 back without a claim -- so the first
# rename's delete of d1 failed on that, and the store kept d0 and d1 for one directory
# (a "corrupt entry" on the next listing, and one node showing both).  Now a live claim
# to the same target gives way first; run many times, as the race is one of timing.
def test_two_nodes_renaming_one_directory_over_another_leave_one_name(tmp_path, caplog):
    program = [("mkdir", 0, "d0"), ("mkdir", 0, "d1"), ("save", 0, "", "f0", 0),
               ("race", 0, ("mvdir", "d1", "d0"), ("mvdir", "d1", "d0"), 0)]
    for i in range(40):
        with tempfile.TemporaryDirectory(dir=tmp_path) as base:
            trio.run(run_program, Path(base), "sync", program)
