"""Staging holds a bounded number of descriptors however many files are written (issue
item 6), and a descriptor handed to a worker thread is never closed under it."""

from __future__ import annotations

import errno
import os
import resource
import traceback
from collections.abc import Callable

import pytest

from ckptfs.errors import FsError
from ckptfs.data.staging import DEFAULT_MAX_FDS, Staging


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def alone_in_a_child(body: Callable[[], None]) -> None:
    """Run ``body`` in a forked child, where no other thread runs: the descriptor limit
    and table are the process's, and a worker thread another test left behind in this
    pytest worker (one still in a store call) could take or give back a descriptor
    between the exhaustion and the assertion.  The child's failure fails the test."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 0
        try:
            body()
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"in the child:\n{report}"


def make(tmp_path, **kwargs) -> Staging:
    return Staging(tmp_path / "staging", tmp_path / "abandoned", **kwargs)


def test_staging_never_holds_more_descriptors_than_its_cap(tmp_path):
    staging = make(tmp_path, max_fds=32)
    baseline = open_fds()
    most = 0
    try:
        for ino in range(2, 3002):
            fd = staging.create_empty(ino, 1)
            os.pwrite(fd, f"file {ino}".encode(), 0)
            most = max(most, open_fds() - baseline)
        assert most <= 32, f"{most} descriptors held for 3000 staging files (cap 32)"
        # Every version is still there, through a descriptor opened again on demand.
        for ino in (2, 1500, 3001):
            assert os.pread(staging.fd(ino, 1), 64, 0) == f"file {ino}".encode()
        assert open_fds() - baseline <= 32
    finally:
        staging.close_all()
    assert open_fds() == baseline


def test_the_default_cap_bounds_the_descriptors_too(tmp_path):
    staging = make(tmp_path)
    baseline = open_fds()
    try:
        for ino in range(2, DEFAULT_MAX_FDS + 2002):
            staging.create_empty(ino, 1)
        held = open_fds() - baseline
        assert held <= DEFAULT_MAX_FDS, f"{held} descriptors for {DEFAULT_MAX_FDS + 2000} files"
    finally:
        staging.close_all()


def test_an_owned_descriptor_survives_eviction_and_is_not_reused(tmp_path):
    """What a caller hands to a worker thread across an await is its own descriptor:
    evicting the shared one meanwhile (and another file getting its number) cannot
    make it read another file's bytes."""
    staging = make(tmp_path, max_fds=4)
    try:
        os.pwrite(staging.create_empty(2, 1), b"the closed file", 0)
        with staging.owned_fd(2, 1) as fd:
            for ino in range(3, 40):      # evicts (2, 1) and reuses its number
                os.pwrite(staging.create_empty(ino, 1), b"another file!!!", 0)
            assert os.pread(fd, 64, 0) == b"the closed file"
        with pytest.raises(OSError):
            os.fstat(fd)                  # closed when the block ends
    finally:
        staging.close_all()


def test_emfile_on_open_is_an_fs_error_and_staging_keeps_working(tmp_path):
    """Out of descriptors: staging gives back its idle cached descriptors and tries
    once more; when nothing is left to give back, the caller gets EMFILE as an
    ``FsError`` (the FUSE request's errno), and staging works again once fds free up."""
    def body() -> None:
        staging = make(tmp_path, max_fds=64)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        hogs: list[int] = []

        def exhaust() -> None:
            while True:
                try:
                    hogs.append(os.open("/dev/null", os.O_RDONLY))
                except OSError as exc:
                    assert exc.errno == errno.EMFILE
                    return

        try:
            for ino in range(2, 12):
                os.pwrite(staging.create_empty(ino, 1), b"kept", 0)
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 8, hard))
            exhaust()
            fd = staging.create_empty(100, 1)     # the ten idle descriptors went back
            os.pwrite(fd, b"x", 0)
            assert staging.held() == 1
            staging.close_all()
            exhaust()
            with pytest.raises(FsError) as info:
                staging.create_empty(101, 1)
            assert info.value.errno == errno.EMFILE
            with pytest.raises(FsError) as info:
                with staging.owned_fd(2, 1):
                    pass
            assert info.value.errno == errno.EMFILE
            os.close(hogs.pop())
            os.close(hogs.pop())
            with staging.owned_fd(2, 1) as owned:
                assert os.pread(owned, 4, 0) == b"kept"
        finally:
            for fd in hogs:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            staging.close_all()

    alone_in_a_child(body)
