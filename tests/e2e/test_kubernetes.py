"""deploy/kubernetes/: the Indexed Job with its headless Service, and the JobSet. Their built-in kinds validated
strictly against the Kubernetes schemas (kubernetes-validate, offline: it ships them), the JobSet's embedded Job
as a built-in Job and its own fields against JobSet v1alpha2's names; what the Job and JobSet controllers do with
each exit status, by the manifests' own failure policies; and their pods' command run as local processes.

A pod here is its container's command and args, run in the repository (the image's working folder) with the
environment the manifest gives it plus what Kubernetes adds (`JOB_COMPLETION_INDEX`, from the Job controller),
as PID 1 of a PID namespace of its own (`unshare --pid --fork --mount-proc`: the kubelet's SIGTERM goes to each
container's PID 1), with an /etc/hosts of its own (`unshare --mount` and a bind mount, the machine's file
untouched) that maps the manifest's `--main-addr`, pod 0's DNS name, to 127.0.0.1, as the cluster's DNS maps it
to pod 0's address. The args change only where a CPU test machine must: `--config` is the demo preset with the
toy settings, `--gpus G` becomes `--cpu --gpus 1`, `--main-port` a free port (tests run side by side), the
bucket the GCS emulator's, the data the toy shards, and each pod's run folder (its emptyDir) a folder of its own.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from tests.conftest import free_port
from tests.e2e.test_preemption import leftovers
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, train_rows

MANIFESTS = REPO_ROOT / "deploy" / "kubernetes"
INDEXED_JOB, JOBSET = MANIFESTS / "indexed-job.yaml", MANIFESTS / "jobset.yaml"
OLDEST = "1.31.0"  # podFailurePolicy is GA from 1.31; the manifests hold on it and on the newest schemas shipped
SETS = TINY + ["per_device_train_batch_size=2", "save_steps=100000", "max_steps=8"]
STOPPED = 143  # a SIGTERM's usual status: what the manifests' --stop-exit-code asks for and their policies expect


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kind(path: Path, name: str) -> dict:
    return next(doc for doc in documents(path) if doc["kind"] == name)


def job_spec(path: Path) -> dict:
    """The batch/v1 JobSpec of the manifest's pods: the Job's, or the JobSet's one replicated Job's."""
    if path == JOBSET:
        (replicated,) = kind(path, "JobSet")["spec"]["replicatedJobs"]
        assert replicated.get("replicas", 1) == 1
        return replicated["template"]["spec"]
    return kind(path, "Job")["spec"]


def container(path: Path) -> dict:
    (trainer,) = job_spec(path)["template"]["spec"]["containers"]
    return trainer


def args(path: Path) -> dict[str, list[str]]:
    """The container's `--flag=value` args by flag (every value of a repeated flag, in order)."""
    by_flag: dict[str, list[str]] = {}
    for arg in container(path)["args"]:
        assert arg.startswith("--") and "=" in arg, arg
        flag, value = arg.split("=", 1)
        by_flag.setdefault(flag, []).append(value)
    return by_flag


def pod_0_dns_name(path: Path) -> str:
    """The DNS name Kubernetes gives pod 0: JOB-0.SUBDOMAIN for an Indexed Job with a subdomain (its hostname is
    JOB-INDEX), JOBSET-REPLICATEDJOB-0-0.SUBDOMAIN for a JobSet with enableDNSHostnames (the subdomain defaults
    to the JobSet's name)."""
    if path == JOBSET:
        jobset = kind(path, "JobSet")
        network = jobset["spec"]["network"]
        assert network["enableDNSHostnames"] is True
        name, replicated = jobset["metadata"]["name"], jobset["spec"]["replicatedJobs"][0]["name"]
        return f"{name}-{replicated}-0-0.{network.get('subdomain', name)}"
    job = kind(path, "Job")
    return f"{job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}"


# ------------------------------------------------------------------------------------------ the manifests

@pytest.mark.parametrize("version", [OLDEST, "latest"])
def test_the_built_in_kinds_validate_strictly_against_the_kubernetes_schemas(version):
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    for doc in documents(INDEXED_JOB):
        kubernetes_validate.validate(doc, version, strict=True)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "neox-node-0"},
           "spec": job_spec(JOBSET)}  # what the JobSet controller creates from its template
    kubernetes_validate.validate(job, version, strict=True)
    typo = {"action": "FailJob", "onExitCode": {"operator": "In", "values": [2]}}  # onExitCodes misspelt
    wrong = {**job, "spec": {**job["spec"], "podFailurePolicy": {"rules": [typo]}}}
    with pytest.raises(kubernetes_validate.ValidationError, match="onExitCode"):  # the check can fail
        kubernetes_validate.validate(wrong, version, strict=True)


