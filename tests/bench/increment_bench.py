#!/usr/bin/env python3
"""What a checkpoint costs when little of the state changes (issue 48, item 6), against a full
ckptd checkpoint and DCP, measured in the same run on the same disk.

  1. the limit: this disk's write bandwidth, the bytes of one full checkpoint written by one
     thread and fsynced (what a full save must at least take);
  2. a LoRA-style fine-tune: a GPT-2-medium-shaped model (transformers.GPT2Config: 24 layers,
     1024 wide, vocabulary 50257; random weights, F32) whose base is frozen
     (requires_grad=False), rank-16 LoRA adapters on every block's c_attn (PEFT's default
     target for GPT-2) trained with AdamW, a save every 10 steps, --keep-last 2. Per
     checkpoint after the first: bytes written, the time the trainer waits (save() until
     staged), the time to durable (save() until committed), for
       ckptd --increments on (frozen base, references),
       ckptd --increments off (today's full checkpoints),
       DCP (dcp.save of the model's and optimizer's state dicts, a full checkpoint);
     then the time a fresh process loads the last step from disk after ckptd restarted
     (with increments, through references into the first step, retired by then; for ckptd
     this includes registering the model, which moves it into shared memory);
  3. a full fine-tune (every parameter trains, a smaller GPT-2 by default): increments on
     against off, where everything changes (the goal: at most 5% slower, no more bytes);
     two daemons side by side, each checkpoint saved to both in turn (the order swapped each
     time), since runs one after the other on a disk whose speed drifts by 10% do not tell
     5% apart; --full-only runs only this;
  4. a sparse embedding table (nn.Embedding(sparse=True), SparseAdam), 1% of its rows at
     random changed between checkpoints, in two shapes: an LLM's vocabulary (50257 x 1024,
     4 KiB rows) and a recommender's table (1M x 64, 256 B rows): bytes written and time to
     durable, increments on against off (ckptd cuts such tables in 1 KiB chunks, at least a row);
  5. with --bucket, the LoRA fine-tune again with ckptd's remote tier (--remote on a Ceph S3
     gateway this machine runs, tools/ceph.sh; an upload every step, --remote-keep-last 2):
     per checkpoint after the first, the bytes uploaded and the time from save() until the
     step is listed in the bucket; then the disk is lost, and a fresh ckptd on an empty root
     loads the last step from the bucket (with increments through the first step's files,
     retired there by then by held records).
A "step" of training here is AdamW on random gradients of the trainable parameters: the
forward pass costs the same with or without checkpoints and would only slow the run.
Prints a table, or one JSON object with --json; --quick runs a small model (CI).

  .venv/bin/python tests/bench/increment_bench.py --bin bazel-bin
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Daemon:
    def __init__(self, binary, root, extra, staging):
        self.root = root
        self.socket = root + ".sock"
        self.log_path = root + ".log"
        # As deployed: staging memory prefaulted at start (a copy into untouched pages runs
        # at a fraction of memory bandwidth).
        self.args = [binary, "--root", root, "--socket", self.socket, "--staging-bytes", staging,
                     "--keep-last", "2", *extra]
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.socket):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("ckptd did not start:\n" + open(self.log_path).read())
            time.sleep(0.02)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        if os.path.exists(self.socket):
            os.unlink(self.socket)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def step_bytes(root, job, step):
    """What a step wrote: its own files (references cost nothing here)."""
    return dir_bytes(os.path.join(root, job, f"step-{step:08d}"))


def bucket_bytes(client, bucket, prefix):
    """Object bytes under `prefix` of the bucket, by key."""
    sizes = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            sizes[o["Key"]] = o["Size"]
    return sizes


def bucket_steps(ckptctl, url, job):
    """Steps `ckptctl list` shows published in the bucket."""
    listed = subprocess.run([ckptctl, "--job", job, "list", "--root", url], capture_output=True, text=True)
    return {int(row[1]) for row in (line.split() for line in listed.stdout.splitlines()) if row and row[0] == job}


def disk_limit(work, nbytes, streams=2):
    """What a full save must at least take on this disk, written as ckptd writes it: O_DIRECT,
    64 MiB writes, fsynced, in as many streams as its I/O threads (--io-threads, 2): dd, best
    of two. GB/s and seconds."""
    per_stream = max(1, nbytes // streams >> 26)
    best = None
    for _ in range(2):
        t0 = time.monotonic()
        procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={os.path.join(work, f'limit{i}.bin')}", "bs=64M",
                                   f"count={per_stream}", "oflag=direct", "conv=fsync"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(streams)]
        for p in procs:
            if p.wait() != 0:
                raise SystemExit("dd failed measuring the disk")
        seconds = time.monotonic() - t0
        best = seconds if best is None else min(best, seconds)
        for i in range(streams):
            os.unlink(os.path.join(work, f"limit{i}.bin"))
    written = streams * per_stream << 26
    return written / best / 1e9, best


def gpt2(torch, quick, medium):
    import transformers
    torch.manual_seed(0)
    if quick:
        config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=5000, n_positions=128,
                                         bos_token_id=0, eos_token_id=0)
    elif medium:
        config = transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16)  # GPT-2 medium
    else:
        config = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12)  # GPT-2 small
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config)


def add_lora(torch, model, rank=16):
    """Rank-16 A and B beside every block's c_attn (as PEFT adds them; the forward pass is not
    run here, so they need not be wired into it). The base is frozen."""
    model.requires_grad_(False)
    adapters = []
    for block in model.transformer.h:
        attn = block.attn.c_attn  # Conv1D: weight [in, out]
        d_in, d_out = attn.weight.shape
        attn.lora_A = torch.nn.Parameter(torch.randn(d_in, rank) * 0.01)
        attn.lora_B = torch.nn.Parameter(torch.zeros(rank, d_out))
        adapters += [attn.lora_A, attn.lora_B]
    return adapters


def train(torch, params, optimizer):
    for p in params:
        if isinstance(optimizer, torch.optim.SparseAdam):
            # An embedding's sparse gradient: 1% of its rows, at random (a batch's lookups).
            rows = torch.randperm(p.shape[0])[:max(1, p.shape[0] // 100)]
            p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(len(rows), p.shape[1]) * 1e-3, p.shape,
                                             check_invariants=False)
        else:
            p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saves(torch, manager, params, optimizer, checkpoints, every):
    """Trains, saving every `every` steps: after each commit, (step, when save() was called,
    seconds until the trainer could go on, seconds until committed)."""
    for step in range(1, checkpoints * every + 1):
        train(torch, params, optimizer)
        if step % every:
            continue
        t0 = time.monotonic()
        manager.save(step)
        manager.wait_staged()
        waited = time.monotonic() - t0
        manager.wait(committed=True)
        yield step, t0, waited, time.monotonic() - t0


def timed_load(make, socket, last):
    """Seconds a fresh model and optimizer take to load() the newest step (which must be `last`)."""
    from ckptd.torch import CheckpointManager
    fresh, _, fresh_optimizer = make()
    t0 = time.monotonic()
    with CheckpointManager("bench", fresh, fresh_optimizer, socket=socket) as manager:
        restored = manager.load()
    seconds = time.monotonic() - t0
    assert restored == last, (restored, last)
    return seconds


def run_ckptd(a, torch, name, make, extra, checkpoints, every):
    """Trains and saves with ckptd; per checkpoint: bytes, waited, durable. Then restarts
    ckptd and times a fresh model's load() of the last step from disk."""
    from ckptd.torch import CheckpointManager
    root = os.path.join(a.work, name.replace(" ", "_"))
    daemon = Daemon(os.path.join(a.bin, "daemon/ckptd"), root, extra, a.staging)
    model, params, optimizer = make()
    rows = []
    try:
        with CheckpointManager("bench", model, optimizer, socket=daemon.socket) as manager:
            for step, _, waited, durable in saves(torch, manager, params, optimizer, checkpoints, every):
                rows.append({"step": step, "bytes": step_bytes(root, "bench", step), "waited_s": waited,
                             "durable_s": durable})
        del model, params, optimizer
        daemon.stop()
        daemon.start()
        restore_s = timed_load(make, daemon.socket, rows[-1]["step"])
        held = [d for d in os.listdir(os.path.join(root, "bench")) if ".held-" in d]
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"checkpoints": rows, "restore_s": restore_s, "held_steps": len(held)}


