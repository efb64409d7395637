"""A real one-node Slurm cluster on localhost for the tests: munged, slurmctld and slurmd (Debian's `slurmctld`,
`slurmd`, `slurm-client` and `munge`: `apt-get install slurmctld slurmd slurm-client munge` as root), with a generated
slurm.conf in a folder of its own (its own munge key and socket, its own ports: nothing of the machine's is touched):
proctrack/linuxproc, task/none, select/cons_tres, a `low` (default) and a `high` partition with
preempt/partition_prio and PreemptMode=REQUEUE (a preempted `low` job's tasks get SIGTERM at once and 60 s,
its GraceTime, to checkpoint before SIGKILL), `cred_expire=10` (a requeued job waits that long before it
starts again, not the default 120 s), and count-only GPUs (gres) so that scripts asking for GPUs
are scheduled on a CPU machine. `SlurmCluster.start()` raises `SlurmUnavailable` with one line saying why
where it cannot start (not root, not installed, a daemon that does not come up)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import free_port

PACKAGES = "slurmctld slurmd slurm-client munge"


class SlurmUnavailable(Exception):
    pass


class SlurmCluster:
    NODE = "neox1"

    def __init__(self, root: Path, cpus: int = 64, gpus: int = 8):
        self.root, self.cpus, self.gpus = Path(root), cpus, gpus
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.sock"
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict:
        """What a client command (sbatch, squeue, scontrol, scancel) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise SlurmUnavailable("needs root to run slurmd")
        missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(b)]
        if missing:
            raise SlurmUnavailable(f"{', '.join(missing)} not installed (as root: apt-get install {PACKAGES})")
        munge_dir = self.root / "munge"
        for sub in ("state", "spool", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(munge_dir, 0o711)  # munged: the socket's folder searchable by all
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self._daemon(["munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
                      f"--log-file={munge_dir / 'munged.log'}", f"--pid-file={munge_dir / 'munged.pid'}",
                      f"--seed-file={munge_dir / 'munged.seed'}"], "munged")
        self._wait(lambda: self.socket.exists(), "munged did not create its socket", 20)
        self.conf.write_text(self._slurm_conf())
        devices = self.root / "dev"  # stand-ins for /dev/nvidiaN (character devices): slurmd counts their files
        devices.mkdir(exist_ok=True)
        for i in range(self.gpus):
            (devices / f"gpu{i}").symlink_to("/dev/null")
        (self.root / "gres.conf").write_text(f"AutoDetect=off\nNodeName={self.NODE} Name=gpu "
                                             f"File={devices}/gpu[0-{self.gpus - 1}]\n")
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld", env)
        self._daemon(["slurmd", "-D", "-N", self.NODE, "-f", str(self.conf)], "slurmd", env)
        self._wait(self._node_idle, "the node did not come up", 60)
        return self

    def _slurm_conf(self) -> str:
        r = self.root
        return "\n".join([
            "ClusterName=neoxtest", f"SlurmctldHost={socket.gethostname()}(127.0.0.1)", "SlurmUser=root",
            "SlurmdUser=root", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket},cred_expire=10",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin", "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE", "JobRequeue=1", "ReturnToService=2", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SlurmdParameters=config_overrides", "GresTypes=gpu", "InactiveLimit=0", "KillWait=120",
            "MinJobAge=3600", "SlurmctldTimeout=60", "SlurmdTimeout=300", "MessageTimeout=30",
            "SchedulerParameters=sched_interval=2", "OverTimeLimit=0",
            f"NodeName={self.NODE} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory=4000 Gres=gpu:{self.gpus} State=UNKNOWN",
            "PartitionName=low Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60",
            "PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10", ""])

    def _daemon(self, cmd: list[str], name: str, env=None) -> None:
        log = open(self.root / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or os.environ,
                                           start_new_session=True))

    def _node_idle(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{proc.args[0]} exited {proc.returncode}: {self._tail(proc.args[0])}")
        states = set(self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split())  # one per partition
        return bool(states) and states <= {"idle", "mixed", "allocated"}

    def _tail(self, name: str) -> str:
        for path in (self.root / f"{name}.out", self.root / f"{name}.log"):
            if path.exists() and path.read_text().strip():
                return path.read_text().strip().splitlines()[-1]
        return "(no log)"

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while not ready():
            if time.time() > deadline:
                raise SlurmUnavailable(f"{what} within {timeout:g} s (logs in {self.root})")
            time.sleep(0.5)

    def run(self, cmd: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=dict(kwargs.pop("env", os.environ), **self.env), capture_output=True,
                              text=True, timeout=60, **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(part.split("=", 1) for part in out.split() if "=" in part)

    def stop(self) -> None:
        """Cancels every job, kills what is left of them (processes with this cluster's SLURM_CONF), stops the
        daemons."""
        if self.procs and self.procs[-1].poll() is None:
            self.run(["scancel", "--full", "--user", "root"], check=False)
            deadline = time.time() + 60
            while self.run(["squeue", "-h"], check=False).stdout.strip() and time.time() < deadline:
                time.sleep(1)
        marker = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and int(proc.name) != os.getpid() and marker in (proc / "environ").read_bytes():
                    os.kill(int(proc.name), 9)
            except OSError:
                pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
