"""Ray Train 2.60 (Train V2) through the mount (issue 14): a ``TorchTrainer`` with two CPU
workers (gloo) and ``RunConfig(storage_path=<mount>)``, ``CheckpointConfig(num_to_keep=2)``,
reporting a checkpoint every epoch in each upload mode:

- SYNC and ASYNC: rank 0 saves into a local temporary directory; Ray copies it into
  ``<run>/checkpoint_<timestamp>/`` (pyarrow ``copy_files``), in the report call or in a
  background thread.
- NO_UPLOAD: both ranks write DCP shards straight into ``<run>/checkpoint_epoch_NNN`` on
  the mount and report that directory.

The checkpoint directories are staged (unlisted) until Ray's controller records them in
``<run>/checkpoint_manager_snapshot.json``; then they are listed, rotation deletes show
in ``ls``, and a trainer with the same run name on a fresh mount (another node: its own
state dir) resumes from the latest checkpoint with the bytes the first node wrote.
A checkpoint that a worker was killed copying is never listed and ``ckptfs gc`` reclaims
it.  One Ray session for the module; a tiny torch model built in code."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.mounts import eventually, run_ckptfs

# The controller polls its workers for reports every 2 s by default: 0.2 s keeps this
# suite short.  Read by ray.init's processes, so set before it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
import ray.train  # noqa: E402
from ray.train import CheckpointConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

SNAPSHOT = "checkpoint_manager_snapshot.json"
MODES = ["SYNC", "ASYNC", "NO_UPLOAD"]
MiB = 1 << 20


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    # The workers unpickle the training loop by value: this module is not importable
    # from their working directory.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Ray's sessions (logs, sockets) under pytest's temp dir, not /tmp/ray.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def backend(request):
    """The store and the durability the mounts use (``local-sync`` or ``s3-async``)."""
    kind, durability = request.param.split("-")
    return request.getfixturevalue(f"{kind}_store"), durability


# ------------------------------------------------------------------ the training loop
# Runs in the Ray workers.


def file_digests(directory) -> dict[str, str]:
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def state_at(epoch: int, rank: int) -> dict:
    """The model after ``epoch`` (the same on every rank) and one rank-private tensor."""
    import torch

    g = torch.Generator().manual_seed(1234)
    state = {"weight": torch.randn(256, 256, generator=g) + epoch,
             "bias": torch.arange(256, dtype=torch.float32) * (epoch + 1)}
    return {"model": state, f"rank{rank}": torch.full((4096,), float(rank * 100 + epoch))}


def same_state(got: dict, want: dict) -> bool:
    import torch

    def same(a, b) -> bool:
        if isinstance(b, dict):
            return isinstance(a, dict) and same_state(a, b)
        if isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and torch.equal(a, b)
        return a == b

    return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)


def train_loop(config: dict) -> None:
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp
    from ray.train import Checkpoint, CheckpointUploadMode

    mode = config["mode"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    resumed: dict = {}
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            if mode == "NO_UPLOAD":
                target = state_at(0, rank)
                target["epoch"] = -1
                dcp.load(target, checkpoint_id=directory)
                epoch = target["epoch"]
            else:
                target = torch.load(os.path.join(directory, "model.pt"))
                epoch = target["epoch"]
            want = state_at(epoch, rank)
            want["epoch"] = epoch
            resumed = {"resumed_from": epoch, "weights_ok": same_state(target, want),
                       "loaded_files": file_digests(directory)}
        start = epoch + 1
    for epoch in range(start, config["epochs"]):
        metrics = {"epoch": epoch, **resumed}
        state = state_at(epoch, rank)
        state["epoch"] = epoch
        if mode == "NO_UPLOAD":
            name = f"checkpoint_epoch_{epoch:03d}"
            path = ctx.get_storage().build_checkpoint_path_from_name(name)
            dcp.save(state, checkpoint_id=path)
            if rank == 0:
                metrics["files"] = file_digests(path)
            ray.train.report(metrics, checkpoint=Checkpoint(path), checkpoint_dir_name=name,
                             checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        else:
            checkpoint = None
            if rank == 0:
                # ASYNC copies after report returns: the directory must outlive the call
                # (Ray deletes it after the upload).
                tmp = tempfile.mkdtemp(prefix="ray-ckpt-")
                torch.save(state, os.path.join(tmp, "model.pt"))
                with open(os.path.join(tmp, "notes.json"), "w") as f:
                    json.dump({"epoch": epoch}, f)
                metrics["files"] = file_digests(tmp)
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint,
                             checkpoint_upload_mode=getattr(CheckpointUploadMode, mode),
                             delete_local_checkpoint_after_upload=True)


# ------------------------------------------------------------------ driver side


def fit(storage: Path, name: str, mode: str, epochs: int):
    trainer = TorchTrainer(
        train_loop, train_loop_config={"mode": mode, "epochs": epochs},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    return trainer.fit()


def listed(run: Path) -> list[str]:
    """Checkpoint directories a listing of the run directory shows."""
    return sorted(n for n in os.listdir(run) if n.startswith("checkpoint_") and n != SNAPSHOT)


def recorded(run: Path) -> list[dict]:
    """What Ray's snapshot says it keeps, oldest first."""
    return json.loads((run / SNAPSHOT).read_text())["checkpoint_results"]