# JobSet v1alpha2's fields (jobset.x-k8s.io, api/jobset/v1alpha2/jobset_types.go; the JobSet is a custom
# resource, not in the Kubernetes schemas). The whole manifest also validated against the CRD's own
# openAPIV3Schema (jobset v0.12, additionalProperties refused) when it was written.
JOBSET_FIELDS = {
    "spec": {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
             "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"},
    "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
    "failurePolicy": {"maxRestarts", "restartStrategy", "rules"},
    "rule": {"name", "action", "onJobFailureReasons", "onJobFailureMessagePatterns", "targetReplicatedJobs"},
    "replicatedJob": {"name", "groupName", "template", "replicas", "dependsOn"},
}
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
                  "RestartJobAndIgnoreMaxRestarts"}


def test_the_jobset_has_jobset_v1alpha2_s_shape():
    jobset = kind(JOBSET, "JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and set(jobset) == {"apiVersion", "kind", "metadata",
                                                                                  "spec"}
    spec = jobset["spec"]
    assert set(spec) <= JOBSET_FIELDS["spec"] and set(spec["network"]) <= JOBSET_FIELDS["network"]
    policy = spec["failurePolicy"]
    assert set(policy) <= JOBSET_FIELDS["failurePolicy"]
    assert policy["restartStrategy"] in ("Recreate", "BlockingRecreate") and policy["maxRestarts"] >= 0
    for rule in policy["rules"]:
        assert set(rule) <= JOBSET_FIELDS["rule"] and rule["action"] in JOBSET_ACTIONS
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
        for pattern in rule.get("onJobFailureMessagePatterns", []):
            re.compile(pattern)
    for replicated in spec["replicatedJobs"]:
        assert set(replicated) <= JOBSET_FIELDS["replicatedJob"] and set(replicated["template"]) <= {"metadata",
                                                                                                      "spec"}


@pytest.mark.parametrize("manifest", [INDEXED_JOB, JOBSET], ids=lambda p: p.name)
def test_the_pods_command_launches_n_nodes_that_resume_and_stop_with_a_checkpoint(manifest):
    spec, flags = job_spec(manifest), args(manifest)
    pod = spec["template"]["spec"]
    trainer = container(manifest)
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == int(flags["--nodes"][0])  # N in all three
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == int(flags["--gpus"][0])  # G in both
    assert trainer["command"] == ["./start_training.sh"]  # PID 1 itself, no shell in between
    assert flags["--node-rank-from"] == ["JOB_COMPLETION_INDEX"] and "--node-rank" not in flags
    assert flags["--main-addr"] == [pod_0_dns_name(manifest)]
    assert flags["--resume"] == ["auto"] and int(flags["--max-restarts"][0]) >= 1
    assert flags["--stop-exit-code"] == [str(STOPPED)]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 120
    sets = dict(s.split("=", 1) for s in flags["--set"])
    assert sets["gcs_bucket"] and sets["run_name"] and sets["data_dir"].startswith("gs://")
    env = {e["name"]: e for e in trainer["env"]}
    key = env["GOOGLE_APPLICATION_CREDENTIALS"]["value"]
    secret = next(v for v in pod["volumes"] if "secret" in v)
    mount = next(m for m in trainer["volumeMounts"] if m["name"] == secret["name"])
    assert Path(key).parent == Path(mount["mountPath"]) and mount["readOnly"] is True
    lines = [line for line in manifest.read_text().splitlines() if not line.lstrip().startswith("#")]
    for needle in ("image:", "--gpus=", "--nodes=", "parallelism:", "completions:", "gcs_bucket=", "data_dir=",
                   "run_name=", "nvidia.com/gpu:", "terminationGracePeriodSeconds:"):
        assert all("# EDIT" in line for line in lines if needle in line), needle  # the values a user changes
    if manifest == INDEXED_JOB:
        service, job = kind(manifest, "Service"), kind(manifest, "Job")
        assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == pod["subdomain"]
        assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
        assert service["spec"]["publishNotReadyAddresses"] is True


def pod_failure_action(policy: dict, exit_code: int, disrupted: bool = False) -> tuple[str, str | None]:
    """The Job controller's verdict on a failed pod of container `trainer` (pkg/controller/job/
    pod_failure_policy.go): the first rule that matches, its action and, for FailJob, the Job's failure
    message; no match: Count."""
    for index, rule in enumerate(policy["rules"]):
        codes = rule.get("onExitCodes")
        if codes is not None:
            assert codes.get("containerName", "trainer") == "trainer"
            matched = exit_code != 0 and ((exit_code in codes["values"]) == (codes["operator"] == "In"))
            message = f"Container trainer for pod default/neox-0-x failed with exit code {exit_code} matching " \
                      f"{rule['action']} rule at index {index}"
        else:
            matched = disrupted and any(c["type"] == "DisruptionTarget" and c.get("status", "True") == "True"
                                        for c in rule["onPodConditions"])
            message = f"Pod default/neox-0-x has condition DisruptionTarget matching {rule['action']} rule at " \
                      f"index {index}"
        if matched:
            return rule["action"], message if rule["action"] == "FailJob" else None
    return "Count", None


