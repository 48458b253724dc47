#!/usr/bin/env python3
"""Peer replicas (issue 25), measured with real daemons on loopback in one run.

Starts a group of N ckptd (node 0 the coordinator, each with its own root), one trainer
rank per node (tests/integration/trainer_helper), and for each --replication code (off
first, then each code asked for):
  1. saves --steps steps back to back, every rank waiting for the global commit, and reads
     from every daemon's /metrics the time each snapshot held its trainer
     (ckptd_snapshot_seconds: the in-loop cost) and from `ckptctl status` what each step's
     replication sent and how long it took from staged to sealed;
  2. network bytes per step: the fragments every node sent, against the bytes it staged
     (a full mirror sends each byte once more, k+m/k copies stored in all);
  3. with the last code, one trainer session per rank (job "bench-patch") saving two steps
     4 KiB apart: the first goes whole, the second as a patch of the changed column chunks;
     what each sent and took from staged to sealed (the hashing included);
Then, with the last code, the time from "node lost" to "its ranks restored" for the same
state: node 1 SIGKILLed and started again
  - with its root intact: its ranks restore from its disk;
  - with its root deleted: its ranks restore from its peers' memory (source=peer);
  - with its root deleted and no peers (--replication off on the replacement), from the
    remote tier (Ceph RGW on this machine), with --remote only.
Each restore is timed two ways: the restore itself (the slowest rank's, from ckptd's log)
and from the SIGKILL to the last rank restored (start, join and restore).
Encode and decode throughput against memcpy: tests/bench/erasure_bench.cc.

  .venv/bin/python tests/bench/replica_bench.py --nodes 6 --codes 1+1,2+1,4+2 --bytes 256M
  .venv/bin/python tests/bench/replica_bench.py --quick        # CI: built and run, small
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import remote_bench  # noqa: E402  (the daemon wrapper and helpers the remote tier's bench uses)
from remote_bench import gbps, median, parse_bytes  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from free_port import free_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "replica-bench-group-token-0123456789abcdef"
RESTORED = (r"\[{job}/r(\d+) s(\d+)\] restored \d+ tensors \((\d+) bytes, \d+ read from storage; \d+ skipped\) "
            r"from ([a-z' ]+) in ([\d.]+) ms")


class Group:
    """N daemons on loopback, one rank each, job "bench"."""

    def __init__(self, a, work, code, remote=None):
        self.a, self.work, self.code, self.remote = a, work, code, remote
        self.port = free_port()
        self.metrics = [free_port() for _ in range(a.nodes)]
        self.token = os.path.join(work, "token")
        with open(self.token, "w") as f:
            f.write(TOKEN + "\n")
        self.daemons = [None] * a.nodes
        for n in range(a.nodes):
            self.start(n)
        self.wait_ready()

    def root(self, n):
        return os.path.join(self.work, f"node{n}", "root")

    def socket(self, n):
        return os.path.join(self.work, f"node{n}", "s.sock")

    def start(self, n, code=None):
        code = self.code if code is None else code
        os.makedirs(os.path.dirname(self.root(n)), exist_ok=True)
        flags = ["--node-rank", str(n), "--num-nodes", str(self.a.nodes), "--coordinator", f"127.0.0.1:{self.port}",
                 "--group-token-file", self.token, "--group-timeout", "2s", "--step-timeout", "120s",
                 "--restore-timeout", "120s", "--metrics-addr", str(self.metrics[n]), "--log-level", "info",
                 "--prefault-staging", "true"]  # as deployed: no page faults in the measured copies
        if n == 0:
            flags += ["--group-addr", f"127.0.0.1:{self.port}"]
        if code:
            # Two jobs' fragments (bench, bench-patch), each two steps while the next arrives.
            flags += ["--replication", code, "--replica-bytes", str(max(8 * self.a.bytes_per_rank, 256 << 20))]
        log = os.path.join(self.work, f"node{n}", f"ckptd.{int(time.time() * 1000)}.log")
        self.daemons[n] = remote_bench.Daemon(self.a.ckptd, self.root(n), self.socket(n), self.remote, log, flags)

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        for n in range(self.a.nodes):
            while subprocess.run([self.a.ckptctl, "--socket", self.socket(n), "health"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
                if time.monotonic() > deadline:
                    raise SystemExit(f"node {n} not ready:\n" + self.daemons[n].log())
                time.sleep(0.1)

    def kill(self, n):
        self.daemons[n].proc.send_signal(signal.SIGKILL)
        self.daemons[n].proc.wait(30)

    def stop(self):
        for d in reversed(self.daemons):
            if d is not None and d.proc.poll() is None:
                d.stop()

    def ranks(self, step, command):
        """Every rank runs `command` (save / check) at once; raises unless all succeed."""
        per_rank = self.a.bytes_per_rank
        procs = [subprocess.Popen([self.a.helper, "--socket", self.socket(n), "--job", "bench", "--rank", str(n),
                                   "--world-size", str(self.a.nodes), "--seed", str(step * 100 + n + 1),
                                   "--bytes", str(per_rank)] + command,
                                  cwd=self.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for n in range(self.a.nodes)]
        outs = []
        for n, p in enumerate(procs):
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"rank {n} {' '.join(command)} failed:\n{out}\n" + self.daemons[n].log()[-4000:])
            outs.append(out)
        return outs

    def snapshot_seconds(self):
        """(sum, count) of ckptd_snapshot_seconds over every node."""
        total, count = 0.0, 0
        for port in self.metrics:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            total += float(re.search(r"^ckptd_snapshot_seconds_sum(?:\{\})? (\S+)$", text, re.M).group(1))
            count += int(float(re.search(r"^ckptd_snapshot_seconds_count(?:\{\})? (\S+)$", text, re.M).group(1)))
        return total, count

    def replication(self, n, job="bench"):
        out = subprocess.run([self.a.ckptctl, "--socket", self.socket(n), "--json", "status"], capture_output=True,
                             text=True, check=True).stdout
        for j in json.loads(out).get("jobs", []):
            if j.get("job") == job:
                return {int(r["step"]): r for r in j.get("replication", [])}
        return {}


def settled(g, step, timeout=120, job="bench"):
    """Every node's replication of `step` as it ends (replicated or incomplete)."""
    deadline = time.monotonic() + timeout
    states = {}
    while time.monotonic() < deadline:
        states = {n: g.replication(n, job) for n in range(g.a.nodes)}
        if all(s.get(step, {}).get("state") in ("replicated", "incomplete") for s in states.values()):
            break
        time.sleep(0.1)
    return states


