#!/usr/bin/env python3
"""The remote tier's speed against the store's own limit and against what users would
otherwise pick, measured in the same run.

Starts a single-node Ceph cluster with an S3 gateway (tools/ceph.sh), then
  1. the limit: curl (a C client, so the client's CPU is not what bounds it) PUTting and
     GETting the same bytes as objects of one part size, swept over part size and
     concurrency; boto3's transfer manager at its default settings beside it;
  2. ckptd --remote: ranks (tests/integration/trainer_helper) save one step, and the time
     from the uploader's start to the manifest written remotely (ckptd's [upload] log line);
  3. restore from the remote tier on a node with an empty disk: the ranks restore at once,
     and the time is the slowest rank's (ckptd's [control] log lines);
  4. a resharding restore from the remote tier (2 ranks saved, 3 restore): bytes fetched
     against the bytes the ranks need;
  5. a PyTorch training loop saving every few steps: its step time with no checkpoints,
     with ckptd (remote tier off and on) and with DCP's async_save through fsspec (s3fs)
     onto the same bucket; per save, the time the loop is blocked, and for the last save
     the time until it is durable in the bucket.
Prints a table, or one JSON object with --json. --quick runs small sizes (CI: the benchmark
is built and run, never left to rot).

  .venv/bin/python tests/bench/remote_bench.py --bin bazel-bin --bytes 1G --ranks 2
"""
import argparse
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# In the training loop, the trainer runs on CPU 0 and everything else (ckptd, Ceph) on the
# other CPUs, as a real node's trainer has its own cores and the store is another machine.
SERVICE_CPUS = None  # set in training_loop()
STAGING_BYTES = "2G"  # twice the checkpoint (main() sets it)


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class Null(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        return len(b)


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def settle(quick):
    """RGW's garbage collection frees deleted and overwritten objects' RAM (memstore)."""
    time.sleep(0 if quick else 20)


def s3_client(env):
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name=env["AWS_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        config=Config(s3={"addressing_style": "path"}))


def clear(env, bucket, prefix):
    """Deletes what a measurement wrote: a memstore OSD slows as it fills (an upload of 1 GiB
    measured 0.45 GB/s on an empty store and 0.29 GB/s after four more), so every measurement
    meets the store as empty as the one it is compared with."""
    client = s3_client(env)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=o["Key"])


def curl_sweep(env, bucket, payload, total, quick):
    """The store's limit: curl --parallel PUTting `total` bytes as objects of one part size
    (what a multipart upload's parts are), then GETting them, at each concurrency."""
    results = []
    for part in ([8 << 20, 16 << 20] if quick else [8 << 20, 16 << 20, 64 << 20]):
        with open(payload, "wb") as f:
            f.write(os.urandom(1 << 20) * (part >> 20))
        for concurrency in ([4, 8] if quick else [4, 8, 16]):
            results.append(curl_once(env, bucket, payload, part, concurrency, total))
            settle(quick)
    os.unlink(payload)
    return results


def curl_once(env, bucket, payload, part, concurrency, total):
    """curl --parallel PUTting `total` bytes as objects of `part` bytes (`payload`, a file of
    that size), `concurrency` at once, then GETting them."""
    base = f"{env['AWS_ENDPOINT_URL_S3']}/{bucket}/limit"
    objects = max(1, total // part)
    up = ["curl", "-Z", "--parallel-max", str(concurrency)] + curl_options(env)
    down = list(up)
    for i in range(objects):
        up += ["-T", payload, f"{base}/o{i}", "-o", "/dev/null"]
        down += ["-o", "/dev/null", f"{base}/o{i}"]
    t0 = time.monotonic()
    run_curl(up)
    t1 = time.monotonic()
    run_curl(down)
    t2 = time.monotonic()
    clear(env, bucket, "limit/")
    return {"setting": f"curl {part >> 20} MiB x {concurrency}", "part": part, "concurrency": concurrency,
            "upload_gbps": gbps(objects * part, t1 - t0), "download_gbps": gbps(objects * part, t2 - t1)}


def curl_options(env):
    """What every curl request here carries: quiet, failing on HTTP errors, signed."""
    return ["--no-progress-meter", "--fail", "--aws-sigv4", f"aws:amz:{env['AWS_REGION']}:s3",
            "--user", f"{env['AWS_ACCESS_KEY_ID']}:{env['AWS_SECRET_ACCESS_KEY']}",
            # RGW and S3 refuse a SigV4 signature without it; curl does not add it.
            "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD"]


def run_curl(args):
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"curl failed ({done.returncode}): {done.stderr[-2000:]}")


def boto3_default(env, bucket, payload, total):
    """What a user of the stock Python client gets without tuning it."""
    with open(payload, "wb") as f:
        f.write(os.urandom(1 << 20) * (total >> 20))
    client = boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        # boto3 as users run it (recent botocore adds a CRC32 to every upload; asking it not
        # to made RGW 16 stall on the requests here).
        config=Config(s3={"addressing_style": "path"}, read_timeout=300))
    t0 = time.monotonic()
    client.upload_file(payload, bucket, "limit/boto3", Config=TransferConfig())
    t1 = time.monotonic()
    client.download_fileobj(bucket, "limit/boto3", Null(), Config=TransferConfig())
    t2 = time.monotonic()
    client.delete_object(Bucket=bucket, Key="limit/boto3")
    os.unlink(payload)
    return {"setting": "boto3 default", "upload_gbps": gbps(total, t1 - t0),
            "download_gbps": gbps(total, t2 - t1)}


