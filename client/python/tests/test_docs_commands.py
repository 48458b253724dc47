"""The command blocks of README.md and docs/operators.md run as written (issue 22 item 7),
with only their paths moved into a temporary directory: what an operator copies works, and
cannot drift from the code. A block that cannot run on a test machine is listed below with
the reason and the test that covers what it does; a new block that is neither run nor
listed fails this test.
"""
import os
import re
import subprocess
import tempfile
import time

import pytest

from conftest import CKPTCTL, CKPTD

EXAMPLE_TRAINER = os.environ.get("EXAMPLE_TRAINER_BIN") or next(
    (p for p in ("client/example_trainer", "bazel-bin/client/example_trainer") if os.path.exists(p)),
    "client/example_trainer")

# The start of each block that is not run here, and why (the same thing is tested elsewhere).
NOT_RUN = {
    ("README.md", "tools/demo.sh"): "the two commands themselves: demo.sh builds with Bazel, test.sh is this suite",
    ("docs/operators.md", "echo 20800 > /proc/sys/vm/nr_hugepages"):
        "reserves the host's huge-page pool (root, the whole machine); tools/test.sh reserves one for the suite",
    ("docs/operators.md", "sudo useradd"):
        "installs a system service: systemd_unit_test runs ckptd under the unit's restrictions",
    ("docs/operators.md", "tools/packages.sh && tools/image.sh"):
        "builds the image as root and pushes it to a registry: tests/packaging/image_test.sh builds, loads and runs it",
    ("docs/operators.md", "sudo systemctl edit ckptd"):
        "edits an installed service's drop-in: systemd_unit_test starts ckptd with the root read-only (the message "
        "names this drop-in) and with it writable, as the drop-in makes it",
    ("docs/operators.md", "kubectl kustomize deploy/kubernetes/overlays/example"):
        "applying needs a cluster: test_kubernetes.py renders the overlay with kubectl kustomize and validates it",
}


def blocks(doc):
    text = open(doc).read()
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```sh\n(.*?)^```", text, re.S | re.M)]


def test_every_command_block_is_run_or_says_why_not():
    run = {("README.md", "bazel build //daemon:ckptd //client:ckptctl //client:example_trainer\nbazel-bin"),
           ("docs/operators.md", "bazel build //daemon:ckptd //client:ckptctl //client:example_trainer\nB="),
           ("docs/operators.md", "export AWS_ACCESS_KEY_ID"),
           ("docs/operators.md", "ckptctl list   --root s3://")}
    for doc in ("README.md", "docs/operators.md"):
        for line, block in blocks(doc):
            known = [k for k in NOT_RUN if k[0] == doc and block.startswith(k[1])]
            known += [k for k in run if k[0] == doc and block.startswith(k[1])]
            assert known, f"{doc}:{line}: a command block no test runs (run it here, or say why not in NOT_RUN)"


def binaries(tmp):
    """A bazel-bin look-alike holding the binaries this test was given."""
    bin_dir = os.path.join(tmp, "bazel-bin")
    for rel, path in (("daemon/ckptd", CKPTD), ("client/ckptctl", CKPTCTL), ("client/example_trainer", EXAMPLE_TRAINER)):
        os.makedirs(os.path.join(bin_dir, os.path.dirname(rel)), exist_ok=True)
        os.symlink(os.path.abspath(path), os.path.join(bin_dir, rel))
    return bin_dir


def run(script, cwd, timeout=300):
    # TMPDIR: the walk-through's `mktemp -d` (three nodes' roots, 276 MB) goes under the
    # test's directory, removed with it, not into /tmp for good.
    r = subprocess.run(["bash", "-euc", script], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, TMPDIR=cwd))
    return r.returncode, r.stdout + r.stderr


def test_the_readme_example(workdir):
    (_, block), = [b for b in blocks("README.md") if b[1].startswith("bazel build")]
    script = "\n".join(line for line in block.splitlines() if not line.startswith("bazel build"))
    script = re.sub(r"/tmp/ckpt\b(?!d)", f"{workdir}/ckpt", script.replace("/tmp/ckptd.sock", f"{workdir}/ckptd.sock"))
    binaries(workdir)
    rc, out = run(script + "\nkill %1; wait %1 || true\n", workdir)
    assert rc == 0, out
    assert re.search(r"resumed step=\d+ source=memory", out), out  # from ckptd's memory, not the disk
    assert "step 100 of job demo: OK" in out, out
    assert "demo" in out and "KIND" in out, out  # status and list ran


# The walk-through starts three daemons and six trainers at once: run it again and again
# (issue 47: it once failed 1 run of 2; its fix passed 10 of 10), 3 times in CI (15 s each)
# and once on Debian's PyTorch 1.13 run, which repeats the same binaries; a hunt for a flake
# runs more: CKPTD_WALKTHROUGH_RUNS=20 (docs/building.md).
WALKTHROUGH_RUNS = int(os.environ.get("CKPTD_WALKTHROUGH_RUNS", "3"))