def jobset_action(policy: dict, reason: str, message: str) -> str:
    """The JobSet controller's verdict on a failed Job (pkg/controllers/failure_policy.go): the first rule whose
    reasons and message patterns (RE2, here Python's re: these patterns mean the same in both) match; none:
    RestartJobSet."""
    for rule in policy["rules"]:
        if (not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"]) and \
                (not rule.get("onJobFailureMessagePatterns")
                 or any(re.search(p, message) for p in rule["onJobFailureMessagePatterns"])):
            return rule["action"]
    return "RestartJobSet"


# a pod's end -> (what the Indexed Job does, what the JobSet does)
ENDS = {
    "a setting or input error (exit 2)": ((2, False), "FailJob", "FailJobSet"),
    "stopped cleanly with a checkpoint (--stop-exit-code)": ((STOPPED, False), "Ignore",
                                                             "RestartJobSetAndIgnoreMaxRestarts"),
    "preempted: stopped with a checkpoint": ((STOPPED, True), "Ignore", "RestartJobSetAndIgnoreMaxRestarts"),
    "preempted: SIGKILLed at the grace period's end": ((137, True), "Ignore", "RestartJobSetAndIgnoreMaxRestarts"),
    "a failure after the pod's own restarts (exit 1)": ((1, False), "Count", "RestartJobSet"),
    "the hang watchdog (exit 3)": ((3, False), "Count", "RestartJobSet"),
    "a rank killed by the OOM killer (137)": ((137, False), "Count", "RestartJobSet"),
}


@pytest.mark.parametrize("end", list(ENDS))
def test_each_exit_status_gets_what_it_needs_from_the_job_and_the_jobset(end):
    (code, disrupted), job_does, jobset_does = ENDS[end]
    assert pod_failure_action(job_spec(INDEXED_JOB)["podFailurePolicy"], code, disrupted)[0] == job_does
    spec = job_spec(JOBSET)
    assert spec["backoffLimit"] == 0  # the Job fails with its first failed pod: the JobSet's policy decides
    action, message = pod_failure_action(spec["podFailurePolicy"], code, disrupted)
    reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
    assert action in ("FailJob", "Count")
    assert jobset_action(kind(JOBSET, "JobSet")["spec"]["failurePolicy"], reason, message or "") == jobset_does


# ------------------------------------------------------------------------------------------ the pods, run here

@dataclass
class Pod:
    index: int
    argv: list[str]
    env: dict[str, str]
    out: Path
    proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.out.parent / "pod.log"

    def start(self, main_addr: str) -> None:
        """Runs the pod's command as PID 1 of its own PID namespace, its /etc/hosts mapping `main_addr` to
        127.0.0.1 in a mount namespace of its own."""
        hosts = self.out.parent / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {main_addr}\n")
        cmd = ["unshare", "--mount", "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts),
               "unshare", "--pid", "--fork", "--mount-proc", *self.argv]
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=REPO_ROOT, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def pid_1(self) -> int:
        """The container's PID 1 as this machine sees it: the child of `unshare --pid --fork`."""
        (child,) = psutil.Process(self.proc.pid).children()
        return child.pid

    def finish(self, timeout: float = 300) -> str:
        self.proc.wait(timeout=timeout)
        return self.log.read_text()


def pods(manifest: Path, root: Path, bucket: str, data: Path, env: dict, *sets: str) -> list[Pod]:
    """The manifest's pods, index 0..N-1, their args made runnable on this CPU (the module docstring says how)."""
    port, made = str(free_port()), []
    for index in range(job_spec(manifest)["completions"]):
        argv = []
        for arg in container(manifest)["command"] + container(manifest)["args"]:
            flag, _, value = arg.partition("=")
            if flag == "--config":
                arg = "--config=demo"
            elif flag == "--gpus":
                argv.append("--cpu")
                arg = "--gpus=1"
            elif flag == "--main-port":
                arg = f"--main-port={port}"
            elif flag == "--set" and value.startswith("gcs_bucket="):
                arg = f"--set=gcs_bucket={bucket}"
            elif flag == "--set" and value.startswith("data_dir="):
                arg = f"--set=data_dir={data}"
            argv.append(arg)
        out = root / f"pod-{index}" / "runs"
        argv += [f"--set={s}" for s in SETS + list(sets)] + ["--", "--output-dir", str(out)]
        pod_env = {e["name"]: e["value"] for e in container(manifest)["env"]}
        made.append(Pod(index, argv, dict(env, **pod_env, JOB_COMPLETION_INDEX=str(index)), out))
        out.parent.mkdir(parents=True)
    return made


