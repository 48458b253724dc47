"""Every ```python snippet of docs/python.md runs, in order, against a real ckptd: what the
guide shows a user is what works (issue 21 item 9).

The snippets share one namespace, as a user's script would, holding what they take as given:
`model` (a small GPT-2 from `transformers`, whose lm_head is tied), `optimizer`,
`lr_scheduler`, `train_step()`, `num_steps`. The paths they name are this test's: "/ckpt" is
the daemon's root, "/old-ckpt/step-1200" a DCP checkpoint made here. PyTorch 2 with
`transformers` (run_pytest.sh leaves this file out on Debian's 1.13).
"""
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
import transformers

from ckptd.torch import CheckpointManager

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


def test_every_python_snippet_in_the_guide_runs(daemon, workdir, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)  # the snippets use the default socket
    model, optimizer, lr_scheduler = gpt2()

    def train_step():
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
    old_dcp = os.path.join(workdir, "old-ckpt", "step-1200")
    dcp.save({"model": model.state_dict()}, checkpoint_id=old_dcp)
    paths = {'"/ckpt/': f'"{daemon.root}/', '"/old-ckpt/step-1200"': f'"{old_dcp}"'}

    namespace = {"model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
                 "train_step": train_step, "num_steps": 3, "CheckpointManager": CheckpointManager}
    found = snippets()
    assert len(found) >= 4
    for line, code in found:
        for old, new in paths.items():
            code = code.replace(old, new)
        try:
            exec(compile(code, f"{DOC}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the snippet at {DOC}:{line} fails: {type(e).__name__}: {e}\n{code}") from e
        if namespace.get("manager") is not None and not namespace["manager"]._closed:
            namespace["manager"].close()
    assert namespace["step"] == 40 and namespace["step"].source == "memory"
