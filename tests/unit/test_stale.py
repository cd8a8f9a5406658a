"""The staged-directory index of the namespace and the stale-staged watch (issue 14),
no mount: a fake clock and a set of busy inodes stand in for time and the filesystem."""

from __future__ import annotations

import logging
from pathlib import Path

from ckptfs.meta.namespace import ROOT_INO, Namespace
from ckptfs.cluster.stale import StaleStagedWatch

S = 1_000_000_000


def staged_names(ns: Namespace) -> list[bytes]:
    return [inode.name for inode in ns.staged_dirs()]


def test_staged_index_follows_every_change_and_survives_reopen(tmp_path):
    ns = Namespace(tmp_path / "meta")
    a = ns.new_inode(ROOT_INO, b"checkpoint-1", "dir", 0o755, 0, 0, staged=True)
    ns.new_inode(ROOT_INO, b"plain", "dir", 0o755, 0, 0)
    assert staged_names(ns) == [b"checkpoint-1"]          # first call: full scan
    b = ns.new_inode(ROOT_INO, b"checkpoint-2", "dir", 0o755, 0, 0, staged=True)
    c = ns.new_inode(ROOT_INO, b"checkpoint-3", "dir", 0o755, 0, 0, staged=True)
    assert staged_names(ns) == [b"checkpoint-1", b"checkpoint-2", b"checkpoint-3"]
    a.staged = False                                      # sealed
    ns.save(a)
    ns.unlink(b)                                          # removed
    ns.move(c, ROOT_INO, b"checkpoint-3b")                # renamed: still staged here
    assert staged_names(ns) == [b"checkpoint-3b"]
    ns.close()
    ns = Namespace(tmp_path / "meta")
    assert staged_names(ns) == [b"checkpoint-3b"]
    ns.delete_inode(c.ino)
    assert staged_names(ns) == []


def test_watch_idle_busy_stale_and_one_report(tmp_path, caplog):
    ns = Namespace(tmp_path / "meta")
    now = [1000.0]
    busy: set[int] = set()
    watch = StaleStagedWatch(ns, busy.__contains__, Path("/mnt/ckpt"), after=600,
                             clock=lambda: now[0])
    run = ns.new_inode(ROOT_INO, b"run", "dir", 0o755, 0, 0, mtime_ns=0)
    ckpt = ns.new_inode(run.ino, b"global_step5", "dir", 0o755, 0, 0, staged=True,
                        mtime_ns=900 * S)
    sub = ns.new_inode(ckpt.ino, b"zero", "dir", 0o755, 0, 0, mtime_ns=900 * S)
    shard = ns.new_inode(sub.ino, b"shard.pt", "file", 0o644, 0, 0, mtime_ns=950 * S)
    [(_, d)] = watch.scan()
    assert (d.path, d.idle_s, d.state) == ("/mnt/ckpt/run/global_step5", 50.0, "idle")
    now[0] = 950 + 600                                   # quiet for 600 s after the last write
    busy.add(shard.ino)                                  # ... but a writer holds it open
    assert [d.state for _, d in watch.scan()] == ["writing"]
    assert watch.check() == []
    busy.clear()
    with caplog.at_level(logging.WARNING, logger="ckptfs.cluster.stale"):
        assert [d.path for d in watch.check()] == ["/mnt/ckpt/run/global_step5"]
        now[0] += 100
        assert len(watch.check()) == 1
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 1
    assert "ckptfs commit /mnt/ckpt/run/global_step5" in reports[0]
    ckpt.staged = False
    ns.save(ckpt)                                        # sealed: no longer listed
    assert watch.scan() == [] and watch.check() == []