@pytest.mark.parametrize("attempt", range(WALKTHROUGH_RUNS))
def test_the_operators_walk_through_of_three_daemons(workdir, attempt):
    (_, block), = [b for b in blocks("docs/operators.md") if b[1].startswith("bazel build")]
    script = "\n".join(line for line in block.splitlines() if not line.startswith("bazel build"))
    script = script.replace("B=$PWD/bazel-bin", f"B={binaries(workdir)}")
    # Then: every trainer's step 200 committed across the three nodes, and everything stopped.
    script += """
until [ "$(grep -l 'committed step=200' $D/t*.log 2>/dev/null | wc -l)" = 6 ]; do sleep 0.5; done
ls $D/n1/demo/step-00000200
kill $(jobs -p); wait || true
"""
    rc, out = run(script, workdir, timeout=240)
    assert rc == 0, out
    assert out.count("alive") >= 3 and "joined" in out, out  # ckptctl status on node 2
    # Each rank's file, named with its run as increments (the default) name them.
    assert re.search(r"rank-00002\.[0-9a-f]{16}\.safetensors", out), out
    assert re.search(r"rank-00003\.[0-9a-f]{16}\.safetensors", out), out


def test_the_object_store_blocks_against_a_real_gateway(workdir):
    """operators.md's remote tier as written, against a Ceph RGW (tools/ceph.sh) standing in
    for AWS: its keys and endpoint in place of the placeholders. ckptd uploads a step of job
    llm, and ckptctl lists, verifies and exports it from the bucket with no daemon."""
    ceph = os.path.join(workdir, "ceph")
    script = os.path.join(os.getcwd(), "tools", "ceph.sh")
    started = subprocess.run([script, "start", ceph], capture_output=True, text=True)
    assert started.returncode == 0, started.stdout + started.stderr
    env = dict(line.strip().split("=", 1) for line in open(os.path.join(ceph, "s3.env")) if "=" in line)
    bucket = f"s3://{env['CKPTD_TEST_BUCKET']}/docs"
    bin_dir = binaries(workdir)
    sock = os.path.join(workdir, "ckptd.sock")
    (_, serve), = [b for b in blocks("docs/operators.md") if b[1].startswith("export AWS_ACCESS_KEY_ID")]
    (_, read), = [b for b in blocks("docs/operators.md") if b[1].startswith("ckptctl list   --root s3://")]

    def placed(block):
        return (block.replace("AWS_ACCESS_KEY_ID=...", f"AWS_ACCESS_KEY_ID={env['AWS_ACCESS_KEY_ID']}")
                .replace("AWS_SECRET_ACCESS_KEY=...", f"AWS_SECRET_ACCESS_KEY={env['AWS_SECRET_ACCESS_KEY']}")
                .replace("https://rgw.example.org", env["AWS_ENDPOINT_URL_S3"])
                .replace("s3://my-bucket/ckpt", bucket)
                .replace("ckptd --root /var/lib/ckptd", f"{bin_dir}/daemon/ckptd --socket {sock} --root {workdir}/root "
                         "--staging-bytes 256M --prefault-staging false")
                .replace("ckptctl ", f"{bin_dir}/client/ckptctl ")
                .replace("./llm-hf", f"{workdir}/llm-hf"))

    daemon = subprocess.Popen(["bash", "-euc", placed(serve)], cwd=workdir, stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(workdir, "ckptd.log"), "w"))
    try:
        health = [f"{bin_dir}/client/ckptctl", "--socket", sock, "health"]
        for _ in range(200):
            if subprocess.run(health, capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        trained = subprocess.run([f"{bin_dir}/client/example_trainer", "--socket", sock, "--job", "llm", "--steps",
                                  "1200", "--save-every", "1200", "--state-bytes", "4000000"],
                                 capture_output=True, text=True, timeout=120)
        assert trained.returncode == 0, trained.stdout + trained.stderr
        listed = ""
        for _ in range(300):  # uploaded behind the commit
            listed = subprocess.run([f"{bin_dir}/client/ckptctl", "--job", "llm", "list", "--root", bucket],
                                    capture_output=True, text=True, env={**os.environ, **env}).stdout
            if "1200" in listed:
                break
            time.sleep(0.2)
        assert "1200" in listed, listed + open(os.path.join(workdir, "ckptd.log")).read()
        rc = subprocess.run(["bash", "-euc", placed(read)], cwd=workdir, capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=120)
        assert rc.returncode == 0, rc.stdout + rc.stderr
        assert "step 1200 of job llm: OK" in rc.stdout, rc.stdout
        exported = os.listdir(os.path.join(workdir, "llm-hf"))
        assert any(name.endswith(".safetensors") for name in exported), (exported, rc.stdout)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        subprocess.run([script, "stop", ceph], capture_output=True)

