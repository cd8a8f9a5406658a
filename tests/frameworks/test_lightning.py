"""Lightning ModelCheckpoint (top-k and last) into the mount, and resume with
ckpt_path="last" from a fresh mount."""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def fit(ckpt_dir, epochs, ckpt_path=None):
    torch.manual_seed(0)
    callback = ModelCheckpoint(dirpath=str(ckpt_dir), monitor="train_loss", save_top_k=2,
                               save_last=True, filename="{epoch}-{train_loss:.4f}")
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback], default_root_dir=str(ckpt_dir))
    model = Tiny()
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer, model, callback


def test_lightning_top_k_last_and_resume(mnt, make_mount):
    ckpt_dir = mnt.path / "ckpts"
    trainer, model, callback = fit(ckpt_dir, epochs=4)
    names = sorted(os.listdir(ckpt_dir))
    assert "last.ckpt" in names
    assert len([n for n in names if n.startswith("epoch=")]) == 2   # top-k rotation
    assert trainer.global_step == 16
    fresh = make_mount(mnt.store, name="fresh")
    assert sorted(os.listdir(fresh.path / "ckpts")) == names
    saved = torch.load(fresh.path / "ckpts" / "last.ckpt", weights_only=False)
    for k, v in model.state_dict().items():
        assert torch.equal(saved["state_dict"][k], v), k
    trainer2, _, _ = fit(fresh.path / "ckpts", epochs=6, ckpt_path="last")
    assert trainer2.global_step == 24
    assert trainer2.current_epoch == 6
