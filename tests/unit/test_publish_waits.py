"""What waits for the publish queue wakes when it changes, not on a timer: a seal or a
directory rename waiting for the uploads below it, a metadata-log record waiting for the
publishes closed before it, a writer waiting for room under ``max_staged``.  Under a
``MockClock`` that never advances on its own, a 50 ms poll would never look again; each
waiter must return as soon as the publish it waits for is done, with the clock at 0."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from ckptfs.data.publish_queue import PublishQueue
from ckptfs.meta.namespace import ROOT_INO as ROOT
from ckptfs.store import StoreError

pytestmark = pytest.mark.trio


class Gate:
    """Holds the queue's publishes until opened (or failed)."""

    def __init__(self, publish: Callable[[int], Awaitable[bool | None]]) -> None:
        self.publish = publish
        self.opened = trio.Event()
        self.error: Exception | None = None
        self.started: set[int] = set()
        self.finished = trio.Event()

    async def __call__(self, ino: int) -> bool | None:
        self.started.add(ino)
        await self.opened.wait()
        try:
            if self.error is not None:
                raise self.error
            return await self.publish(ino)
        finally:
            self.finished.set()


async def _waits_then_wakes(wait: Callable[[], Awaitable[None]], gate: Gate) -> None:
    done = trio.Event()

    async def waiter() -> None:
        await wait()
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.started and not done.is_set()        # it waits for the publish
        gate.opened.set()
        await gate.finished.wait()
        await trio.testing.wait_all_tasks_blocked()      # the clock stands still
        assert done.is_set(), "the waiter did not notice the publish finishing"
        assert trio.current_time() == 0.0
        nursery.cancel_scope.cancel()


async def test_the_queue_wakes_its_waiters_when_a_publish_finishes(mock_clock):
    async def published(ino: int) -> bool:
        return True

    gate = Gate(published)
    queue = PublishQueue(gate, workers=1)

    async def idle_of_7() -> None:
        while 7 in queue.active():
            await queue.wait_change()

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.submit(7)
        await _waits_then_wakes(idle_of_7, gate)
        nursery.cancel_scope.cancel()


async def test_the_queue_wakes_its_waiters_when_a_publish_is_refused(mock_clock):
    gate = Gate(lambda ino: None)   # never reached: the gate fails it
    gate.error = StoreError("InvalidArgument: bad key")
    queue = PublishQueue(gate, workers=1)

    async def refused_7() -> None:
        while 7 not in queue.failed:
            await queue.wait_change()

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        queue.submit(7)
        await _waits_then_wakes(refused_7, gate)
        nursery.cancel_scope.cancel()


async def _pending_under_a_dir(core) -> tuple[int, int, Gate]:
    """A directory with a file whose (background) publish is held by a gate."""
    d = (await core.fs.mkdir(ROOT, b"ckpt", 0o755, 0, 0)).ino
    ino = await core.save(d, b"shard.bin", b"x" * 1000)
    gate = Gate(core.fs.queue._publish)
    core.fs.queue._publish = gate
    core.fs.queue.submit(ino)
    await trio.testing.wait_all_tasks_blocked()
    assert ino in core.fs.queue.active()
    return d, ino, gate


async def test_a_seal_waiting_for_the_uploads_below_wakes_when_they_land(core, mock_clock):
    d, _, gate = await _pending_under_a_dir(core)
    await _waits_then_wakes(lambda: core.fs.seals._wait_uploads_under(d), gate)


async def test_a_log_record_waiting_for_earlier_publishes_wakes_when_they_land(core,
                                                                               mock_clock):
    d, ino, gate = await _pending_under_a_dir(core)
    core.fs.st._publish_epoch[ino] = 1
    await _waits_then_wakes(lambda: core.fs.metalog._wait_publishes_before(5, d), gate)


async def test_a_writer_waiting_for_room_wakes_when_an_upload_lands(core, mock_clock):
    _, _, gate = await _pending_under_a_dir(core)
    core.fs.writes.max_staged = -1       # over the bound while anything is queued
    await _waits_then_wakes(core.fs.writes._wait_for_room, gate)


async def test_writers_held_by_max_staged_are_said_once_a_minute_not_per_write(
        core, mock_clock, caplog):
    """fsx under ``--max-staged 3M`` logged the warning 1 240 times in 2.5 minutes: once
    per write that waited.  Now once, then at most once a minute with how many more
    times writers waited meanwhile (49: the 50 calls but the first)."""
    core.fs.writes.max_staged = -1       # over the bound (nothing queued: no wait)
    with caplog.at_level(logging.WARNING, logger="ckptfs.core.write"):
        for _ in range(50):
            await core.fs.writes._wait_for_room()
            mock_clock.jump(0.1)
        assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
        mock_clock.jump(60)
        await core.fs.writes._wait_for_room()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "(49 times since" in said[1], said