def loop(a, work, code):
    """Saves a.steps steps back to back, then a.steps more each after the one before has
    replicated (a checkpoint interval longer than replication: the usual case); the in-loop
    cost per snapshot both ways and, with a code, what went out."""
    g = Group(a, work, code)
    try:
        g.ranks(1, ["save", "--step", "1", "--wait-committed"])  # first-use costs, not counted
        result = {"code": code or "off"}
        for paced in (False, True):
            first = 2 + (a.steps if paced else 0)
            if code:
                settled(g, first - 1)
            held = []  # per step: the mean over its snapshots (one per node)
            started = time.monotonic()
            for step in range(first, first + a.steps):
                before = g.snapshot_seconds()
                g.ranks(step, ["save", "--step", str(step), "--wait-committed"])
                after = g.snapshot_seconds()
                held.append((after[0] - before[0]) / max(after[1] - before[1], 1))
                if paced and code:
                    settled(g, step)
            wall = (time.monotonic() - started) / a.steps
            key = "paced" if paced else "back_to_back"
            # The median step: one step slowed by something else on this shared machine (the
            # page cache writing back) does not make the figure.
            result[f"snapshot_ms_{key}"] = 1000 * median(held)
            result[f"snapshot_ms_{key}_steps"] = [1000 * h for h in held]
            result[f"step_wall_s_{key}"] = wall
        if code:
            last = 1 + 2 * a.steps
            states = settled(g, last)
            steps = [s for n in states for st, s in states[n].items() if st >= 2 + a.steps]
            replicated = [s for s in steps if s.get("state") == "replicated"]
            if not replicated:
                raise SystemExit(f"no step replicated with {code}: {states}")
            sent = median([int(s.get("bytes_sent", 0)) for s in replicated])
            result.update({
                "replicated_steps": len(replicated), "steps": len(steps),
                "bytes_sent_per_node_step": sent, "sent_over_staged": sent / a.bytes_per_rank,
                # From the first shard staged to the seal: the commit's wait is inside it.
                "replication_s": median([float(s.get("seconds", 0)) for s in replicated]),
            })
        return result, g
    except BaseException:
        g.stop()
        raise


