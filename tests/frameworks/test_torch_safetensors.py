"""torch.save/torch.load (also mmap=True) and safetensors through a ckptfs mount, read
back on the same mount and on a fresh one (new node-local state)."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(1000, 64, generator=g),
            "layer.0.weight": torch.randn(64, 64, generator=g),
            "layer.0.bias": torch.randn(64, generator=g),
            "head.weight": torch.randn(10, 64, generator=g).to(torch.bfloat16),
            "step": torch.tensor(42)}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_torch_save_load_and_mmap(mnt, make_mount):
    state = tiny_state()
    path = mnt.path / "model.pt"
    torch.save(state, path)
    assert_same(torch.load(path, weights_only=True), state)
    fresh = make_mount(mnt.store, name="fresh")
    for p in (path, fresh.path / "model.pt"):
        assert_same(torch.load(p, weights_only=True, mmap=True), state)


def test_torch_save_overwrite_in_place(mnt, make_mount):
    path = mnt.path / "latest.pt"
    torch.save(tiny_state(1), path)
    torch.save(tiny_state(2), path)
    fresh = make_mount(mnt.store, name="fresh")
    assert_same(torch.load(fresh.path / "latest.pt", weights_only=True), tiny_state(2))


def test_safetensors_save_file_and_safe_open(mnt, make_mount):
    state = {k: v for k, v in tiny_state().items() if k != "step"}
    path = mnt.path / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    fresh = make_mount(mnt.store, name="fresh")
    for p in (path, fresh.path / "model.safetensors"):
        with safe_open(str(p), framework="pt") as f:
            assert set(f.keys()) == set(state)
            assert f.metadata() == {"format": "pt"}
            for k in state:
                assert torch.equal(f.get_tensor(k), state[k])
        assert_same(load_file(str(p)), state)
    assert os.listdir(fresh.path) == ["model.safetensors"]
