"""Every ```python snippet of docs/python.md runs, in order, against a real ckptd: what the
guide shows a user is what works (issue 21 item 9).

The snippets share one namespace, as a user's script would, holding what they take as given:
`model` (a small GPT-2 from `transformers`, whose lm_head is tied), `optimizer`,
`lr_scheduler`, `train_step()`, `num_steps`, `dataset`. The paths they name are this test's: "/ckpt" is
the daemon's root, "/old-ckpt/step-1200" a DCP checkpoint made here; the framework snippets
get a LightningModule and data module, or a GPT-2 and a dataset, and a few steps for their
100,000. PyTorch 2 with `transformers` and `lightning` (run_pytest.sh leaves this file out on
Debian's 1.13).
"""
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
import lightning.pytorch
import transformers

from ckptd.torch import CheckpointManager

import lightning_worker

DOC = "docs/python.md"
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def snippets():
    text = open(DOC).read()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)


class _Data(lightning.pytorch.LightningDataModule):
    def train_dataloader(self):
        return lightning_worker.Batches()


def _tokens():
    torch.manual_seed(3)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (16, 8))]


def test_every_python_snippet_in_the_guide_runs(daemon, workdir, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)  # the snippets use the default socket
    model, optimizer, lr_scheduler = gpt2()

    def train_step(batch=None):  # the data-loader snippet passes its batch
        tokens = torch.randint(0, 64, (2, 8))
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()

    # What the snippets find already there: a checkpoint of each job they load.
    train_step()
    for job, step in (("my-job", 40), ("llm", 1200)):
        with CheckpointManager(job, model, optimizer, lr_scheduler, socket=daemon.socket) as manager:
            manager.save(step, blocking=True)
    with CheckpointManager("gpt", model, socket=daemon.socket) as manager:
        manager.save_weights(1, dtype=torch.bfloat16)  # the job "gpt-weights"
    old_dcp = os.path.join(workdir, "old-ckpt", "step-1200")
    dcp.save({"model": model.state_dict()}, checkpoint_id=old_dcp)
    paths = {'"/ckpt/': f'"{daemon.root}/', '"/old-ckpt/step-1200"': f'"{old_dcp}"'}

    paths.update({'dirpath="ckpt/"': f'dirpath="{workdir}/ckpt/"',
                  'output_dir="out"': f'output_dir="{workdir}/out"',
                  "max_steps=100_000": "max_steps=4", "every_n_train_steps=500": "every_n_train_steps=2",
                  "save_steps=500": "save_steps=2"})

    namespace = {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
                 "train_step": train_step, "num_steps": 3, "CheckpointManager": CheckpointManager,
                 "dataset": list(range(10))}
    found = snippets()
    assert len(found) >= 6
    for line, code in found:
        for old, new in paths.items():
            code = code.replace(old, new)
        # The framework snippets take a model and data of their framework, in a scope of their own.
        scope = namespace
        if "lightning" in code:
            scope = dict(namespace, model=lightning_worker.Regression(0), data=_Data())
        elif "TrainingArguments" in code:
            scope = dict(namespace, model=gpt2()[0], train_dataset=_tokens())
        try:
            exec(compile(code, f"{DOC}:{line}", "exec"), scope)
        except Exception as e:
            raise AssertionError(f"the snippet at {DOC}:{line} fails: {type(e).__name__}: {e}\n{code}") from e
        if scope.get("manager") is not None and not scope["manager"]._closed:
            scope["manager"].close()
    assert namespace["step"] == 40 and namespace["step"].source == "memory"
