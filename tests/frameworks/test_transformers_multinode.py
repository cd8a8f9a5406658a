"""The HF Trainer on two "nodes" (two processes, gloo, each saving through its own mount of
one store), resumed on a third mount (issue 15).  Rank 1's node is slowed down (its
entry PUTs are delayed) so rank 0's trainer_state.json closes while rank 1 still writes
rng_state_1.pth: a third node must never list a checkpoint without rank 1's file."""

from __future__ import annotations

import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch.multiprocessing as mp  # noqa: E402

from support.mounts import eventually  # noqa: E402
from support.ranks import rendezvous  # noqa: E402

REQUIRED = ("trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "model.safetensors")


def worker(rank: int, world: int, init: str, outs: list[str], max_steps: int, resume: bool,
           errors) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        # The group is made here, at a file: accelerate uses it instead of binding
        # MASTER_PORT itself.
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        from test_transformers import TinyDataset, tiny_model
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(output_dir=outs[rank], max_steps=max_steps, save_steps=2,
                                 per_device_train_batch_size=4, learning_rate=1e-3,
                                 report_to=[], use_cpu=True, ddp_backend="gloo",
                                 logging_steps=1, save_strategy="steps", seed=0,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=tiny_model(), args=args, train_dataset=TinyDataset())
        trainer.train(resume_from_checkpoint=True if resume else None)
        assert trainer.state.global_step == max_steps
    except BaseException as exc:  # reported to the parent
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def run(outs: list, max_steps: int, resume: bool = False) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    mp.start_processes(worker, args=(2, rendezvous(), [str(o) for o in outs], max_steps, resume,
                                     errors), nprocs=2, start_method="spawn", join=True)
    assert errors.empty()


def test_trainer_two_nodes_resumed_on_a_third(store, make_mount):
    # HF has no barrier between rank 1's rng_state_1.pth and rank 0's trainer_state.json:
    # with a real model rank 0's save takes long enough that rank 1 has opened its file
    # (taken its lease) before the seal LISTs the leases; with this tiny model the two are
    # ~70 ms apart, a race the seal cannot win by design (decision 0004, "a writer that had
    # not opened its file when the seal LISTed is not protected").  Node a's lease LISTs
    # are delayed 1 s to keep the realistic order, so the test checks what is promised:
    # a seal never completes past a writer that had opened.
    a = make_mount(store, name="a", faults={"rules": [
        {"op": "list", "prefix": "leases/", "kind": "delay", "delay": 1.0}]})
    b = make_mount(store, name="b", faults={"rules": [
        {"op": op, "prefix": "dirs/", "kind": "delay", "delay": 1.0}
        for op in ("put", "put_if_absent")]})
    c = make_mount(store, name="c")
    (a.path / "run").mkdir()
    assert eventually((b.path / "run").is_dir)
    torn: list[tuple[str, list[str]]] = []
    stop = threading.Event()

    def watch() -> None:
        # What a job restarted on node C would see at any moment.
        while not stop.is_set():
            try:
                for name in os.listdir(c.path / "run"):
                    if name.startswith("checkpoint-"):
                        files = os.listdir(c.path / "run" / name)
                        if not all(f in files for f in REQUIRED):
                            torn.append((name, sorted(files)))
            except FileNotFoundError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run([a.path / "run", b.path / "run"], max_steps=4)
        assert eventually(lambda: sorted(n for n in os.listdir(c.path / "run")
                                         if n.startswith("checkpoint-"))
                          == ["checkpoint-2", "checkpoint-4"], timeout=60)
    finally:
        stop.set()
        watcher.join(10)
    assert torn == []
    for name in ("checkpoint-2", "checkpoint-4"):
        files = os.listdir(c.path / "run" / name)
        assert all(f in files for f in REQUIRED), (name, files)
    # Both ranks resume on node C from checkpoint-4 (each reads its own rng state).
    run([c.path / "run", c.path / "run"], max_steps=6, resume=True)
    assert "checkpoint-6" in os.listdir(c.path / "run")