def wait_for_steps(out: Path, running: list[Pod], steps: int, timeout: float = 240) -> None:
    rows, deadline = out / "logs" / "metrics.jsonl", time.time() + timeout
    while not (rows.exists() and rows.read_text().count('"loss"') >= steps):
        for pod in running:
            assert pod.proc.poll() is None, pod.log.read_text()[-3000:]
        assert time.time() < deadline, running[0].log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.slow
def test_two_pods_train_stop_on_a_preemption_with_a_checkpoint_and_a_new_set_resumes_to_the_same_weights(
        tmp_path, gcs_emulator, subprocess_env):
    """The Indexed Job's 2 pods rendezvous at pod 0's DNS name and train (world size 2, one CPU process each);
    pod 1 is preempted (SIGTERM to its PID 1): every rank stops at one step, pod 0 writes the checkpoint into the
    bucket, both exit 143 within the grace period. The JobSet's 2 pods then start on empty disks, resume from the
    bucket and end with the weights of an uninterrupted 2-rank run."""
    if os.getuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare: each pod is PID 1 of its own PID namespace, with its own /etc/hosts")
    data = make_shards(tmp_path / "data")
    env = dict(subprocess_env, STORAGE_EMULATOR_HOST=gcs_emulator.url)
    ref = tmp_path / "ref"
    run(["torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), str(REPO_ROOT / "train.py"),
         "--config", "demo", "--output-dir", str(ref), "--data-dir", str(data)]
        + [w for s in SETS for w in ("--set", s)], dict(subprocess_env, ACCELERATE_USE_CPU="true"))

    first = pods(INDEXED_JOB, tmp_path / "job", gcs_emulator.bucket, data,
                 dict(env, NEOX_DEBUG_STEP_DELAY_S="0.5"))  # slow steps: the preemption comes mid-run
    for pod in first:
        pod.start(pod_0_dns_name(INDEXED_JOB))
    try:
        wait_for_steps(first[0].out, first, steps=3)
        os.kill(first[1].pid_1(), signal.SIGTERM)  # pod 1's node is preempted: the kubelet's SIGTERM
        sent = time.monotonic()
        logs = [pod.finish() for pod in first]
        took = time.monotonic() - sent
    finally:
        for pod in first:
            if pod.proc.poll() is None:
                os.killpg(pod.proc.pid, signal.SIGKILL)
    assert [pod.proc.returncode for pod in first] == [STOPPED, STOPPED], [log[-3000:] for log in logs]
    assert took < job_spec(INDEXED_JOB)["template"]["spec"]["terminationGracePeriodSeconds"]
    for pod, log in zip(first, logs):  # the rank from JOB_COMPLETION_INDEX, pod 0 by its DNS name
        assert f"--machine_rank {pod.index} --main_process_ip {pod_0_dns_name(INDEXED_JOB)} " in log, log[-3000:]
    assert "2 process(es) on cpu" in logs[0]
    assert "SIGTERM received: asking 1 training process(es) to checkpoint" in logs[1], logs[1][-3000:]
    stop = re.search(r"^start_training\.sh: stopped by a signal on another rank after step (\d+); checkpoint \S+",
                     logs[0], re.M)
    assert stop, logs[0][-3000:]
    step = int(stop.group(1))
    assert 3 <= step < 8 and max(train_rows(first[0].out)) == step
    names = [b.name for b in gcs_emulator.client().list_blobs(gcs_emulator.bucket)]
    run_name = dict(s.split("=", 1) for s in args(INDEXED_JOB)["--set"])["run_name"]
    assert any(re.fullmatch(rf"checkpoints/{run_name}/checkpoint-epoch\d+-step{step}-files\d+/manifest\.json", n)
               for n in names), names
    assert leftovers(str(tmp_path / "job")) == []  # a PID namespace ends with its PID 1

    second = pods(JOBSET, tmp_path / "jobset", gcs_emulator.bucket, data, env)  # new pods, empty disks
    for pod in second:
        pod.start(pod_0_dns_name(JOBSET))
    try:
        logs = [pod.finish() for pod in second]
    finally:
        for pod in second:
            if pod.proc.poll() is None:
                os.killpg(pod.proc.pid, signal.SIGKILL)
    assert [pod.proc.returncode for pod in second] == [0, 0], [log[-3000:] for log in logs]
    assert re.search(rf"^resume: downloading gs://{gcs_emulator.bucket}/checkpoints/{run_name}/\S+-step{step}-",
                     logs[0], re.M), logs[0][-3000:]
    assert f"at step {step} " in logs[0]
    assert "start_training.sh: finished after step 8" in logs[0]
    expected = load_weights(ref / "final_model" / "model.safetensors")
    got = load_weights(second[0].out / "final_model" / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
