"""The metadata log on its own (oplog.py): order, retries, drops, busy directories,
epochs, aliases, and a restart that resumes it."""

from __future__ import annotations

import trio

from ckptfs.meta.namespace import Namespace
from ckptfs.meta.oplog import MetaLog, OpDropped
from ckptfs.store.retrypolicy import RetryPolicy
from ckptfs.store import AccessDenied, BucketMissing, StoreError, TransientStoreError
from ckptfs.store.health import StoreHealth


def test_records_apply_in_order_and_no_store_error_ever_drops_one(tmp_path):
    """Transient errors, access denied, a missing bucket and a refused request are all
    retried, in order; only a record with nothing left to apply (``OpDropped``) leaves
    the journal without reaching the store (decision 0016)."""
    ns = Namespace(tmp_path / "meta")
    applied: list[int] = []
    failures = {"b": [TransientStoreError("503"), TransientStoreError("503")],
                "c": [AccessDenied("access denied by the store (403)")] * 3,
                "d": [BucketMissing("bucket 'x' does not exist")],
                "e": [StoreError("400 key too long")],
                "f": [OpDropped("removed here since")]}

    async def execute(seq: int, record: dict) -> None:
        errors = failures.get(record["name"])
        if errors:
            raise errors.pop(0)
        applied.append(seq)

    async def main() -> None:
        health = StoreHealth()
        log = MetaLog(ns, policy=RetryPolicy(attempts=None, base_delay=0.01, max_delay=0.02),
                      health=health)
        seqs = [log.add({"kind": "x", "name": n}, dirs=[1, 2]) for n in "abcdefg"]
        assert log.is_busy(1) and log.is_busy(2) and not log.is_busy(3)
        assert log.epoch() == seqs[-1] and not log.done_through(seqs[0])
        outages: list[str | None] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run, execute)

            async def watch() -> None:
                while True:
                    outages.append(health.cause)
                    await trio.sleep(0.002)
            nursery.start_soon(watch)
            with trio.fail_after(10):
                await log.wait_idle()
            nursery.cancel_scope.cancel()
        assert applied == [seqs[0], seqs[1], seqs[2], seqs[3], seqs[4], seqs[6]]
        assert log.dropped == 1 and not log.pending and not log.is_busy(1)
        assert log.done_through(seqs[-1]) and ns.journal() == []
        assert "access denied" in outages and health.cause is None

    trio.run(main)


def test_pending_records_survive_a_restart_and_aliases_resolve(tmp_path):
    ns = Namespace(tmp_path / "meta")

    async def first() -> None:
        log = MetaLog(ns)
        log.add({"kind": "mkdir", "name": "61"}, dirs=[7])
        log.add({"kind": "move", "name": "62"}, dirs=[7, 8])
        log.alias("local-id", "shared-id")
        log.alias("shared-id", "final-id")

    trio.run(first)
    ns.close()
    ns = Namespace(tmp_path / "meta")

    async def second() -> None:
        log = MetaLog(ns)
        assert [r["kind"] for _, r in sorted(log.pending.items())] == ["mkdir", "move"]
        assert log.busy[7] == 2 and log.busy[8] == 1
        assert log.resolve("local-id") == "final-id" and log.resolve("other") == "other"
        seen: list[str] = []

        async def execute(seq: int, record: dict) -> None:
            seen.append(record["kind"])

        async with trio.open_nursery() as nursery:
            await nursery.start(log.run, execute)
            with trio.fail_after(10):
                await log.wait_idle()
            nursery.cancel_scope.cancel()
        assert seen == ["mkdir", "move"] and ns.journal() == []

    trio.run(second)


def test_a_record_changed_in_a_batch_that_fails_is_as_before(tmp_path):
    """``update`` (a conflict renamed what a record creates) inside a batch that then
    fails: the journal keeps the record as it was, and so does the log in memory --
    it kept the change, so its retry would have acted on a name this node never took
    (found by a review, stop 50).  Epochs of records added in that batch go too."""
    ns = Namespace(tmp_path / "meta")

    async def main() -> None:
        log = MetaLog(ns)
        seq = log.add({"kind": "mkdir", "name": "61"}, dirs=[7])
        before = log.epoch()
        try:
            with ns.batch():
                log.update(seq, {"kind": "mkdir", "name": "62", "dirs": [7]})
                log.add({"kind": "move", "name": "63"}, dirs=[7])
                assert log.epoch() > before
                raise OSError("the state dir is full")
        except OSError:
            pass
        assert log.pending[seq]["name"] == "61"
        assert [r["name"] for _, r in ns.journal()] == ["61"]
        assert log.epoch() == before

    trio.run(main)
    ns.close()