def names(results: list[dict]) -> list[str]:
    return sorted(r["checkpoint_dir_name"] for r in results)


# Each upload mode once, NO_UPLOAD (workers write into the mount themselves) on both
# backends: the upload mode is Ray's side (who copies, when), the backend ckptfs's; a
# Ray fit costs ~25 s here, and the full product of the two took six minutes of the
# suite.  SYNC, which also runs the killed copy, goes over S3.
PAIRS = [("s3-async", "SYNC"), ("local-sync", "ASYNC"),
         ("local-sync", "NO_UPLOAD"), ("s3-async", "NO_UPLOAD")]
assert {mode for _, mode in PAIRS} == set(MODES)


@pytest.mark.parametrize("backend,mode", PAIRS, indirect=["backend"])
def test_ray_train_checkpoints_rotation_and_resume_on_a_fresh_mount(
        ray_session, backend, make_mount, mode):
    store, durability = backend
    node1 = make_mount(store, name="node1", durability=durability)
    name = f"run_{mode.lower()}"
    run = node1.path / name

    result = fit(node1.path, name, mode, epochs=3)
    kept = recorded(run)
    assert [r["metrics"]["epoch"] for r in kept] == [1, 2]
    assert Path(result.checkpoint.path).name == kept[-1]["checkpoint_dir_name"]
    # Recorded: listed (sealed).  Rotated out (epoch 0): gone from the listing.
    assert eventually(lambda: listed(run) == names(kept)), (listed(run), names(kept))
    if mode == "NO_UPLOAD":
        assert not (run / "checkpoint_epoch_000").exists()

    # Another node: a fresh mount with its own state dir sees the same two checkpoints,
    # with the bytes the workers wrote.
    node2 = make_mount(store, name="node2", durability=durability)
    run2 = node2.path / name
    assert eventually(lambda: run2.is_dir() and listed(run2) == names(kept))
    for r in kept:
        assert file_digests(run2 / r["checkpoint_dir_name"]) == r["metrics"]["files"]

    # Resume by run name there: Ray's snapshot leads it to the latest checkpoint.
    result2 = fit(node2.path, name, mode, epochs=4)
    assert result2.metrics["resumed_from"] == 2
    assert result2.metrics["weights_ok"] is True
    assert result2.metrics["loaded_files"] == kept[-1]["metrics"]["files"]
    kept2 = recorded(run2)
    assert [r["metrics"]["epoch"] for r in kept2] == [2, 3]
    assert eventually(lambda: listed(run2) == names(kept2))
    assert eventually(lambda: listed(run) == names(kept2))   # node1 sees the rotation
    if mode == "SYNC":
        killed_copy_stays_hidden_and_gc_reclaims_it(store, durability, make_mount,
                                                    node1, node2, name, kept2)


KILLED_COPY = r"""
import sys
from ray.train import Checkpoint
from ray.train.v2._internal.execution.storage import StorageContext
storage, name, source, target = sys.argv[1:5]
# What a Ray Train worker does in report(): copy its checkpoint into the run directory.
StorageContext(storage, name).persist_current_checkpoint(Checkpoint.from_directory(source),
                                                         target)
print("copied", flush=True)
"""


def killed_copy_stays_hidden_and_gc_reclaims_it(store, durability, make_mount, node1,
                                                node2, name, kept):
    """A worker on a third node is SIGKILLed while Ray's copy routine fills
    ``<run>/checkpoint_<ts>``: Ray never records it, so no node ever lists it, a resume
    never sees it, and ``ckptfs gc`` reclaims the staged tree."""
    slow = {"rules": [{"op": "put", "prefix": "chunks/", "kind": "delay", "delay": 2}]}
    node3 = make_mount(store, name="node3", durability="sync", faults=slow)
    source = node1.path.parent / "worker-local-ckpt"
    source.mkdir()
    for i in range(3):
        (source / f"shard{i}.pt").write_bytes(os.urandom(20 * MiB))
    lost = "checkpoint_2099-01-01_00-00-00.000000"
    target = node3.path / name / lost
    proc = subprocess.Popen([sys.executable, "-c", KILLED_COPY, str(node3.path), name,
                             str(source), lost], stdout=subprocess.PIPE, text=True)
    try:
        # Chunk uploads are held back 2 s: the copy cannot be complete when a file shows.
        assert eventually(lambda: target.is_dir() and os.listdir(target), timeout=60)
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and "copied" not in out
    assert listed(node3.path / name) == names(kept)
    node3.stop()               # after the publishes of files closed before the kill
    assert eventually(lambda: names(recorded(node1.path / name)) == names(kept))
    for node in (node1, node2):
        assert listed(node.path / name) == names(kept)
    fresh = make_mount(store, name="node4", durability=durability)
    assert eventually(lambda: listed(fresh.path / name) == names(kept))
    assert (fresh.path / name / lost).is_dir()        # found by its exact name only
    proc = run_ckptfs("gc", str(node2.path), "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert f"removed staged tree /{name}/{lost}" in proc.stdout
    assert proc.stdout.count("removed staged tree") == 1
    last = make_mount(store, name="node5", durability=durability)
    assert not (last.path / name / lost).exists()
    for r in kept:
        assert file_digests(last.path / name / r["checkpoint_dir_name"]) == \
            r["metrics"]["files"]
