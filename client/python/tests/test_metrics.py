"""--metrics-addr: a real ckptd scraped while a trainer saves and restores, parsed with the
stock Prometheus text parser (prometheus_client.parser), as Prometheus would read it
(issue 22 item 1). Every family docs/operators.md lists is there, with the figures of the
run; a trainer that invents job names cannot grow the exposition.
"""
import re
import time
import urllib.request

import pytest
import torch

from prometheus_client.parser import text_string_to_metric_families

import ckptd
from ckptd.torch import CheckpointError, CheckpointManager
from conftest import start_with_metrics as start

# Every family docs/operators.md lists that a single node without a remote tier, a quota or
# a group exports (the process_* ones are client_golang's); the others are scraped in
# tests/integration/metrics_test.cc, from daemons that have them.
FAMILIES = {
    "ckptd_snapshot_seconds", "ckptd_staging_seconds", "ckptd_write_seconds", "ckptd_commit_seconds",
    "ckptd_restore_seconds", "ckptd_upload_seconds", "ckptd_staged_bytes", "ckptd_written_bytes",
    "ckptd_restored_bytes", "ckptd_uploaded_bytes", "ckptd_snapshots", "ckptd_checkpoints",
    "ckptd_failures", "ckptd_build_info", "ckptd_staging_bytes", "ckptd_staging_user_bytes",
    "ckptd_staging_job_bytes", "ckptd_sessions", "ckptd_registered_bytes", "ckptd_job_sessions",
    "ckptd_job_last_committed_step", "ckptd_job_last_commit_age_seconds", "ckptd_jobs_committed",
    "ckptd_job_last_commit_timestamp_seconds", "ckptd_job_tier_step", "ckptd_job_tier_timestamp_seconds",
    "ckptd_job_steps_in_flight", "ckptd_upload_errors", "ckptd_replication_errors",
    "process_cpu_seconds", "process_open_fds", "process_max_fds", "process_virtual_memory_bytes",
    "process_resident_memory_bytes", "process_start_time_seconds",
}


def scrape(daemon):
    """{family name: {(sample name, frozenset(labels)): value}} from one GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = r.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = {(s.name, frozenset(s.labels.items())): s.value for s in family.samples}
    return families


def value(families, family, sample=None, **labels):
    return families[family][(sample or family, frozenset(labels.items()))]


def test_a_scrape_during_a_run_shows_every_figure(workdir):
    daemon = start(workdir)
    try:
        model = torch.nn.Linear(256, 256)
        with CheckpointManager("run", model, socket=daemon.socket) as manager:
            for step in (1, 2, 3):
                assert manager.save(step, blocking=True)
            during = scrape(daemon)  # the trainer still registered
        with CheckpointManager("run", model, socket=daemon.socket) as manager:
            assert manager.load() == 3
        after = scrape(daemon)
    finally:
        daemon.stop()
    assert FAMILIES <= set(after), FAMILIES - set(after)
    assert value(during, "ckptd_sessions", state="alive") == 1
    assert value(during, "ckptd_job_sessions", ckpt_job="run") == 1
    assert value(during, "ckptd_registered_bytes") >= 256 * 256 * 4
    assert value(after, "ckptd_snapshots", "ckptd_snapshots_total", outcome="staged") == 3
    assert value(after, "ckptd_checkpoints", "ckptd_checkpoints_total", outcome="committed") == 3
    assert value(after, "ckptd_staged_bytes", "ckptd_staged_bytes_total") >= 3 * 256 * 256 * 4
    # Step 1 whole; steps 2 and 3 changed nothing, so with increments (the default) they
    # reference it and write little more than their headers.
    written = value(after, "ckptd_written_bytes", "ckptd_written_bytes_total", tier="local")
    assert 256 * 256 * 4 <= written < 2 * 256 * 256 * 4, written
    for histogram, labels in (("ckptd_snapshot_seconds", {}), ("ckptd_staging_seconds", {}),
                              ("ckptd_write_seconds", {"tier": "local"}), ("ckptd_commit_seconds", {"scope": "node"})):
        assert value(after, histogram, histogram + "_count", **labels) == 3, histogram
        assert value(after, histogram, histogram + "_bucket", le="+Inf", **labels) == 3, histogram
    assert value(after, "ckptd_restore_seconds", "ckptd_restore_seconds_count", tier="memory") == 1
    assert value(after, "ckptd_restored_bytes", "ckptd_restored_bytes_total", tier="memory") >= 256 * 256 * 4
    assert value(after, "ckptd_job_last_committed_step", ckpt_job="run") == 3
    assert 0 <= value(after, "ckptd_job_last_commit_age_seconds", ckpt_job="run") < 60
    assert abs(value(after, "ckptd_job_last_commit_timestamp_seconds", ckpt_job="run") - time.time()) < 60
    assert value(after, "ckptd_job_tier_step", ckpt_job="run", tier="local") == 3
    assert value(after, "ckptd_job_steps_in_flight", ckpt_job="run") == 0
    assert value(after, "ckptd_upload_errors", "ckptd_upload_errors_total", cause="unavailable") == 0
    ((_, labels), one), = after["ckptd_build_info"].items()
    assert one == 1 and re.fullmatch(r"\d+\.\d+\.\d+", dict(labels)["version"])
    assert value(after, "ckptd_staging_bytes", state="capacity") == 512 << 20
    assert value(after, "ckptd_failures", "ckptd_failures_total", cause="budget") == 0
    assert value(after, "process_resident_memory_bytes") > 1 << 20
    assert value(after, "process_open_fds") > 3
    assert abs(value(after, "process_start_time_seconds") - time.time()) < 600


def test_failures_are_counted_by_cause(workdir):
    daemon = start(workdir, "--staging-bytes", "4M")
    try:
        model = torch.nn.Linear(2, 2)
        history = {"ids": list(range(1_000_000))}  # a train state past the whole budget
        with CheckpointManager("over", model, extra_state={"history": history}, socket=daemon.socket) as manager:
            with pytest.raises(CheckpointError):
                manager.save(1, blocking=True)
        families = scrape(daemon)
    finally:
        daemon.stop()
    assert value(families, "ckptd_failures", "ckptd_failures_total", cause="budget") == 1
    assert value(families, "ckptd_snapshots", "ckptd_snapshots_total", outcome="rejected") == 1


def test_job_names_a_trainer_invents_cannot_grow_the_exposition(workdir):
    daemon = start(workdir)
    try:
        for i in range(80):
            client = ckptd.connect(daemon.socket, f"invented-{i:03d}", 0, 1)
            client.allocate("w", "F32", [4])
            client.register()
            assert client.wait_committed(client.snapshot(1, {}, {}))["state"] == "committed"
            client.unregister()
        families = scrape(daemon)
    finally:
        daemon.stop()
    assert len(families["ckptd_job_last_committed_step"]) == 64  # the most recent 64 jobs
    assert value(families, "ckptd_job_last_committed_step", ckpt_job="invented-079") == 1
    assert value(families, "ckptd_jobs_committed") == 80
