"""``Staging.versions_of``: the versions of one inode without reading the staging
directory again.  An unlink listed the whole directory for its one inode: a ``tar x``
over 1 000 files still being uploaded spent 1.7 ms per unlink there (issue 25)."""

from __future__ import annotations

import os

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfs.core import Config
from ckptfs.data.staging import Staging
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.procstat import Opener
from ckptfs.store import LocalStore
from support.core import open_core

OPS = st.lists(st.tuples(
    st.sampled_from(["create", "create_empty", "copy", "rename", "remove", "abandon"]),
    st.integers(1, 3), st.integers(0, 3), st.integers(0, 3)), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS, index_first=st.booleans())
def test_the_index_of_versions_agrees_with_the_directory(tmp_path_factory, ops,
                                                          index_first):
    """Random creates, copies, renames, removals and abandons, with the index read
    before or after them: ``versions_of`` always says what the directory holds."""
    base = tmp_path_factory.mktemp("staging")
    staging = Staging(base / "staging", base / "abandoned")
    if index_first:
        staging.versions_of(1)

    def on_disk(ino: int) -> list[int]:
        return sorted(v for i, v in staging.versions() if i == ino)
    for op, ino, ver, other in ops:
        if op == "create":
            staging.fd(ino, ver, create=True)
        elif op == "create_empty":
            staging.create_empty(ino, ver)
        elif op == "copy" and staging.exists(ino, ver) and ver != other:
            staging.copy(ino, ver, other)
        elif op == "rename" and staging.exists(ino, ver) and ver != other:
            staging.rename_version(ino, ver, other)
        elif op == "remove":
            staging.remove(ino, ver)
        elif op == "abandon":
            staging.abandon(ino, ver)
        for i in (1, 2, 3):
            assert staging.versions_of(i) == on_disk(i), (op, ino, ver, other)
    staging.close_all()


def test_unlinking_many_staged_files_reads_the_staging_directory_once(tmp_path,
                                                                       monkeypatch):
    """Async mode, 50 files closed and queued (their uploads wait while the writer
    works): unlinking all of them lists the staging directory at most once, and
    leaves no staging file of theirs."""
    scans: list[str] = []
    real_scandir = os.scandir

    def counting_scandir(path):
        if str(path).endswith("staging"):
            scans.append(str(path))
        return real_scandir(path)

    async def main() -> None:
        (tmp_path / "store").mkdir()
        me = Opener.from_tid(os.getpid())
        async with open_core(tmp_path / "state", LocalStore(tmp_path / "store"),
                             Config(durability="async")) as fs:
            inos = []
            for i in range(50):
                handle, inode = await fs.create(ROOT_INO, b"f%d" % i, 0o644,
                                                os.O_WRONLY | os.O_CREAT, 0, 0, me)
                await fs.write(handle.fh, 0, b"x" * 100)
                await fs.flush(handle.fh)
                await fs.release(handle.fh)
                inos.append(inode.ino)
            monkeypatch.setattr(os, "scandir", counting_scandir)
            for i in range(50):
                await fs.unlink(ROOT_INO, b"f%d" % i)
            monkeypatch.setattr(os, "scandir", real_scandir)
            assert len(scans) <= 1, len(scans)
            # An upload under way holds its version until it ends (the gate opens once
            # the writer pauses), then the version goes.
            with trio.fail_after(20):
                while [iv for iv in fs.staging.versions() if iv[0] in inos]:
                    await trio.sleep(0.05)
    trio.run(main)
