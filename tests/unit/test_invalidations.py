"""Kernel cache invalidations from their own thread (ckptfs/fuse/invalidations.py),
against a recording stand-in for pyfuse3's call: in order, each waiting inode once,
nothing after close, a failing call does not stop the rest."""

from __future__ import annotations

import threading
import time

from ckptfs.fuse.invalidations import InodeInvalidations


class Kernel:
    """Records the calls; ``gate`` holds each call until set; inode 13 is unknown."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.thread_names: set[str] = set()

    def invalidate(self, ino: int, attr_only: bool) -> None:
        self.gate.wait(10)
        self.thread_names.add(threading.current_thread().name)
        if ino == 13:
            raise FileNotFoundError(2, "no such inode")
        self.calls.append((ino, attr_only))


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_asked_before_start_sent_after_in_order_on_a_thread_of_its_own():
    kernel = Kernel()
    inval = InodeInvalidations(kernel.invalidate)
    for ino in (5, 13, 6, 7):
        inval(ino)
    time.sleep(0.05)
    assert kernel.calls == []               # no FUSE session yet: nothing sent
    inval.start()
    until(lambda: len(kernel.calls) == 3)
    assert kernel.calls == [(5, False), (6, False), (7, False)]   # 13 failed, the rest went
    assert kernel.thread_names == {"ckptfs-invalidate"}
    inval.close()


def started_with_inode_1_held(kernel: Kernel) -> InodeInvalidations:
    """Sending, with inode 1 taken by the thread and held in the "kernel"."""
    inval = InodeInvalidations(kernel.invalidate)
    inval.start()
    kernel.gate.clear()
    inval(1)
    until(lambda: not inval._waiting)
    return inval


def test_an_inode_waiting_is_queued_once_and_again_once_taken():
    kernel = Kernel()
    inval = started_with_inode_1_held(kernel)
    inval(1)                        # asked again after it was taken: sent again
    inval(2)
    inval(1)                        # still waiting: not queued twice
    inval(2)
    kernel.gate.set()
    until(lambda: inval.sent == 3)
    time.sleep(0.05)
    assert kernel.calls == [(1, False), (1, False), (2, False)]
    inval.close()


def test_nothing_is_sent_after_close():
    kernel = Kernel()
    inval = started_with_inode_1_held(kernel)
    inval(2)                        # queued behind the held call
    closer = threading.Thread(target=inval.close)
    closer.start()
    time.sleep(0.05)
    kernel.gate.set()               # the held call ends; 2 must not go after close
    closer.join(10)
    inval(3)
    time.sleep(0.1)
    assert kernel.calls == [(1, False)]
    assert not inval._thread.is_alive()


def test_attributes_now_are_forgotten_on_the_callers_thread_before_it_returns():
    """A version taken behind the kernel's back: its attributes at once, attribute-only,
    not through the queue; nothing before start or after close; an inode the kernel
    does not know is no error."""
    kernel = Kernel()
    inval = InodeInvalidations(kernel.invalidate)
    inval.attributes_now(4)                 # no FUSE session yet
    assert kernel.calls == []
    inval.start()
    inval.attributes_now(4)
    assert kernel.calls == [(4, True)]      # before it returned
    inval.attributes_now(13)                # unknown to the kernel: quietly nothing
    assert kernel.thread_names == {threading.current_thread().name}
    inval.close()
    inval.attributes_now(5)
    assert kernel.calls == [(4, True)]
