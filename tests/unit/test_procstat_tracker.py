"""The killed-writer check against real processes, and the pipelined-chunk tracker."""

import os
import signal
import subprocess
import sys
import threading
import time

from ckptfs.procstat import Opener, died_unclean, exit_state
from ckptfs.data.upload import ChunkTracker


def test_live_process_is_not_exiting():
    assert exit_state(os.getpid()) == (False, 0)
    assert not died_unclean(Opener.from_tid(os.getpid()))


def test_an_opener_is_known_by_its_thread_group_from_any_of_its_threads():
    """The main thread is its own group (found by ``pidfd_open``); another thread's
    group is its process (from its status); a task that is gone has none of its own."""
    assert Opener.from_tid(os.getpid()) == Opener(os.getpid(), os.getpid())
    seen = []
    worker = threading.Thread(target=lambda: seen.append(
        (threading.get_native_id(), Opener.from_tid(threading.get_native_id()))))
    worker.start()
    worker.join()
    tid, opener = seen[0]
    assert tid != os.getpid() and opener == Opener(tid, os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert Opener.from_tid(proc.pid) == Opener(proc.pid, proc.pid)


def test_gone_process_counts_as_clean_close():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert exit_state(proc.pid) is None
    assert not died_unclean(Opener(proc.pid, proc.pid))


def test_killed_process_seen_while_exiting():
    """A zombie keeps PF_EXITING and its exit code readable until reaped."""
    for sig, expect_unclean in ((signal.SIGKILL, True), (signal.SIGTERM, True)):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        opener = Opener.from_tid(proc.pid)
        proc.send_signal(sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = exit_state(proc.pid)
            if state and state[0]:
                break
            time.sleep(0.01)
        exiting, code = exit_state(proc.pid)
        assert exiting and code & 0x7F == sig
        assert died_unclean(opener) is expect_unclean
        proc.wait()


def test_tracker_pipelines_sequential_chunks_and_invalidates_rewrites():
    t = ChunkTracker(chunk_size=10)
    assert t.note_write(0, 4) == []
    assert t.note_write(4, 16) == [0, 1]
    for i in (0, 1):
        t.start(i)
    assert t.note_write(20, 5) == []
    t.note_write(5, 1)                  # rewrite inside chunk 0: no longer sequential
    assert 0 not in t.pending and 1 in t.pending
    assert t.note_write(25, 20) == []   # pipelining stopped for this file
    t.invalidate_from(12)
    assert t.pending == {}