def patched(g, a):
    """One trainer session per rank (job "bench-patch") saves two steps, the second once the
    first is replicated, changing only model.a's first 4 KiB in between (trainer_helper
    --changed-bytes): the first goes whole, the second as a patch of the changed column
    chunks. What each sent (the median node) and took from staged to sealed."""
    go_on = os.path.join(g.work, "go-on")
    procs = [subprocess.Popen([a.helper, "--socket", g.socket(n), "--job", "bench-patch", "--rank", str(n),
                               "--world-size", str(a.nodes), "--seed", str(n + 7), "--bytes", str(a.bytes_per_rank),
                               "save-steps", "--steps-list", "1,2", "--changed-bytes", "4096", "--then-wait-for", go_on],
                              cwd=g.work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(a.nodes)]
    try:
        first = settled(g, 1, job="bench-patch")
        with open(go_on, "w"):
            pass
        for n, p in enumerate(procs):
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"rank {n} save-steps failed:\n{out}\n" + g.daemons[n].log()[-4000:])
        second = settled(g, 2, job="bench-patch")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    result = {}
    for name, states, step in (("whole", first, 1), ("patch", second, 2)):
        steps = [s[step] for s in states.values() if s.get(step, {}).get("state") == "replicated"]
        if len(steps) != a.nodes:
            raise SystemExit(f"step {step} of bench-patch not replicated everywhere: {states}")
        result[name] = {"bytes_sent_per_node": median([int(s.get("bytes_sent", 0)) for s in steps]),
                        "replication_s": median([float(s.get("seconds", 0)) for s in steps])}
    return result


def evict(root):
    """Drops `root`'s files from the page cache (written and fsynced, so clean: they go)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def restored(daemon, step):
    """The slowest of this daemon's restores of `step`: (seconds, source, bytes)."""
    found = [m for m in re.findall(RESTORED.format(job="bench"), daemon.log()) if int(m[1]) == step]
    if not found:
        raise SystemExit("no restore in the log:\n" + daemon.log()[-4000:])
    slowest = max(found, key=lambda m: float(m[4]))
    return float(slowest[4]) / 1000, slowest[3], sum(int(m[2]) for m in found)


