"""A model test of two nodes at core level: two ``Filesystem`` instances over ONE
in-memory store (each its own namespace, staging and cache), driven by random programs
of saves, overwrites, renames, unlinks, mkdirs and rmdirs on either node, in sync and
async durability.  The FUSE model test (tests/integration/test_model.py) affords a few
dozen examples; without FUSE this one runs hundreds.

A program switches nodes only after the node it leaves is idle and the node it enters
has refreshed its directories (what a user sees after ``ckptfs wait`` and the metadata
TTL), so the pure model is sequential; in between, one node's async journal piles up.
Checked: safety — every read, on the acting node after each step, returns one closed
version whole (its header names it, its bytes are that version's); convergence — once
both nodes are idle and refreshed, both show exactly the model's tree and contents.

Knows the façade's public methods and tests/support; nothing behind the façade.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.core import Config, Filesystem
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core

CS = 16 << 10
SIZES = (0, 100, CS, CS + 7, 2 * CS + 1)
DIRS = ("", "d0", "d1")
NAMES = ("f0", "f1", "f2")
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
class Model:
    dirs: set[str] = field(default_factory=lambda: {""})
    files: dict[str, tuple[int, int]] = field(default_factory=dict)   # path: (vid, size)


def join(d: str, name: str) -> str:
    return f"{d}/{name}" if d else name


def parent_of(path: str) -> tuple[str, str]:
    head, _, name = path.rpartition("/")
    return head, name


step = st.one_of(
    st.tuples(st.just("save"), st.integers(0, 1), st.sampled_from(DIRS),
              st.sampled_from(NAMES), st.sampled_from(SIZES)),
    st.tuples(st.just("rename"), st.integers(0, 1), st.sampled_from(DIRS),
              st.sampled_from(NAMES), st.sampled_from(DIRS), st.sampled_from(NAMES)),
    st.tuples(st.just("unlink"), st.integers(0, 1), st.sampled_from(DIRS),
              st.sampled_from(NAMES)),
    st.tuples(st.just("mkdir"), st.integers(0, 1), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("rmdir"), st.integers(0, 1), st.sampled_from(DIRS[1:])),
    st.tuples(st.just("mvdir"), st.integers(0, 1), st.sampled_from(DIRS[1:]),
              st.sampled_from(DIRS[1:])),
)


class Run:
    """One program over two nodes and the model it must match."""

    def __init__(self, nodes: list[Core]) -> None:
        self.nodes = nodes
        self.model = Model()
        self.vid = 0
        self.current = 0

    async def switch_to(self, n: int) -> None:
        if n != self.current:
            await self.nodes[self.current].fs.wait_idle()
            await self.refresh(self.nodes[n])
            self.current = n

    async def refresh(self, node: Core) -> None:
        await node.fs.refresh_dir(ROOT_INO, force=True)
        for d in sorted(self.model.dirs - {""}):
            await node.fs.refresh_dir(await node.resolve(d), force=True)

    async def do(self, op: tuple) -> None:
        kind, n = op[0], op[1]
        await self.switch_to(n)
        node, m = self.nodes[n], self.model
        fs: Filesystem = node.fs
        if kind == "save":
            d, name, size = op[2], op[3], op[4]
            if d in m.dirs and join(d, name) not in m.dirs:
                self.vid += 1
                ino = await node.save(await node.resolve(d), name.encode(),
                                      version_bytes(self.vid, size))
                m.files[join(d, name)] = (self.vid, size)
                await self.check_read(node, join(d, name), ino)
        elif kind == "rename":
            src, dst = join(op[2], op[3]), join(op[4], op[5])
            if src in m.files and op[4] in m.dirs and src != dst:
                await fs.rename(await node.resolve(op[2]), op[3].encode(),
                                await node.resolve(op[4]), op[5].encode(), 0)
                m.files[dst] = m.files.pop(src)
                await self.check_read(node, dst, await node.resolve(dst))
        elif kind == "unlink":
            path = join(op[2], op[3])
            if path in m.files:
                await fs.unlink(await node.resolve(op[2]), op[3].encode())
                del m.files[path]
        elif kind == "mkdir":
            if op[2] not in m.dirs:
                await fs.mkdir(ROOT_INO, op[2].encode(), 0o755, 0, 0)
                m.dirs.add(op[2])
        elif kind == "rmdir":
            if op[2] in m.dirs and not any(p.startswith(op[2] + "/") for p in m.files):
                await fs.rmdir(ROOT_INO, op[2].encode())
                m.dirs.discard(op[2])
        elif kind == "mvdir":
            src, dst = op[2], op[3]
            if src in m.dirs and dst not in m.dirs:
                await fs.rename(ROOT_INO, src.encode(), ROOT_INO, dst.encode(), 0)
                m.dirs = (m.dirs - {src}) | {dst}
                m.files = {(dst + p[len(src):] if p.startswith(src + "/") else p): v
                           for p, v in m.files.items()}

    async def check_read(self, node: Core, path: str, ino: int) -> None:
        vid, size = self.model.files[path]
        data = await node.load(ino)
        if size >= 15:
            assert which_version(data) == vid, (path, data[:20], vid)
        assert data == version_bytes(vid, size), (path, len(data), vid, size)

    async def converge(self) -> None:
        for node in self.nodes:
            await node.fs.wait_idle()
        for node in self.nodes:
            await self.refresh(node)
            assert await self.tree(node) == self.expected()

    def expected(self) -> dict[str, object]:
        tree: dict[str, object] = {d: "dir" for d in self.model.dirs if d}
        tree.update({p: (vid if size >= 15 else "tiny", size)
                     for p, (vid, size) in self.model.files.items()})
        return tree

    async def tree(self, node: Core) -> dict[str, object]:
        seen: dict[str, object] = {}
        for d in [""] + sorted(self.model.dirs - {""}):
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
        return seen


async def run_program(base: Path, durability: str, program: list[tuple]) -> None:
    store = MemoryStore(gate_limit=30)
    config = Config(durability=durability, chunk_size=CS, metadata_ttl=0.0,
                    stale_wait=0.5)
    async with open_core(base / "a", store, config) as a, \
            open_core(base / "b", store, config) as b:
        run = Run([Core(a, store), Core(b, store)])
        for op in program:
            await run.do(op)
        await run.converge()


@settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(durability=st.sampled_from(["sync", "async"]),
       program=st.lists(step, min_size=1, max_size=30))
def test_two_nodes_over_one_store_converge_and_never_show_a_torn_file(
        tmp_path, caplog, durability, program):
    caplog.clear()
    with tempfile.TemporaryDirectory(dir=tmp_path) as base:
        trio.run(run_program, Path(base), durability, program)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors          # a legitimate program logs no error


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
