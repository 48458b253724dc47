"""Trains a tiny LightningModule with Lightning's own loop, checkpointing through ckptd
(ckptd.lightning.CkptdCheckpointIO under ModelCheckpoint); for test_lightning.py.

Prints "step N loss L" per training step (L as a float hex string, to compare runs bit for
bit), "resumed from step N" after a resume, and "weights H" at the end (a SHA-256 of every
parameter and optimizer tensor). Dropout draws from the global RNG; the data order from the
loader's own generator, and the loader is resumable (state_dict/load_state_dict), so that
Lightning resumes it mid-epoch.
"""
import argparse
import hashlib
import logging
import os
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckptd.lightning import CkptdCheckpointIO


class Batches:
    """A resumable loader of `batches` batches per epoch: Lightning saves its state_dict in
    the checkpoint's loop state and restores it, mid-epoch included."""

    def __init__(self, batches=6, size=8, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(batches * size, 8, generator=generator)
        self.y = self.x @ torch.randn(8, 1, generator=generator) + 0.1
        self.batches, self.size = batches, size
        self.epoch = self.position = 0

    def __len__(self):
        return self.batches

    def __iter__(self):
        if self.position >= self.batches:  # the last epoch ended: the next one begins
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(1000 + self.epoch))
        while self.position < self.batches:
            picked = order[self.position * self.size:(self.position + 1) * self.size]
            self.position += 1
            yield self.x[picked], self.y[picked]

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]


class Regression(pl.LightningModule):
    def __init__(self, delay):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))
        self.delay = delay

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        print(f"step {self.global_step + 1} loss {loss.item().hex()}", flush=True)
        time.sleep(self.delay)  # gives the test time to kill it mid-run
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def digest(module, optimizer):
    h = hashlib.sha256()
    tensors = list(module.state_dict().values())
    for state in optimizer.state.values():
        tensors += [v for _, v in sorted(state.items()) if torch.is_tensor(v)]
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    h.update(repr(optimizer.param_groups[0]["lr"]).encode())
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--dir", required=True, help="ModelCheckpoint's dirpath")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--ckpt-path", default=None, help="trainer.fit(ckpt_path=...): 'last' or a path")
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    pl.seed_everything(0, verbose=False)
    model = Regression(args.delay)
    io_plugin = CkptdCheckpointIO(job=args.job, socket=args.socket)
    checkpoints = ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_top_k=-1,
                                  save_last=True)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, plugins=[io_plugin], callbacks=[checkpoints],
                         default_root_dir=args.dir)
    trainer.fit(model, train_dataloaders=Batches(), ckpt_path=args.ckpt_path)
    if io_plugin.restored is not None:
        print(f"resumed from step {io_plugin.restored['step']} ({io_plugin.restored['source']})", flush=True)
    print(f"weights {digest(model, trainer.optimizers[0])}", flush=True)
    print(f"files {' '.join(sorted(os.listdir(args.dir)))}", flush=True)


if __name__ == "__main__":
    main()