def run_dcp(a, torch, make, checkpoints, every):
    import torch.distributed.checkpoint as dcp
    root = os.path.join(a.work, "dcp")
    model, params, optimizer = make()
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process
        for step in range(1, checkpoints * every + 1):
            train(torch, params, optimizer)
            if step % every:
                continue
            path = os.path.join(root, f"step-{step}")
            t0 = time.monotonic()
            dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
            seconds = time.monotonic() - t0
            rows.append({"step": step, "bytes": dir_bytes(path), "waited_s": seconds, "durable_s": seconds})
            previous = os.path.join(root, f"step-{step - 2 * every}")
            shutil.rmtree(previous, ignore_errors=True)  # keep the last 2, as ckptd's --keep-last 2
        last = os.path.join(root, f"step-{rows[-1]['step']}")
        fresh, _, fresh_optimizer = make()
        state = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
        t0 = time.monotonic()
        dcp.load(state, checkpoint_id=last)
        restore_s = time.monotonic() - t0
    shutil.rmtree(root, ignore_errors=True)
    return {"checkpoints": rows, "restore_s": restore_s}


def run_bucket(a, torch, name, make, extra, checkpoints, every, s3):
    """The LoRA run with --remote: per checkpoint, bytes uploaded (every object the bucket
    gained, carried origin files included) and save() until the step is listed there. Then the
    local disk is lost and a fresh ckptd on an empty root loads the last step from the bucket."""
    from ckptd.torch import CheckpointManager
    client, bucket = s3["client"], s3["bucket"]
    prefix = name
    url = f"s3://{bucket}/{prefix}"
    ckptctl = os.path.join(a.bin, "client/ckptctl")
    root = os.path.join(a.work, prefix)
    daemon = Daemon(os.path.join(a.bin, "daemon/ckptd"), root,
                    ["--remote", url, "--upload-every-steps", "1", "--remote-keep-last", "2", *extra], a.staging)
    model, params, optimizer = make()
    rows = []
    try:
        before = bucket_bytes(client, bucket, prefix + "/")
        with CheckpointManager("bench", model, optimizer, socket=daemon.socket) as manager:
            for step, t0, waited, durable in saves(torch, manager, params, optimizer, checkpoints, every):
                while step not in bucket_steps(ckptctl, url, "bench"):
                    if time.monotonic() - t0 > 600:
                        raise SystemExit(f"step {step} never reached the bucket:\n" + open(daemon.log_path).read())
                    time.sleep(0.02)
                in_bucket = time.monotonic() - t0
                after = bucket_bytes(client, bucket, prefix + "/")
                uploaded = sum(size for key, size in after.items() if before.get(key) != size)
                before = after
                rows.append({"step": step, "bytes": uploaded, "durable_s": durable, "in_bucket_s": in_bucket,
                             "waited_s": waited})
        del model, params, optimizer
        daemon.stop()
        shutil.rmtree(root)  # the disk is lost: only the bucket holds the job
        os.makedirs(root)
        daemon.start()
        restore_s = timed_load(make, daemon.socket, rows[-1]["step"])
        retired = len([k for k in bucket_bytes(client, bucket, prefix + "/") if "/held-" in k])
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"checkpoints": rows, "restore_s": restore_s, "held_records": retired}


