"""Trains a tiny GPT-2 with transformers.Trainer, checkpointing through ckptd
(ckptd.transformers.CkptdCallback); for test_hf_trainer.py.

Prints "step N loss L" per training step (L as a float hex string, to compare runs bit for
bit), "resumed from step N (SOURCE)" after a resume, and "weights H" at the end (a SHA-256
of every parameter, the optimizer state and the learning rate). GPT-2's dropout draws from
the global RNG and the Trainer shuffles the data, so a resume is exact only when the model,
optimizer, scheduler, RNG and the data position all come back.
"""
import argparse
import logging
import os
import time
import warnings

import torch
import transformers

from training_digest import digest
from ckptd.transformers import CkptdCallback


class Printer(transformers.TrainerCallback):
    """Prints each step's loss exactly (the Trainer's logs round it)."""

    def __init__(self, model, delay):
        self.step = 0
        self.delay = delay
        model.register_forward_hook(self.print_loss)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.delay)  # gives the test time to kill it mid-run

    def print_loss(self, module, inputs, output):
        if module.training:
            print(f"step {self.step} loss {output.loss.item().hex()}", flush=True)


def dataset(samples=40, length=12, vocab=64):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (samples, length), generator=generator)
    return [{"input_ids": t, "labels": t} for t in tokens]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--dir", required=True, help="TrainingArguments.output_dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true", help="resume_from_checkpoint=callback.resume_from(trainer)")
    parser.add_argument("--resume-step", type=int, default=None)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.getLogger("ckptd").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", category=FutureWarning)

    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(
        output_dir=args.dir, per_device_train_batch_size=4, max_steps=args.steps, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=3, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    callback = CkptdCallback(args.job, save_steps=args.every, socket=args.socket)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=dataset(),
                                   callbacks=[callback, Printer(model, args.delay)])
    resume = callback.resume_from(trainer, step=args.resume_step) if args.resume else None
    if resume is not None:
        print(f"resumed from step {int(callback.restored)} ({callback.restored.source})", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    print(f"after train {callback.restored!r}", flush=True)  # what it resumed from, still
    print(f"weights {digest(model, trainer.optimizer)}", flush=True)
    print(f"resume folder {'left' if resume and os.path.exists(resume) else 'gone'}", flush=True)


if __name__ == "__main__":
    main()
