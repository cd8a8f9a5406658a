"""Async mode's uploads give way to a writer that is writing (decision 0015): they wait
while it writes, fsyncs or opens files, start the moment it pauses, and trickle one at a
time once it has held them for ``upload_hold`` seconds, so a writer that never pauses
does not starve them."""

from __future__ import annotations

import os
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import trio.testing

from ckptfs.meta.namespace import ROOT_INO
from ckptfs.data.upload import UploadGate

CS = 64 << 10


# ------------------------------------------------------------------ the gate alone

def run_mocked(fn) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def passing(gate: UploadGate, passed_at: list[float]):
    """An upload that notes when it passed the gate."""
    async def upload() -> None:
        async with gate.slot():
            passed_at.append(trio.current_time())
    return upload


def test_uploads_wait_while_writes_keep_coming_and_start_when_the_writer_pauses():
    async def main():
        gate = UploadGate(hold=10.0)
        passed_at: list[float] = []
        upload = passing(gate, passed_at)

        async with trio.open_nursery() as nursery:
            gate.wrote()
            for _ in range(3):
                nursery.start_soon(upload)
            for _ in range(40):                      # a write every 50 ms for 2 s
                await trio.sleep(0.05)
                gate.wrote()
            last_write = trio.current_time()
        assert len(passed_at) == 3
        assert min(passed_at) >= last_write + UploadGate.QUIET
        assert max(passed_at) <= last_write + 2 * UploadGate.QUIET

    run_mocked(main)


def test_an_fsync_in_flight_keeps_the_writer_active_however_long_it_takes():
    async def main():
        gate = UploadGate(hold=10.0)
        passed_at: list[float] = []
        upload = passing(gate, passed_at)

        async with trio.open_nursery() as nursery:
            gate.wrote()
            nursery.start_soon(upload)
            with gate.busy():
                await trio.sleep(3.0)                 # a slow fsync
                assert passed_at == []
            ended = trio.current_time()
        assert ended + UploadGate.QUIET <= passed_at[0] <= ended + 2 * UploadGate.QUIET

    run_mocked(main)


@pytest.mark.parametrize("hold", [0.0, 1.0])
def test_a_writer_that_never_pauses_gets_uploads_one_at_a_time_after_the_hold(hold):
    async def main():
        gate = UploadGate(hold=hold)
        in_flight = most = 0
        started_at: list[float] = []

        async def upload():
            nonlocal in_flight, most
            async with gate.slot():
                in_flight += 1
                most = max(most, in_flight)
                started_at.append(trio.current_time())
                await trio.sleep(0.2)
                in_flight -= 1

        t0 = trio.current_time()
        gate.wrote()
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(upload)
            while len(started_at) < 4:               # the writer never pauses
                await trio.sleep(0.02)
                gate.wrote()
        assert most == 1
        assert min(started_at) >= t0 + hold
        assert max(started_at) <= t0 + hold + 4 * 0.2 + 0.5

    run_mocked(main)


async def keep_writing(gate: UploadGate, seconds: float, sleep) -> None:
    """A writer that writes every 20 ms for ``seconds``."""
    for _ in range(round(seconds / 0.02)):
        await sleep(0.02)
        gate.wrote()


