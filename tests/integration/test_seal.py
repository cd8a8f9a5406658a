"""Promise 4 and 7: checkpoint directories are staged (unlisted everywhere) until sealed,
never leaked torn; many nodes share one namespace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import get_context


from support.mounts import eventually, run_ckptfs

MiB = 1 << 20



HF_WRITER = r"""
import os, sys, json
out, step, stop_before_state = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
ckpt = os.path.join(out, f"checkpoint-{step}")
os.makedirs(ckpt, exist_ok=True)
for name in ("model.safetensors", "optimizer.pt"):
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write((name * 1000).encode() + str(step).encode())
if stop_before_state:
    print("saved-weights", flush=True)
    sys.stdin.readline()
with open(os.path.join(ckpt, "trainer_state.json"), "w") as f:
    json.dump({"global_step": step}, f)
print("done", flush=True)
"""


def hf_save(out, step, kill_before_state=False):
    proc = subprocess.Popen([sys.executable, "-c", HF_WRITER, str(out), str(step),
                             "1" if kill_before_state else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if kill_before_state:
        assert proc.stdout.readline().strip() == "saved-weights"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    else:
        assert proc.communicate(timeout=60)[0].strip() == "done"


def checkpoints(path):
    return sorted(n for n in os.listdir(path) if n.startswith("checkpoint-"))


def test_hf_style_crash_leaves_nothing_listed(store, make_mount):
    mnt = make_mount(store)
    out = mnt.path / "output"
    out.mkdir()
    hf_save(out, 2)
    assert checkpoints(out) == ["checkpoint-2"]
    hf_save(out, 4, kill_before_state=True)
    # Same live mount: not listed (get_last_checkpoint would pick it), but lookup works.
    assert checkpoints(out) == ["checkpoint-2"]
    assert (out / "checkpoint-4").is_dir()
    assert "model.safetensors" in os.listdir(out / "checkpoint-4")
    fresh = make_mount(store, name="fresh")
    assert checkpoints(fresh.path / "output") == ["checkpoint-2"]
    assert (fresh.path / "output" / "checkpoint-4").is_dir()
    # A second writer saves checkpoint-4 fully: it appears, complete, everywhere.
    hf_save(out, 4)
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    other = make_mount(store, name="other")
    assert checkpoints(other.path / "output") == ["checkpoint-2", "checkpoint-4"]
    assert sorted(os.listdir(other.path / "output" / "checkpoint-4")) == \
        ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    state = json.loads((other.path / "output" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state == {"global_step": 4}


def test_deepspeed_style_two_writer_nodes_third_reads(s3_store, make_mount):
    a, b, c = (make_mount(s3_store, name=n) for n in "abc")
    (a.path / "run").mkdir()
    shards = {}
    for rank, node in enumerate((a, b)):
        d = eventually(lambda: (node.path / "run").is_dir() and node.path / "run")
        tag = d / "global_step10"
        os.makedirs(tag, exist_ok=True)
        shards[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = os.urandom(MiB + rank)
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        (tag / name).write_bytes(shards[name])
    time.sleep(1.2)  # past the metadata TTL: the staged tag is still unlisted everywhere
    for node in (a, b, c):
        assert os.listdir(node.path / "run") == []
    (a.path / "run" / "latest").write_text("global_step10")
    assert eventually(lambda: sorted(os.listdir(c.path / "run")) == ["global_step10", "latest"])
    assert sorted(os.listdir(c.path / "run" / "global_step10")) == sorted(shards)
    for name, data in shards.items():
        assert (c.path / "run" / "global_step10" / name).read_bytes() == data


def _makedirs_and_write(root, label):
    path = os.path.join(root, "shared", "ckpt", "deep")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"from-{label}"), "w") as f:
        f.write(label)


def test_concurrent_makedirs_on_three_daemons(s3_store, make_mount):
    nodes = [make_mount(s3_store, name=n) for n in ("n0", "n1", "n2")]
    ctx = get_context("spawn")
    procs = [ctx.Process(target=_makedirs_and_write, args=(str(node.path), f"{i}-{j}"))
             for i, node in enumerate(nodes) for j in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    expected = sorted(f"from-{i}-{j}" for i in range(3) for j in range(2))
    for node in nodes:
        assert eventually(lambda: sorted(os.listdir(node.path / "shared" / "ckpt" / "deep"))
                          == expected)
        assert os.listdir(node.path / "shared") == ["ckpt"]


def test_megatron_pointer_and_orbax_rename_and_fsync_and_commit(local_store, make_mount):
    mnt = make_mount(local_store)
    root = mnt.path
    (root / "iter_0000100").mkdir()
    (root / "iter_0000100" / "model_optim_rng.pt").write_bytes(b"m")
    (root / "step.orbax-checkpoint-tmp").mkdir()
    (root / "step.orbax-checkpoint-tmp" / "data").write_bytes(b"o")
    (root / "checkpoint_7").mkdir()
    (root / "checkpoint-9").mkdir()
    assert os.listdir(root) == []
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    os.rename(root / "step.orbax-checkpoint-tmp", root / "step")
    fd = os.open(root / "checkpoint_7", os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    proc = run_ckptfs("commit", str(root / "checkpoint-9"))
    assert proc.returncode == 0, proc.stderr
    expected = ["checkpoint-9", "checkpoint_7", "iter_0000100",
                "latest_checkpointed_iteration.txt", "step"]
    assert sorted(os.listdir(root)) == expected
    assert sorted(os.listdir(make_mount(local_store, name="fresh").path)) == expected


def test_async_seal_waits_for_pending_uploads(store, make_mount, tmp_path):
    faults = {"rules": [{"op": "put", "prefix": "chunks/", "kind": "delay", "delay": 0.3}]}
    mnt = make_mount(store, durability="async", faults=faults)
    files = {f"shard-{i}": os.urandom(2 * MiB + i) for i in range(5)}
    ckpt = mnt.path / "checkpoint-1"
    ckpt.mkdir()
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
    (ckpt / "trainer_state.json").write_text("{}")
    reader = make_mount(store, name="reader")
    seen_complete = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if "checkpoint-1" in os.listdir(reader.path):
            names = sorted(os.listdir(reader.path / "checkpoint-1"))
            assert names == sorted([*files, "trainer_state.json"]), names
            for name, data in files.items():
                assert (reader.path / "checkpoint-1" / name).read_bytes() == data
            seen_complete = True
            break
        time.sleep(0.2)
    assert seen_complete


def test_gc_removes_old_staged_trees_and_unreferenced_chunks(local_store, make_mount):
    mnt = make_mount(local_store, extra=("--gc-settle", "0.3"))
    (mnt.path / "checkpoint-1").mkdir()
    (mnt.path / "checkpoint-1" / "w").write_bytes(os.urandom(MiB))
    (mnt.path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    (mnt.path / "checkpoint-2").mkdir()          # a crashed save: staged forever
    (mnt.path / "checkpoint-2" / "w").write_bytes(os.urandom(MiB))
    chunks_before = len(list((local_store.root / "chunks").glob("*/*")))
    proc = run_ckptfs("gc", str(mnt.path), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint-2" not in proc.stdout          # younger than the 24 h grace
    proc = run_ckptfs("gc", str(mnt.path), "--dry-run", "--grace", "0")
    assert "would remove staged tree /checkpoint-2" in proc.stdout
    assert len(list((local_store.root / "chunks").glob("*/*"))) == chunks_before
    proc = run_ckptfs("gc", str(mnt.path), "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert "removed staged tree /checkpoint-2" in proc.stdout
    # Its chunk is condemned by this pass and deleted by the next (decision 0003).
    assert len(list((local_store.root / "chunks").glob("*/*"))) == chunks_before
    time.sleep(1.2)
    proc = run_ckptfs("gc", str(mnt.path), "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert len(list((local_store.root / "chunks").glob("*/*"))) == chunks_before - 1
    fresh = make_mount(local_store, name="fresh")
    assert os.listdir(fresh.path) == ["checkpoint-1"]
    assert not (fresh.path / "checkpoint-2").exists()
    assert len((fresh.path / "checkpoint-1" / "w").read_bytes()) == MiB


def test_daemon_killed_between_rename_steps_finishes_on_restart(local_store, make_mount):
    mnt = make_mount(local_store, faults={"rules": [
        {"op": "delete", "prefix": "dirs/root/tmp", "kind": "delay", "delay": 120}]})
    (mnt.path / "tmp-ckpt").mkdir()
    (mnt.path / "tmp-ckpt" / "w").write_bytes(b"weights")
    errors = []

    def do_rename():
        try:
            os.rename(mnt.path / "tmp-ckpt", mnt.path / "ckpt")
        except OSError as exc:
            errors.append(exc)

    t = threading.Thread(target=do_rename, daemon=True)
    t.start()
    entries = local_store.root / "dirs" / "root"
    assert eventually(lambda: (entries / "ckpt").exists())
    assert (entries / "tmp-ckpt").exists()          # both names, never neither
    mnt.kill()
    t.join(30)
    mnt.start()                                      # same state dir, healthy store
    assert eventually(lambda: not (entries / "tmp-ckpt").exists())
    assert sorted(p.name for p in entries.iterdir()) == ["ckpt"]
    fresh = make_mount(local_store, name="fresh")
    assert os.listdir(fresh.path) == ["ckpt"]
    assert (fresh.path / "ckpt" / "w").read_bytes() == b"weights"


def test_mark_renamed_into_place_seals(store, make_mount):
    """DCP writes .metadata.tmp and renames it to .metadata."""
    mnt = make_mount(store)
    ckpt = mnt.path / "checkpoint_3"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"shard")
    (ckpt / ".metadata.tmp").write_bytes(b"meta")
    assert os.listdir(mnt.path) == []
    os.rename(ckpt / ".metadata.tmp", ckpt / ".metadata")
    assert os.listdir(mnt.path) == ["checkpoint_3"]
    fresh = make_mount(store, name="fresh")
    assert sorted(os.listdir(fresh.path / "checkpoint_3")) == [".metadata", "__0_0.distcp"]
