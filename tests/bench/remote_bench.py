#!/usr/bin/env python3
"""The remote tier's speed against the store's own limit, measured in the same run.

Starts a single-node Ceph cluster with an S3 gateway (tools/ceph.sh), then
  1. the limit: boto3's transfer manager (the stock client) uploading and downloading the
     same bytes, swept over part size and concurrency, and at its default settings;
  2. ckptd --remote: ranks (tests/integration/trainer_helper) save one step, and the time
     from the uploader's start to the manifest written remotely (ckptd's [upload] log line);
  3. restore from the remote tier on a node with an empty disk: the ranks restore at once,
     and the time is the slowest rank's (ckptd's [control] log lines).
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


def boto3_sweep(env, bucket, payload, quick):
    client = boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        # boto3 as users run it (recent botocore adds a CRC32 to every upload; asking it not
        # to made RGW 16 stall on the requests here).
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=64, read_timeout=300))
    parts = [8 << 20, 16 << 20] if quick else [8 << 20, 16 << 20, 64 << 20]
    threads = [4, 8] if quick else [8, 16]
    results = []
    settings = [("default", TransferConfig())] + [
        (f"{p >> 20} MiB x {c}", TransferConfig(multipart_threshold=p, multipart_chunksize=p, max_concurrency=c))
        for p in parts for c in threads]
    for name, config in settings:
        key = "limit/object"
        t0 = time.monotonic()
        client.upload_file(payload, bucket, key, Config=config)
        up = time.monotonic() - t0
        t0 = time.monotonic()
        client.download_fileobj(bucket, key, Null(), Config=config)
        down = time.monotonic() - t0
        client.delete_object(Bucket=bucket, Key=key)
        time.sleep(0 if quick else 15)  # RGW's garbage collection frees the deleted object's RAM
        size = os.path.getsize(payload)
        results.append({"setting": name, "upload_gbps": gbps(size, up), "download_gbps": gbps(size, down)})
    return results


class Daemon:
    def __init__(self, binary, root, socket, remote, log):
        self.log_path = log
        self.socket = socket
        self.proc = subprocess.Popen(
            [binary, "--root", root, "--socket", socket, "--remote", remote, "--staging-bytes", "4G",
             "--prefault-staging", "false"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
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


def ranks(helper, socket, world, per_rank, args, cwd):
    procs = [subprocess.Popen([helper, "--socket", socket, "--job", "bench", "--rank", str(r),
                               "--world-size", str(world), "--bytes", str(per_rank)] + args,
                              cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"trainer_helper {' '.join(args)} failed:\n{out}")


def wait_for(pattern, daemon, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(pattern, daemon.log())
        if found:
            return found
        time.sleep(0.1)
    raise SystemExit(f"no '{pattern}' in ckptd's log:\n{daemon.log()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "bazel-bin"), help="where Bazel put ckptd")
    ap.add_argument("--bytes", default="1G", help="checkpoint size, all ranks together")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small sizes: CI")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    total = parse_bytes("64M" if a.quick else a.bytes)
    per_rank = total // a.ranks
    ckptd = os.path.join(a.bin, "daemon/ckptd")
    helper = os.path.join(a.bin, "tests/integration/trainer_helper")
    work = tempfile.mkdtemp(prefix="remote-bench-")
    ceph = os.path.join(work, "ceph")
    try:
        # memstore keeps objects (and deleted ones, until garbage collection) in RAM.
        subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "start", ceph], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ, CKPTD_CEPH_MEMSTORE_BYTES=str(max(4 << 30, 6 * total))))
        env = dict(line.strip().split("=", 1) for line in open(os.path.join(ceph, "s3.env")) if "=" in line)
        os.environ.update(env)
        bucket = env["CKPTD_TEST_BUCKET"]

        # The limit: the stock client on the same bucket, the same total bytes from memory.
        payload = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"remote-bench-{os.getpid()}")
        with open(payload, "wb") as f:
            f.write(os.urandom(1 << 20) * (total >> 20))
        sweep = boto3_sweep(env, bucket, payload, a.quick)
        os.unlink(payload)
        best_up = max(r["upload_gbps"] for r in sweep)
        best_down = max(r["download_gbps"] for r in sweep)

        # ckptd's upload of one committed step.
        remote = f"s3://{bucket}/bench"
        d = Daemon(ckptd, os.path.join(work, "root"), os.path.join(work, "s.sock"), remote,
                   os.path.join(work, "ckptd.log"))
        ranks(helper, d.socket, a.ranks, per_rank, ["save", "--step", "10", "--wait-committed"], work)
        up = wait_for(r"\[upload\] \[bench s10\] in the remote tier .*?\((\d+) bytes from this node in ([\d.]+) s\)",
                      d, 600)
        up_bytes, up_s = int(up[0][0]), float(up[0][1])
        d.stop()

        # Restore on a node whose disk is empty.
        shutil.rmtree(os.path.join(work, "root"))
        d = Daemon(ckptd, os.path.join(work, "root2"), os.path.join(work, "s2.sock"), remote,
                   os.path.join(work, "ckptd2.log"))
        ranks(helper, d.socket, a.ranks, per_rank, ["check"], work)
        restored = re.findall(r"restored \d+ tensors \((\d+) bytes.*?from the remote tier in ([\d.]+) ms", d.log())
        d.stop()
        if len(restored) != a.ranks:
            raise SystemExit("not every rank restored from the remote tier:\n" + d.log())
        down_bytes = sum(int(b) for b, _ in restored)
        down_s = max(float(ms) for _, ms in restored) / 1000

        result = {
            "bytes": total, "ranks": a.ranks, "boto3_sweep": sweep,
            "limit_upload_gbps": best_up, "limit_download_gbps": best_down,
            "ckptd_upload_gbps": gbps(up_bytes, up_s), "ckptd_upload_of_limit": gbps(up_bytes, up_s) / best_up,
            "ckptd_restore_remote_gbps": gbps(down_bytes, down_s),
            "ckptd_restore_of_limit": gbps(down_bytes, down_s) / best_down,
        }
        if a.json:
            print(json.dumps(result))
        else:
            print(f"{total >> 20} MiB in {a.ranks} ranks, Ceph RGW on this machine")
            print(f"{'boto3 setting':<18} {'up GB/s':>8} {'down GB/s':>10}")
            for r in sweep:
                print(f"{r['setting']:<18} {r['upload_gbps']:>8.3f} {r['download_gbps']:>10.3f}")
            print(f"ckptd upload        {result['ckptd_upload_gbps']:.3f} GB/s  "
                  f"({100 * result['ckptd_upload_of_limit']:.0f}% of the sweep's best)")
            print(f"ckptd restore       {result['ckptd_restore_remote_gbps']:.3f} GB/s  "
                  f"({100 * result['ckptd_restore_of_limit']:.0f}% of the sweep's best)")
    finally:
        subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "stop", ceph], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