def pin(pid, cpus):
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just ended


class Daemon:
    def __init__(self, binary, root, socket, remote, log, extra=()):
        self.log_path = log
        self.socket = socket
        # ckptd as deployed: staging memory prefaulted at start (a restore's bytes land in it;
        # untouched pages would fault under every GET).
        # Whole checkpoints (--increments off): the figures are uploads and restores of every
        # byte against the gateway's own limit; increment_bench measures increments.
        args = [binary, "--root", root, "--socket", socket, "--staging-bytes", STAGING_BYTES,
                "--increments", "off"] + (["--remote", remote] if remote else []) + list(extra)
        self.proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        if SERVICE_CPUS:
            pin(self.proc.pid, SERVICE_CPUS)
        deadline = time.monotonic() + 120  # prefaulting staging takes seconds
        while not os.path.exists(socket):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("ckptd did not start:\n" + self.log())
            time.sleep(0.05)

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def ranks(helper, socket, world, args, cwd, job="bench"):
    procs = [subprocess.Popen([helper, "--socket", socket, "--job", job, "--rank", str(r),
                               "--world-size", str(world)] + args,
                              cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"{os.path.basename(helper)} {' '.join(args)} failed:\n{out}")


def wait_for(pattern, daemon, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(pattern, daemon.log())
        if found:
            return found
        time.sleep(0.1)
    raise SystemExit(f"no '{pattern}' in ckptd's log:\n{daemon.log()}")


RESTORED = r"restored \d+ tensors \((\d+) bytes, (\d+) read from storage; \d+ skipped\) from the remote tier in ([\d.]+) ms"


def upload_and_restore(a, ckptd, helper, work, remote, total):
    """ckptd's upload of one committed step, then its restore on a node with an empty disk."""
    per_rank = total // a.ranks
    d = Daemon(ckptd, os.path.join(work, "root"), os.path.join(work, "s.sock"), remote,
               os.path.join(work, "ckptd.log"))
    ranks(helper, d.socket, a.ranks, ["--bytes", str(per_rank), "save", "--step", "10", "--wait-committed"], work)
    up = wait_for(r"\[upload\] \[bench s10\] in the remote tier .*?\((\d+) bytes from this node in ([\d.]+) s, "
                  r"(\d+) of them read from staging memory\)", d, 600)
    up_bytes, up_s, from_memory = int(up[0][0]), float(up[0][1]), int(up[0][2])
    # The step is still ckptd's hot copy: its data goes up from memory, not read back from disk.
    if from_memory == 0:
        raise SystemExit("the upload read every byte from disk, none from staging memory:\n" + d.log())
    d.stop()
    shutil.rmtree(os.path.join(work, "root"))
    # The download limit on the very objects the restore reads, just before it reads them.
    same_objects = ranged_gets(remote + "/bench/step-00000010/")
    d = Daemon(ckptd, os.path.join(work, "root2"), os.path.join(work, "s2.sock"), remote,
               os.path.join(work, "ckptd2.log"))
    ranks(helper, d.socket, a.ranks, ["--bytes", str(per_rank), "check"], work)
    restored = re.findall(RESTORED, d.log())
    d.stop()
    shutil.rmtree(os.path.join(work, "root2"))
    bucket, _, prefix = remote[len("s3://"):].partition("/")
    clear(os.environ, bucket, prefix + "/")
    if len(restored) != a.ranks:
        raise SystemExit("not every rank restored from the remote tier:\n" + d.log())
    down_bytes = sum(int(b) for b, _, _ in restored)
    down_s = max(float(ms) for _, _, ms in restored) / 1000
    return gbps(up_bytes, up_s), gbps(down_bytes, down_s), same_objects


def ranged_gets(url, piece=16 << 20, concurrency=16):
    """curl GETting every shard object under `url` (s3://bucket/prefix/) in `piece`-byte
    ranges, `concurrency` at once: what a restore's ranged GETs ask of the store (ckptd
    sends at most 16 at once). GB/s."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    env = os.environ
    client = s3_client(env)
    objects = [(o["Key"], o["Size"]) for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
               if o["Key"].endswith(".safetensors")]
    each = curl_options(env)
    args = ["curl", "-Z", "--parallel-max", str(concurrency)]
    # A range applies to every URL up to the next --next: each GET gets its own group.
    for key, size in objects:
        for at in range(0, size, piece):
            args += each + ["-r", f"{at}-{min(size, at + piece) - 1}", "-o", "/dev/null",
                            f"{env['AWS_ENDPOINT_URL_S3']}/{bucket}/{key}", "--next"]
    args.pop()  # no group after the last
    t0 = time.monotonic()
    run_curl(args)
    return gbps(sum(size for _, size in objects), time.monotonic() - t0)


def reshard_from_remote(ckptd, reshard, work, remote, total, layout):
    """2 ranks save; 3 ranks restore from the bucket on an empty node, in the same layout:
    "flat" (FSDP's flat parameter: contiguous pieces) or "rows" (one tensor split by rows,
    the other by columns, whose pieces are strided in the saved row-major shards)."""
    rows = max(64, total // 2 // 4096 // 4)  # 2 tensors of rows x 1024 F32 (and small ones)
    d = Daemon(ckptd, os.path.join(work, "r1"), os.path.join(work, "r1.sock"), remote,
               os.path.join(work, "reshard1.log"))
    job = "reshard-" + layout
    ranks(reshard, d.socket, 2, ["--rows", str(rows), "--layout", layout, "save", "--wait-committed"], work,
          job=job)
    wait_for(rf"\[upload\] \[{job} s5\] in the remote tier", d, 600)
    d.stop()
    shutil.rmtree(os.path.join(work, "r1"))
    d = Daemon(ckptd, os.path.join(work, "r2"), os.path.join(work, "r2.sock"), remote,
               os.path.join(work, "reshard2.log"))
    ranks(reshard, d.socket, 3, ["--rows", str(rows), "--layout", layout, "check", "--saved-world-size", "2"],
          work, job=job)
    restored = re.findall(RESTORED, d.log())
    d.stop()
    shutil.rmtree(os.path.join(work, "r2"))
    if len(restored) != 3:
        raise SystemExit("not every rank restored from the remote tier:\n" + d.log())
    needed = sum(int(b) for b, _, _ in restored)
    fetched = sum(int(r) for _, r, _ in restored)
    return {"needed_bytes": needed, "fetched_bytes": fetched, "ratio": fetched / needed}


def remote_steps(ckptctl, bucket_url, job):
    listed = subprocess.run([ckptctl, "--job", job, "list", "--root", bucket_url], capture_output=True, text=True)
    rows = [line.split() for line in listed.stdout.splitlines()]  # JOB STEP ... WHERE KIND
    return {int(row[1]) for row in rows if row and row[0] == job and "remote" in row[-2]}  # WHERE, then KIND


def pin_services(ceph):
    """The trainer (this process) onto CPU 0, Ceph's daemons and any ckptd started later
    onto the others."""
    global SERVICE_CPUS
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    SERVICE_CPUS = set(cpus[1:])
    for pidfile in os.listdir(os.path.join(ceph, "run")):
        if pidfile.endswith(".pid"):
            pin(int(open(os.path.join(ceph, "run", pidfile)).read()), SERVICE_CPUS)
    pin(os.getpid(), {cpus[0]})


def training_loop(a, ckptd_bin, ckptctl, work, env, bucket, total):
    """Step time of one training loop saving every `every` steps: no checkpoints, ckptd
    without and with its remote tier, and DCP's async_save through s3fs. A save's blocked
    time is the longest but the first's (which sets up: ckptd registers the buffers)."""
    sys.path.insert(0, os.path.join(a.bin, "client/python"))
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FsspecWriter
    from ckptd.torch import CheckpointManager

    torch.set_num_threads(1)  # the trainer's one core (pin_services)
    width = 1024
    layers = max(1, total // 3 // (width * width * 4))  # parameters + AdamW's 2 states
    steps, every = (6, 3) if a.quick else (24, 4)

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loop(save):
        model, optimizer = make()
        x = torch.randn(32, width)
        blocked, times = [], []
        for step in range(1, steps + 1):
            t0 = time.monotonic()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if save and step % every == 0:
                s0 = time.monotonic()
                save(step, model, optimizer)
                blocked.append(time.monotonic() - s0)
            times.append(time.monotonic() - t0)
        return times, blocked

    results = {}
    times, _ = loop(None)
    results["no checkpoints"] = {"step_s": sum(times) / len(times)}
    for name, remote in (("ckptd", None), ("ckptd --remote", f"s3://{bucket}/loop")):
        root = os.path.join(work, "loop-" + ("remote" if remote else "local"))
        d = Daemon(ckptd_bin, root, root + ".sock", remote, root + ".log", ["--keep-last", "2"])
        managers = {}
        last = {}

        def save(step, model, optimizer):
            if "m" not in managers:
                managers["m"] = CheckpointManager("loop", model, optimizer, socket=d.socket)
            last["step"], last["at"] = step, time.monotonic()
            managers["m"].save(step)

        times, blocked = loop(save)
        durable = None
        if remote:
            while last["step"] not in remote_steps(ckptctl, f"s3://{bucket}/loop", "loop"):
                if time.monotonic() - last["at"] > 300:
                    raise SystemExit("the loop's last step never reached the bucket:\n" + d.log())
                time.sleep(0.05)
            durable = time.monotonic() - last["at"]
        managers["m"].close()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
        results[name] = {"step_s": sum(times) / len(times), "blocked_s": max(blocked[1:]), "durable_s": durable}
        settle(a.quick)

    pending = {}
    fs = {"client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL_S3"], "region_name": env["AWS_REGION"]},
          "key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"]}

    def dcp_save(step, model, optimizer):
        if "future" in pending:
            pending["future"].result()  # DCP allows one async save in flight
        writer = FsspecWriter(f"s3://{bucket}/dcp/step-{step}", thread_count=8, sync_files=False, **fs)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        pending["at"] = time.monotonic()
        pending["future"] = dcp.async_save(state, storage_writer=writer)

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process
        times, blocked = loop(dcp_save)
        pending["future"].result()
    durable = time.monotonic() - pending["at"]
    results["DCP async_save, s3fs"] = {"step_s": sum(times) / len(times), "blocked_s": max(blocked[1:]),
                                       "durable_s": durable}
    return {"bytes": layers * width * (width + 1) * 4 * 3, "steps": steps, "every": every, "results": results}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "bazel-bin"), help="where Bazel put ckptd")
    ap.add_argument("--bytes", default="1G", help="checkpoint size, all ranks together")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--loop-bytes", default="256M", help="the training loop's model + optimizer state")
    ap.add_argument("--quick", action="store_true", help="small sizes: CI")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    total = parse_bytes("64M" if a.quick else a.bytes)
    loop_bytes = parse_bytes("32M" if a.quick else a.loop_bytes)
    global STAGING_BYTES
    STAGING_BYTES = str(max(2 * total, 2 * loop_bytes, 256 << 20))
    ckptd = os.path.join(a.bin, "daemon/ckptd")
    ckptctl = os.path.join(a.bin, "client/ckptctl")
    helper = os.path.join(a.bin, "tests/integration/trainer_helper")
    reshard = os.path.join(a.bin, "tests/integration/reshard_helper")
    work = tempfile.mkdtemp(prefix="remote-bench-")
    ceph = os.path.join(work, "ceph")
    try:
        # memstore keeps objects (and deleted ones, until garbage collection) in RAM.
        subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "start", ceph], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ, CKPTD_CEPH_MEMSTORE_BYTES=str(max(4 << 30, 8 * total))))
        env = dict(line.strip().split("=", 1) for line in open(os.path.join(ceph, "s3.env")) if "=" in line)
        os.environ.update(env)
        bucket = env["CKPTD_TEST_BUCKET"]
        remote = f"s3://{bucket}/bench"
        payload = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"remote-bench-{os.getpid()}")

        def say(text):  # each figure as soon as it is measured (a table without --json)
            if not a.json:
                print(text, flush=True)

        say(f"{total >> 20} MiB in {a.ranks} ranks, Ceph RGW on this machine")
        say(f"{'setting':<22} {'up GB/s':>8} {'down GB/s':>10}")
        sweep = curl_sweep(env, bucket, payload, total, a.quick)
        stock = boto3_default(env, bucket, payload, total)
        for r in sweep + [stock]:
            say(f"{r['setting']:<22} {r['upload_gbps']:>8.3f} {r['download_gbps']:>10.3f}")
        settle(a.quick)
        # The store's speed drifts as it fills (memstore, garbage collection): ckptd and the
        # sweep's best settings take turns, and each side's median is compared.
        tops = {d: max(sweep, key=lambda r: r[d]) for d in ("upload_gbps", "download_gbps")}
        limit = {"upload_gbps": [], "download_gbps": [], "same_objects_gbps": []}
        ours = {"upload_gbps": [], "download_gbps": []}
        for round_ in range(1 if a.quick else 3):
            for direction, top in tops.items():
                with open(payload, "wb") as f:
                    f.write(os.urandom(1 << 20) * (top["part"] >> 20))
                limit[direction].append(
                    curl_once(env, bucket, payload, top["part"], top["concurrency"], total)[direction])
                os.unlink(payload)
            settle(a.quick)
            up, down, same = upload_and_restore(a, ckptd, helper, work, f"{remote}-{round_}", total)
            ours["upload_gbps"].append(up)
            ours["download_gbps"].append(down)
            limit["same_objects_gbps"].append(same)
            say(f"round {round_ + 1}: limit {limit['upload_gbps'][-1]:.3f} up {limit['download_gbps'][-1]:.3f} "
                f"down ({same:.3f} in ranged GETs of the step's own objects); ckptd {up:.3f} up {down:.3f} down")
            settle(a.quick)
        best_up, best_down = median(limit["upload_gbps"]), median(limit["download_gbps"])
        up, down = median(ours["upload_gbps"]), median(ours["download_gbps"])
        say(f"ckptd upload           {up:.3f} GB/s  ({100 * up / best_up:.0f}% of the limit, medians of the rounds)")
        same = median(limit["same_objects_gbps"])
        say(f"ckptd restore          {down:.3f} GB/s  ({100 * down / best_down:.0f}% of the limit, "
            f"{100 * down / same:.0f}% of ranged GETs of the same objects; medians of the rounds)")
        resharded = {}
        for layout in ("flat", "rows"):
            r = resharded[layout] = reshard_from_remote(ckptd, reshard, work, remote, total, layout)
            say(f"resharding restore from the bucket, 2 -> 3 ranks, {layout}: {r['fetched_bytes']} bytes "
                f"fetched for {r['needed_bytes']} needed ({r['ratio']:.3f}x)")
            settle(a.quick)
        pin_services(ceph)
        loop = training_loop(a, ckptd, ckptctl, work, env, bucket, loop_bytes)
        say(f"training loop on CPU 0 (ckptd and Ceph on the others), {loop['bytes'] >> 20} MiB of state, "
            f"a save every {loop['every']} of {loop['steps']} steps:")
        base = loop["results"]["no checkpoints"]["step_s"]
        for name, r in loop["results"].items():
            extra = "" if "blocked_s" not in r else (
                f"  blocked {1000 * r['blocked_s']:.1f} ms per save at most" +
                (f", durable in the bucket {r['durable_s']:.2f} s after" if r["durable_s"] is not None else ""))
            say(f"  {name:<24} {1000 * r['step_s']:8.1f} ms/step ({1000 * (r['step_s'] - base):+.1f}){extra}")
        if a.json:
            print(json.dumps({
                "bytes": total, "ranks": a.ranks, "limit_sweep": sweep, "boto3_default": stock,
                "limit_upload_gbps": best_up, "limit_download_gbps": best_down,
                "rounds": {"limit": limit, "ckptd": ours},
                "sweep_best_upload_gbps": max(r["upload_gbps"] for r in sweep),
                "sweep_best_download_gbps": max(r["download_gbps"] for r in sweep),
                "ckptd_upload_gbps": up, "ckptd_upload_of_limit": up / best_up,
                "ckptd_restore_remote_gbps": down, "ckptd_restore_of_limit": down / best_down,
                "ckptd_restore_of_same_objects": down / same,
                "reshard_from_remote": resharded, "training_loop": loop,
            }))
    finally:
        subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "stop", ceph], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
