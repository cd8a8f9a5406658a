"""PyTorch Distributed Checkpoint from two processes (gloo): save, async_save and load
through the mount.  The checkpoint directory is named like a checkpoint, so it is staged
until DCP's own completion mark (.metadata) seals it."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from support.ranks import rendezvous


def state_for(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 100 + step)
    return {"model": {f"rank{rank}.w": torch.randn(256, 256, generator=g),
                      "shared.b": torch.arange(16, dtype=torch.float32) * step},
            "step": step}


def worker(rank: int, world: int, init: str, root: str, mode: str, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        if mode == "save":
            dcp.save(state_for(rank, 1), checkpoint_id=os.path.join(root, "checkpoint_1"))
            future = dcp.async_save(state_for(rank, 2),
                                    checkpoint_id=os.path.join(root, "checkpoint_2"))
            future.result()
        else:
            for step in (1, 2):
                target = {"model": {f"rank{rank}.w": torch.zeros(256, 256),
                                    "shared.b": torch.zeros(16)}, "step": 0}
                dcp.load(target, checkpoint_id=os.path.join(root, f"checkpoint_{step}"))
                want = state_for(rank, step)
                assert torch.equal(target["model"][f"rank{rank}.w"],
                                   want["model"][f"rank{rank}.w"])
                assert torch.equal(target["model"]["shared.b"], want["model"]["shared.b"])
                assert target["step"] == step
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def run(root, mode):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    mp.start_processes(worker, args=(2, rendezvous(), str(root), mode, errors), nprocs=2,
                       start_method="spawn", join=True)
    assert errors.empty()


def test_dcp_two_ranks_save_async_save_and_load(mnt, make_mount):
    root = mnt.path / "dcp"
    root.mkdir()
    run(root, "save")
    assert sorted(os.listdir(root)) == ["checkpoint_1", "checkpoint_2"]
    assert ".metadata" in os.listdir(root / "checkpoint_1")
    fresh = make_mount(mnt.store, name="fresh")
    assert sorted(os.listdir(fresh.path / "dcp")) == ["checkpoint_1", "checkpoint_2"]
    run(fresh.path / "dcp", "load")
