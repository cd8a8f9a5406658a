"""Ray Train's completion record seals its checkpoints (issue 14), without Ray itself:
the controller rewrites ``<run>/checkpoint_manager_snapshot.json`` in place (open with
O_TRUNC, one write, close) after each checkpoint is in place, naming every kept one.
The framework suite (tests/frameworks/test_ray.py) runs the real thing."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from support.mounts import eventually

SNAPSHOT = "checkpoint_manager_snapshot.json"


def snapshot(names: list[str], pad: int = 300) -> bytes:
    def result(name):
        return {"version": 0, "checkpoint_dir_name": name, "metrics": {"note": "x" * pad}}
    return json.dumps({"ray_version": "2.60.0",
                       "checkpoint_results": [result(n) for n in names],
                       "checkpoint_report_indices": list(range(len(names))),
                       "latest_checkpoint_result": result(names[-1]) if names else None,
                       "pending_training_results": [], "pending_validation_specs": [],
                       "current_report_index": len(names),
                       "validated_checkpoint_dir_names": [],
                       "timed_out_validation_checkpoint_dir_names": [],
                       "failed_validation_checkpoint_dir_names": []}).encode()


def save_checkpoint(run, name: str) -> bytes:
    data = os.urandom(100_000)
    (run / name).mkdir()
    (run / name / "model.pt").write_bytes(data)
    return data


def listed(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("checkpoint_2"))


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_snapshot_closed_in_place_seals_what_it_names(store, make_mount, durability):
    mnt = make_mount(store, durability=durability)
    run = mnt.path / "run"
    run.mkdir()
    a, b, c = (f"checkpoint_2026-11-30_21-29-3{i}.000000" for i in range(3))
    data = {a: save_checkpoint(run, a), b: save_checkpoint(run, b)}
    assert listed(run) == []
    (run / SNAPSHOT).write_bytes(snapshot([a], pad=5000))      # > 4 KiB
    assert eventually(lambda: listed(run) == [a])
    (run / SNAPSHOT).write_bytes(snapshot([a, b], pad=5000))
    assert eventually(lambda: listed(run) == [a, b])
    # Rotation (num_to_keep): Ray writes the snapshot first, then deletes the oldest.
    data[c] = save_checkpoint(run, c)
    (run / SNAPSHOT).write_bytes(snapshot([b, c], pad=5000))
    shutil.rmtree(run / a)
    assert eventually(lambda: listed(run) == [b, c])
    fresh = make_mount(store, name="fresh")
    frun = fresh.path / "run"
    assert eventually(lambda: listed(frun) == [b, c])
    for name in (b, c):
        assert (frun / name / "model.pt").read_bytes() == data[name]
    assert not (frun / a).exists()


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_snapshot_renamed_into_place_seals(store, make_mount, durability):
    mnt = make_mount(store, durability=durability)
    run = mnt.path / "run"
    run.mkdir()
    name = "checkpoint_2026-11-30_21-29-38.762799"
    data = save_checkpoint(run, name)
    (run / (SNAPSHOT + ".tmp")).write_bytes(snapshot([name], pad=5000))
    assert listed(run) == []
    os.rename(run / (SNAPSHOT + ".tmp"), run / SNAPSHOT)
    assert eventually(lambda: listed(run) == [name])
    fresh = make_mount(store, name="fresh")
    assert eventually(lambda: listed(fresh.path / "run") == [name])
    assert (fresh.path / "run" / name / "model.pt").read_bytes() == data


def test_checkpoint_ray_never_recorded_stays_hidden(local_store, make_mount):
    mnt = make_mount(local_store)
    run = mnt.path / "run"
    run.mkdir()
    kept, lost = "checkpoint_2026-11-30_21-29-38.000001", "checkpoint_2026-11-30_21-29-39.000002"
    save_checkpoint(run, kept)
    save_checkpoint(run, lost)           # copied, but the controller never recorded it
    (run / SNAPSHOT).write_bytes(snapshot([kept]))
    assert eventually(lambda: listed(run) == [kept])
    fresh = make_mount(local_store, name="fresh")
    assert listed(fresh.path / "run") == [kept]
    assert (fresh.path / "run" / lost).is_dir()      # found by exact name, never listed


def test_snapshot_written_on_another_node_than_the_checkpoint(s3_store, make_mount):
    """The Ray controller (head node) records a checkpoint that a worker on another node
    created a moment ago, before the head node's listing of the run directory knew it."""
    worker = make_mount(s3_store, name="worker", extra=("--metadata-ttl", "30"))
    head = make_mount(s3_store, name="head", extra=("--metadata-ttl", "30"))
    (worker.path / "run").mkdir()
    hrun = eventually(lambda: (head.path / "run").is_dir() and head.path / "run")
    assert listed(hrun) == []                       # the head node's listing: fresh, empty
    name = "checkpoint_2026-11-30_21-29-38.762799"
    data = save_checkpoint(worker.path / "run", name)
    (hrun / SNAPSHOT).write_bytes(snapshot([name]))
    fresh = make_mount(s3_store, name="fresh")
    assert eventually(lambda: listed(fresh.path / "run") == [name])
    assert (fresh.path / "run" / name / "model.pt").read_bytes() == data
