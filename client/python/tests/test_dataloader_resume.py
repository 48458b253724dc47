"""The documented path is the bit-exact path (issue 46 item 6): the data-loader snippet of
docs/python.md ("With a data loader"), a torchdata StatefulDataLoader in extra_state, killed
with SIGKILL mid-epoch and resumed, gives the uninterrupted run's batch and loss at every
step across the next epoch boundaries, with and without a generator of the loader's own.
(The iterator a resumed run makes used to draw its base seed once more than the run it
continues: from the global RNG that load() restored, or from the loader's generator.)

Real ckptd, real PyTorch 2 and torchdata (the virtual environment's; run_pytest.sh leaves this
file out on Debian's 1.13, which has no torchdata).
"""
import os
import subprocess
import sys

import pytest

from conftest import PYTHONPATH, kill_after_commit

WORKER = "client/python/tests/dataloader_worker.py"
STEPS = 14  # 10 samples in batches of 4: epochs of 3 steps


def run(daemon, job, *options):
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, CKPTD_SOCKET=daemon.socket)
    return subprocess.Popen([sys.executable, WORKER, "--job", job, "--steps", str(STEPS), "--every", "5", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def steps(out):
    """{step: "batch [...] loss HEX"} from the worker's output."""
    return {int(line.split()[1]): line.split(" ", 2)[2] for line in out.splitlines() if line.startswith("step ")}


def finish(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return steps(out)


@pytest.mark.parametrize("options", [[], ["--generator"]], ids=["global-rng", "generator"])
def test_the_documented_snippet_resumes_mid_epoch_bit_exactly(daemon, options):
    whole = finish(run(daemon, "whole", *options))
    assert sorted(whole) == list(range(1, STEPS + 1))
    # Saving every 5 steps, killed after step 7 once step 5 is committed: the second run
    # starts at step 6, the last batch of the second epoch.
    first = run(daemon, "killed", "--delay", "0.2", *options)
    kill_after_commit(daemon, "killed", first, 7)
    first.stderr.close()
    assert daemon.steps("killed") == [5]
    resumed = finish(run(daemon, "killed", *options))
    assert sorted(resumed) == list(range(6, STEPS + 1))  # three epoch boundaries after the resume
    assert resumed == {s: whole[s] for s in resumed}