class Timers:
    """Counts ``trio.sleep`` calls (the gate's timers); the test's own writer sleeps with
    ``real_sleep``, which is not counted."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        self.real_sleep = trio.sleep
        monkeypatch.setattr(trio, "sleep", self._counted)

    async def _counted(self, seconds: float) -> None:
        self.count += 1
        await self.real_sleep(seconds)


@pytest.fixture
def timers(monkeypatch) -> Timers:
    return Timers(monkeypatch)


def test_a_hundred_waiting_uploads_share_one_timer(timers):
    # Each waiting upload polled on its own (20 wake-ups a second each): with a
    # checkpoint's 128 pipelined chunks waiting, the polls took ~7% of the FUSE thread
    # while the writer was blocked on it.

    async def main():
        gate = UploadGate(hold=10.0)
        passed = 0

        async def upload_():
            nonlocal passed
            async with gate.slot():
                passed += 1

        async with trio.open_nursery() as nursery:
            gate.wrote()
            for _ in range(100):
                nursery.start_soon(upload_)
            await keep_writing(gate, 2.0, timers.real_sleep)
        assert passed == 100
        assert timers.count <= 2 * 2.0 / (UploadGate.QUIET / 2), timers.count

    run_mocked(main)


# ------------------------------------------------------------------ in the core

ASYNC = {"durability": "async", "chunk_size": CS}


class PutWatch:
    """Times and concurrency of the store's chunk PUTs (hooks run in store threads);
    each PUT takes ``delay`` seconds so parallel ones overlap."""

    def __init__(self, store, delay: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.started: list[tuple[float, int]] = []   # (when, in flight then)
        self.in_flight = 0
        self.delay = delay
        store.before(self._before, op="put", prefix="chunks/")
        store.after(self._after, op="put", prefix="chunks/")

    def _before(self, call) -> None:
        with self.lock:
            self.in_flight += 1
            self.started.append((time.monotonic(), self.in_flight))
        time.sleep(self.delay)

    def _after(self, call) -> None:
        with self.lock:
            self.in_flight -= 1

    def between(self, start: float, end: float) -> list[int]:
        return [n for t, n in self.started if start <= t <= end]


async def open_for_writing(core, name: bytes) -> int:
    handle, _ = await core.fs.create(ROOT_INO, name, 0o644,
                                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0, core.me())
    return handle.fh


async def close(core, fh: int) -> None:
    await core.fs.flush(fh)
    await core.fs.release(fh)


@pytest.mark.trio
@pytest.mark.parametrize("core_config", [ASYNC])
async def test_no_upload_runs_while_a_writer_writes_even_through_a_slow_fsync(
        core, monkeypatch):
    watch = PutWatch(core.store)
    await core.save(ROOT_INO, b"first", os.urandom(8 * CS))   # closed: its upload waits
    fh = await open_for_writing(core, b"second")
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.5)                 # longer than a writer's pause between writes
        real_fsync(fd)

    start = time.monotonic()
    for index in range(10):
        await core.fs.write(fh, index * CS, os.urandom(CS))
        await trio.sleep(0.02)
        if index == 4:
            monkeypatch.setattr(os, "fsync", slow_fsync)
            await core.fs.fsync(fh, False)
            monkeypatch.setattr(os, "fsync", real_fsync)
    end = time.monotonic()
    assert core.fs.stats()["uploads_held_for_writer_s"] >= 0.5   # what `status` shows
    await close(core, fh)
    assert watch.between(start, end) == []
    with trio.fail_after(30):
        await core.fs.queue.wait_idle()
    assert len(watch.started) == 8 + 10


class GatePasses:
    """Each upload's pass through the core's upload gate, with what the gate saw then:
    whether the writer was active, how long it had held uploads, how many uploads that
    went beside an active writer were still uploading, and how many uploads of any kind
    were.  Conditions, not clock windows: under load a writer's 10 ms sleep can last
    longer than ``QUIET``, and the gate then rightly counts it as a pause."""

    @dataclass
    class Pass:
        active: bool
        held_for: float
        trickling: int
        inside: int

    def __init__(self, core) -> None:
        gate = core.fs.st.upload_gate
        uploader = core.fs.st.uploader
        slot = uploader.slot
        self.passes: list[GatePasses.Pass] = []
        trickling = inside = 0

        @asynccontextmanager
        async def watched():
            nonlocal trickling, inside
            async with slot():
                active = gate.active()
                self.passes.append(self.Pass(active, gate.held_for(), trickling, inside))
                trickling += active
                inside += 1
                try:
                    yield
                finally:
                    trickling -= active
                    inside -= 1

        uploader.slot = watched

    def beside_writer(self) -> list[GatePasses.Pass]:
        return [p for p in self.passes if p.active]


@pytest.mark.trio
@pytest.mark.parametrize("core_config", [{**ASYNC, "upload_hold": 0.3}])
async def test_uploads_trickle_beside_a_writer_that_never_pauses_then_run_in_parallel(core):
    passes = GatePasses(core)
    PutWatch(core.store, delay=0.05)             # each PUT lasts, so parallel ones overlap
    await core.save(ROOT_INO, b"first", os.urandom(16 * CS))
    fh = await open_for_writing(core, b"second")
    # A write every 10 ms for at least 1.5 s and until three uploads went beside the
    # writer; the deadline only bounds a run where they starve.
    start = time.monotonic()
    index = 0
    with trio.fail_after(60):
        while time.monotonic() - start < 1.5 or len(passes.beside_writer()) < 3:
            await core.fs.write(fh, index * CS, os.urandom(CS))
            index += 1
            await trio.sleep(0.01)
    beside = passes.beside_writer()
    assert all(p.held_for >= 0.3 for p in beside), \
        f"an upload went beside the writer before upload_hold: {beside}"
    assert all(p.trickling == 0 for p in beside), \
        f"uploads beside a writer must go one at a time: {beside}"
    await close(core, fh)
    with trio.fail_after(30):
        await core.fs.queue.wait_idle()
    assert any(not p.active and p.inside > 0 for p in passes.passes), \
        f"once the writer paused, uploads should run in parallel: {passes.passes}"


def test_uploads_trickling_beside_a_writer_that_never_pauses_still_share_one_timer(timers):
    # Once ``hold`` has passed, the uploads that wait for their turn to trickle each
    # polled on their own (20 wake-ups a second each): a save longer than ``hold`` got
    # back the polls ``test_a_hundred_waiting_uploads_share_one_timer`` removed, for as
    # long as it lasted.

    async def main():
        gate = UploadGate(hold=1.0)
        in_flight = most = passed = 0

        async def upload_():
            nonlocal in_flight, most, passed
            async with gate.slot():
                in_flight += 1
                most = max(most, in_flight)
                await timers.real_sleep(0.1)                # the PUT
                in_flight -= 1
                passed += 1

        async with trio.open_nursery() as nursery:
            gate.wrote()
            for _ in range(100):
                nursery.start_soon(upload_)
            await keep_writing(gate, 4.0, timers.real_sleep)
            trickled, most_while_writing = passed, most
        assert 20 <= trickled <= 35                  # one at a time for the last 3 s
        assert most_while_writing == 1
        assert passed == 100
        assert timers.count <= 2 * 4.0 / (UploadGate.QUIET / 2), timers.count

    run_mocked(main)