def node_lost(g, step, wipe, code=None):
    """Node 1 SIGKILLed (its root deleted when `wipe`) and started again; every rank restores."""
    started = time.monotonic()
    g.kill(1)
    if wipe:
        shutil.rmtree(g.root(1))
    else:
        evict(g.root(1))  # a disk's speed, not the page cache's
    g.start(1, code)
    g.wait_ready()
    outs = g.ranks(step, ["check"])
    total = time.monotonic() - started
    if not all("match" in o for o in outs):
        raise SystemExit("a rank restored other bytes:\n" + "\n".join(outs))
    seconds, source, nbytes = restored(g.daemons[1], step)
    return {"source": source, "restore_s": seconds, "restore_gbps": gbps(nbytes, seconds), "lost_to_restored_s": total}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "bazel-bin"))
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--codes", default="1+1,2+1,4+2", help="--replication codes to measure, besides off")
    ap.add_argument("--bytes", default="256M", help="each rank's state")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--remote", action="store_true", help="also restore from the remote tier (Ceph RGW here)")
    ap.add_argument("--quick", action="store_true", help="CI: 4 nodes, 2+1, 8 MiB, 2 steps")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the daemons' roots and logs (printed at the end)")
    a = ap.parse_args()
    if a.quick:
        a.nodes, a.codes, a.bytes, a.steps = 4, "2+1", "8M", 2
    a.bytes_per_rank = parse_bytes(a.bytes)
    a.ckptd = os.path.join(a.bin, "daemon/ckptd")
    a.ckptctl = os.path.join(a.bin, "client/ckptctl")
    a.helper = os.path.join(a.bin, "tests/integration/trainer_helper")
    codes = [c for c in a.codes.split(",") if c]
    remote_bench.STAGING_BYTES = str(max(4 * a.bytes_per_rank, 256 << 20))
    work = tempfile.mkdtemp(prefix="replica-bench-")

    def say(text):
        if not a.json:
            print(text, flush=True)

    report = {"nodes": a.nodes, "bytes_per_rank": a.bytes_per_rank, "steps": a.steps, "loops": [], "node_lost": {}}
    say(f"{a.nodes} daemons on loopback, one rank of {a.bytes_per_rank >> 20} MiB each, {a.steps} steps back to back, {a.steps} paced")
    say("the trainer's time held per snapshot (ckptd_snapshot_seconds, the median step), steps back to back and "
        "paced (each after the one before replicated):")
    say(f"{'replication':<12} {'back to back':>13} {'paced':>9} {'sent/step':>10} {'sent/staged':>12} "
        f"{'staged->sealed':>15}")
    g = None
    try:
        for code in [None] + codes:
            if g is not None:
                g.stop()
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
            r, g = loop(a, work, code)
            report["loops"].append(r)
            extra = "" if not code else (f" {r['bytes_sent_per_node_step'] / 2**20:>8.1f}Mi {r['sent_over_staged']:>11.2f}x "
                                         f"{1000 * r['replication_s']:>12.0f} ms")
            say(f"{r['code']:<12} {r['snapshot_ms_back_to_back']:>10.1f} ms {r['snapshot_ms_paced']:>6.1f} ms{extra}")
        if codes:
            r = report["patch"] = patched(g, a)
            w, p = r["whole"], r["patch"]
            say(f"one session, 4 KiB of each rank changed between two steps ({codes[-1]}): the first sent "
                f"{w['bytes_sent_per_node'] / 2**20:.2f} MiB per node in {1000 * w['replication_s']:.0f} ms, the second "
                f"(a patch) {p['bytes_sent_per_node'] / 2**20:.2f} MiB in {1000 * p['replication_s']:.0f} ms "
                f"({p['bytes_sent_per_node'] / max(w['bytes_sent_per_node'], 1):.1%})")
        # The same state lost three ways: the last code's group, its last step.
        step = 1 + 2 * a.steps
        for name, wipe in (("disk", False), ("peer", True)):
            r = report["node_lost"][name] = node_lost(g, step, wipe)
            say(f"node lost, restored from {r['source']:<14}: restore {1000 * r['restore_s']:7.0f} ms "
                f"({r['restore_gbps']:.2f} GB/s), SIGKILL to every rank restored {r['lost_to_restored_s']:.2f} s")
        if report["node_lost"]["peer"]["source"] != "peers' memory":
            raise SystemExit(f"the wiped node did not restore from peers: {report['node_lost']['peer']}")
        if a.remote:
            report["node_lost"]["remote"] = remote_restore(a, work, step)
            r = report["node_lost"]["remote"]
            say(f"node lost, restored from {r['source']:<14}: restore {1000 * r['restore_s']:7.0f} ms "
                f"({r['restore_gbps']:.2f} GB/s), SIGKILL to every rank restored {r['lost_to_restored_s']:.2f} s")
        if a.json:
            print(json.dumps(report))
    finally:
        if g is not None:
            g.stop()
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def remote_restore(a, work, step):
    """The same node lost with a remote tier and no peers to ask: Ceph RGW on this machine."""
    ceph = os.path.join(tempfile.mkdtemp(prefix="replica-bench-ceph-"), "ceph")
    try:
        subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "start", ceph], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        env = dict(line.strip().split("=", 1) for line in open(os.path.join(ceph, "s3.env")) if "=" in line)
        os.environ.update(env)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        g = Group(a, work, None, remote=f"s3://{env['CKPTD_TEST_BUCKET']}/replica-bench")
        try:
            g.ranks(step, ["save", "--step", str(step), "--wait-committed"])
            deadline = time.monotonic() + 300
            while not re.search(r"\[upload\] \[bench s%d\] in the remote tier" % step, g.daemons[0].log()):
                if time.monotonic() > deadline:
                    raise SystemExit("the step never reached the remote tier:\n" + g.daemons[0].log()[-4000:])
                time.sleep(0.2)
            return node_lost(g, step, wipe=True)
        finally:
            g.stop()
    finally:
        subprocess.run([os.path.join(REPO, "tools/ceph.sh"), "stop", ceph], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