def start_bucket(a):
    """A Ceph S3 gateway on this machine (tools/ceph.sh) and a client of its bucket."""
    import boto3
    from botocore.config import Config
    ceph = os.path.join(a.work, "ceph")
    subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "start", ceph], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=dict(os.environ, CKPTD_CEPH_MEMSTORE_BYTES=str(8 << 30)))
    env = dict(line.strip().split("=", 1) for line in open(os.path.join(ceph, "s3.env")) if "=" in line)
    os.environ.update(env)  # ckptd and ckptctl find the endpoint and keys there
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name=env["AWS_REGION"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                          config=Config(s3={"addressing_style": "path"}))
    return {"dir": ceph, "client": client, "bucket": env["CKPTD_TEST_BUCKET"]}


def median_of(rows, key):
    """The median of `key` over `rows` (the upper one of an even count)."""
    return sorted(r[key] for r in rows)[len(rows) // 2]


def summary(run):
    """Medians over the checkpoints after the first (whole in every case), and the slowest:
    with increments a session's second save is the one planned against a base it has not
    measured yet, which for a full fine-tune finds most changed (the saves after it stream)."""
    later = run["checkpoints"][1:] or run["checkpoints"]
    median = lambda key: median_of(later, key)  # noqa: E731
    out = {"first_bytes": run["checkpoints"][0]["bytes"], "bytes": median("bytes"), "waited_s": median("waited_s"),
           "durable_s": median("durable_s"), "slowest_durable_s": max(r["durable_s"] for r in later),
           "restore_s": run["restore_s"]}
    if "in_bucket_s" in later[0]:
        out["in_bucket_s"] = median("in_bucket_s")
        out["slowest_in_bucket_s"] = max(r["in_bucket_s"] for r in later)
        out["held_records"] = run["held_records"]
    return out


def full_paired(a, torch, make, inc, whole):
    """The full fine-tune saved to two daemons side by side, increments on and off, in one
    run: two models trained alike, each checkpoint saved to one daemon and committed, then to
    the other, the order swapped every checkpoint. Run against run, this disk's speed drifts
    by more than the 5% the goal is about; checkpoint against the next one, it does not, so
    the figure is the ratios of pairs (combined over the two orders, below). Per pair:
    seconds to durable on and off."""
    from ckptd.torch import CheckpointManager
    sides = {}
    try:
        for name, flags in (("on", inc), ("off", whole)):
            root = os.path.join(a.work, f"paired_{name}")
            model, params, optimizer = make()
            sides[name] = {"root": root, "daemon": Daemon(os.path.join(a.bin, "daemon/ckptd"), root, flags, a.staging),
                           "params": params, "optimizer": optimizer}
            sides[name]["manager"] = CheckpointManager("bench", model, optimizer, socket=sides[name]["daemon"].socket)
        pairs = []
        for step in range(1, a.checkpoints + 1):
            order = ("on", "off") if step % 2 else ("off", "on")
            for name in order:
                train(torch, sides[name]["params"], sides[name]["optimizer"])
            pair = {"step": step, "first": order[0]}
            for name in order:
                manager = sides[name]["manager"]
                t0 = time.monotonic()
                manager.save(step)
                manager.wait(committed=True)
                pair[name] = time.monotonic() - t0
                pair[name + "_bytes"] = step_bytes(sides[name]["root"], "bench", step)
            pairs.append(pair)
    finally:
        for side in sides.values():
            if "manager" in side:
                side["manager"].close()
            side["daemon"].stop()
            shutil.rmtree(side["root"], ignore_errors=True)
    # The first pair is whole on both sides; with increments the second is planned against a
    # base not measured yet (every piece hashed, then written), the later ones streamed.
    later = pairs[1:]
    # Whichever daemon saves second in a pair is slower here (by 5-35%: the disk has just
    # taken 1.5 GB), so the ratio is taken per order and the two combined (their geometric
    # mean), which cancels that as the order alternates.
    by_order = {first: median_of([{"r": p["on"] / p["off"]} for p in later if p["first"] == first], "r")
                for first in ("on", "off") if any(p["first"] == first for p in later)}
    ratio = 1.0
    for r in by_order.values():
        ratio *= r ** (1 / len(by_order))
    return {"pairs": pairs, "ratio_by_first": by_order, "ratio": ratio,
            "median_durable_s": {k: median_of(later, k) for k in ("on", "off")},
            "slower_in": sum(p["on"] > p["off"] for p in later)}


def print_paired(paired):
    later = paired["pairs"][1:]
    m, r = paired["median_durable_s"], paired["ratio_by_first"]
    print(f"full fine-tune, increments on against off, {len(later)} pairs of checkpoints after the first "
          f"(each saved to both daemons in turn, the order swapped each pair):")
    by_first = ", ".join(f"{100 * (ratio - 1):+.1f}% when {first} saves first" for first, ratio in r.items())
    print(f"  median durable {m['on']:.3f} s on, {m['off']:.3f} s off; on against off {by_first}: "
          f"{100 * (paired['ratio'] - 1):+.1f}% "
          f"(on slower in {paired['slower_in']} of {len(later)}); bytes {median_of(later, 'on_bytes') / 1e6:.1f} MB on, "
          f"{median_of(later, 'off_bytes') / 1e6:.1f} MB off")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "bazel-bin"), help="where Bazel put ckptd")
    ap.add_argument("--checkpoints", type=int, default=5, help="checkpoints per run")
    ap.add_argument("--every", type=int, default=10, help="LoRA: steps between checkpoints")
    ap.add_argument("--full-model", choices=["small", "medium"], default="small",
                    help="the full fine-tune's GPT-2 (medium: 4.3 GB a checkpoint with AdamW)")
    ap.add_argument("--staging", default="6G", help="ckptd --staging-bytes")
    ap.add_argument("--quick", action="store_true", help="a small model: CI")
    ap.add_argument("--bucket", action="store_true",
                    help="also the LoRA fine-tune with the remote tier on a Ceph S3 gateway started here")
    ap.add_argument("--bucket-only", action="store_true", help="only that (implies --bucket)")
    ap.add_argument("--sparse-only", action="store_true", help="only the sparse embedding tables")
    ap.add_argument("--full-only", action="store_true",
                    help="only the full fine-tune: --checkpoints pairs, increments on and off side by side")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.bucket = a.bucket or a.bucket_only
    sys.path.insert(0, os.path.join(a.bin, "client/python"))
    import torch
    torch.set_num_threads(1)
    a.work = tempfile.mkdtemp(prefix="increment-bench.", dir=os.environ.get("CKPTD_BENCH_DIR", "/tmp"))
    if a.quick:
        a.checkpoints, a.every, a.staging = 3, 2, "1G"
    inc = ["--increments", "on"]
    whole = ["--increments", "off"]  # today's full checkpoints (increments are ckptd's default)
    try:
        def lora():
            model = gpt2(torch, a.quick, medium=True)
            adapters = add_lora(torch, model)
            return model, adapters, torch.optim.AdamW(adapters, lr=1e-4)

        def full():
            model = gpt2(torch, a.quick, medium=a.full_model == "medium")
            params = list(model.parameters())
            return model, params, torch.optim.AdamW(params, lr=1e-4)

        def table(rows, dim):
            def make():
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Embedding(rows, dim, sparse=True))
                params = list(model.parameters())
                return model, params, torch.optim.SparseAdam(params, lr=1e-3)
            return make

        tables = {"vocabulary 50257 x 1024": table(5000 if a.quick else 50257, 1024),
                  "recommender 1M x 64": table(20000 if a.quick else 1_000_000, 64)}

        probe = full()[0] if a.full_only else lora()[0]
        # Each storage once: the tied lm_head is the embedding's.
        full_bytes = sum({t.data_ptr(): t.numel() * t.element_size() for t in probe.state_dict().values()}.values())
        del probe
        limit_gbps, _ = disk_limit(a.work, full_bytes)
        results = {"disk_limit_gbps": limit_gbps, ("full_model_bytes" if a.full_only else "lora_model_bytes"): full_bytes, "lora": {}}
        if a.full_only:
            results["paired"] = full_paired(a, torch, full, inc, whole)
        elif not a.bucket_only and not a.sparse_only:
            results["lora"]["ckptd, increments"] = summary(
                run_ckptd(a, torch, "lora inc", lora, inc, a.checkpoints, a.every))
            results["lora"]["ckptd, full"] = summary(run_ckptd(a, torch, "lora full", lora, whole, a.checkpoints, a.every))
            results["lora"]["DCP"] = summary(run_dcp(a, torch, lora, a.checkpoints, a.every))
            results["paired"] = full_paired(a, torch, full, inc, whole)
        results["sparse"] = {}
        if not a.bucket_only and not a.full_only:
            for shape, make in tables.items():
                results["sparse"][shape] = {
                    "ckptd, increments": summary(run_ckptd(a, torch, "sparse inc", make, inc, a.checkpoints, 1)),
                    "ckptd, full": summary(run_ckptd(a, torch, "sparse full", make, whole, a.checkpoints, 1))}
        if a.bucket:
            s3 = start_bucket(a)
            # Three checkpoints each: the OSD keeps objects in RAM (memstore), a full LoRA one 1.4 GB.
            n = min(a.checkpoints, 3)
            results["bucket"] = {}
            for name, flags in (("ckptd, increments", inc), ("ckptd, full", whole)):
                prefix = "bucket-inc" if flags is inc else "bucket-full"
                results["bucket"][name] = summary(run_bucket(a, torch, prefix, lora, flags, n, a.every, s3))
                for key in bucket_bytes(s3["client"], s3["bucket"], prefix + "/"):
                    s3["client"].delete_object(Bucket=s3["bucket"], Key=key)
    finally:
        if a.bucket:
            subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "stop", os.path.join(a.work, "ceph")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(a.work, ignore_errors=True)
    if a.json:
        print(json.dumps(results, indent=2))
        return
    if a.full_only:
        print(f"disk limit: {limit_gbps:.2f} GB/s (dd, 2 streams, O_DIRECT, fsync)")
        print_paired(results["paired"])
        return
    print(f"disk limit: {limit_gbps:.2f} GB/s (dd, 2 streams, O_DIRECT, fsync, {full_bytes / 1e9:.2f} GB: "
          f"{full_bytes / limit_gbps / 1e9:.2f} s for a full LoRA checkpoint)")
    for case, runs in (("LoRA fine-tune (frozen base)", results["lora"]),):
        if not runs:
            continue
        print(f"\n{case}: per checkpoint after the first (medians; the slowest durable beside)")
        print(f"  {'':20} {'first MB':>9} {'MB':>9} {'waited s':>9} {'durable s':>10} {'slowest s':>10} "
              f"{'load s':>8}")
        for name, r in runs.items():
            print(f"  {name:20} {r['first_bytes'] / 1e6:9.1f} {r['bytes'] / 1e6:9.2f} {r['waited_s']:9.3f} "
                  f"{r['durable_s']:10.3f} {r['slowest_durable_s']:10.3f} {r['restore_s']:8.2f}")
    if a.bucket_only:
        print_bucket(results)
        return
    if not a.sparse_only:
        lora_runs = results["lora"]
        inc_r, full_r = lora_runs["ckptd, increments"], lora_runs["ckptd, full"]
        print(f"\nLoRA: increments write {100 * inc_r['bytes'] / full_r['bytes']:.2f}% of a full checkpoint "
              f"and are durable {full_r['durable_s'] / inc_r['durable_s']:.1f}x sooner "
              f"({lora_runs['DCP']['durable_s'] / inc_r['durable_s']:.1f}x sooner than DCP)")
        print_bucket(results)
        print_paired(results["paired"])
    print("\nsparse embedding table, 1% of rows changed between checkpoints (table and SparseAdam's two moments; "
          "medians after the first)")
    print(f"  {'':26} {'full MB':>9} {'inc MB':>9} {'written':>8} {'full s':>8} {'inc s':>8}")
    for shape, runs in results["sparse"].items():
        s_inc, s_full = runs["ckptd, increments"], runs["ckptd, full"]
        print(f"  {shape:26} {s_full['bytes'] / 1e6:9.1f} {s_inc['bytes'] / 1e6:9.2f} "
              f"{100 * s_inc['bytes'] / s_full['bytes']:7.2f}% {s_full['durable_s']:8.3f} {s_inc['durable_s']:8.3f}")


def print_bucket(results):
    if "bucket" in results:
        print("\nLoRA fine-tune with --remote (Ceph RGW here): per checkpoint after the first (medians)")
        print(f"  {'':20} {'first MB':>9} {'up MB':>9} {'durable s':>10} {'in bucket s':>12} {'slowest s':>10} "
              f"{'load s':>8}")
        for name, r in results["bucket"].items():
            print(f"  {name:20} {r['first_bytes'] / 1e6:9.1f} {r['bytes'] / 1e6:9.2f} {r['durable_s']:10.3f} "
                  f"{r['in_bucket_s']:12.3f} {r['slowest_in_bucket_s']:10.3f} {r['restore_s']:8.2f}")
        b_inc, b_full = results["bucket"]["ckptd, increments"], results["bucket"]["ckptd, full"]
        print(f"bucket: increments upload {100 * b_inc['bytes'] / b_full['bytes']:.2f}% of a full checkpoint and are "
              f"in the bucket {b_full['in_bucket_s'] / b_inc['in_bucket_s']:.1f}x sooner; the lost disk's load "
              f"from the bucket took {b_inc['restore_s']:.2f} s ({b_inc['held_records']} held records there)")


if __name__ == "__main__":
    main()
