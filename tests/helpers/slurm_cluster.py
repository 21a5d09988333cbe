"""A throw-away single-node Slurm cluster for the tests: private munged (own key and socket), slurmctld and slurmd
in the foreground on free ports, with all state in one temp folder, so it never touches a system Slurm or munge.

Also holds `PauseForSignal`, a callback that jobs load with `--trainer.callbacks+=tests.helpers.slurm_cluster.PauseForSignal`
so that a test can deliver SIGUSR1 at a known point of training (the end of an epoch).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("sbatch", "scontrol", "sinfo", "slurmctld", "slurmd", "munged", "mungekey")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


def missing_binaries() -> list[str]:
    """Slurm and munge programs the cluster needs that are not installed (`.ci/install_slurm.sh` installs them)."""
    return [b for b in DAEMONS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def free_memory_mb() -> int:
    """MemAvailable in MiB (slurmd refuses a node that claims more RealMemory than it has)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 2048


SLURM_CONF = """\
ClusterName=persragtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
# private munged socket; cred_expire is also how long a requeued job waits before it may start again (120 s default)
AuthInfo=socket={root}/munge/munge.sock,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=3600
InactiveLimit=0
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldDebug=info
SlurmdDebug=info
NodeName={host} CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """Handles of a running test cluster; `env` points the Slurm commands (and jobs) at its slurm.conf."""

    root: Path
    conf: Path
    cpus: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment minus any outer Slurm job's variables, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        return {**env, "SLURM_CONF": str(self.conf)}

    def command(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        out = subprocess.run([_binary(args[0]), *args[1:]], env=self.env, capture_output=True, text=True,
                             timeout=timeout, check=False)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}\n{self.logs()}")
        return out.stdout

    def sbatch(self, *args: str, cwd: str | Path, env: dict[str, str] | None = None) -> str:
        """Submit and return the job id (the array's id for --array)."""
        out = subprocess.run([_binary("sbatch"), "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                             capture_output=True, text=True, timeout=30, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job -o` of a job (one record per array task), as key → value."""
        out = self.command("scontrol", "show", "job", "-o", job_id)
        return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.splitlines() if line]

    def wait(self, job_id: str, timeout: float = 300, until=lambda jobs: all(
            j["JobState"] in FINISHED for j in jobs)) -> list[dict[str, str]]:
        """Poll until `until(records)` holds; on timeout, raise with the job records and daemon logs."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs(job_id)
            if jobs and until(jobs):
                return jobs
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} after {timeout:.0f} s: {jobs}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, lines: int = 30) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
            path = self.root / name
            if path.exists():
                tails.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(tails)

    def stop(self, remove: bool = True) -> None:
        """Cancel what is left, stop the daemons (slurmd first, each with a bounded wait), remove the folder."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run([_binary("scancel"), "--full", "--user=root"], env=self.env, capture_output=True,
                           timeout=10, check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def _start(cluster: SlurmCluster, name: str, *args: str) -> None:
    with open(cluster.root / f"{name}.out", "w") as log:  # the daemon keeps its own copy of the descriptor
        cluster.procs[name] = subprocess.Popen([_binary(name), *args], env=cluster.env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(what: str, ok, cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                out = (cluster.root / f"{name}.out").read_text(errors="replace")
                raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{out}\n"
                                   f"{cluster.logs()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:.0f} s\n{cluster.logs()}")
        time.sleep(0.3)


def start_munge(cluster: SlurmCluster, timeout: float) -> None:
    """A private munged for the cluster: its own key and socket under the cluster's folder, never the system's."""
    root = cluster.root
    key = root / "munge" / "munge.key"
    subprocess.run([_binary("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True,
                   timeout=30)
    key.chmod(0o600)
    _start(cluster, "munged", "--foreground", f"--socket={root}/munge/munge.sock", f"--key-file={key}",
           f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munge/munged.log",
           f"--seed-file={root}/munge/munged.seed")
    _wait_for("munge socket", (root / "munge" / "munge.sock").exists, cluster, timeout)


def start_cluster(cpus: int | None = None, timeout: float = 60) -> SlurmCluster:
    """Write slurm.conf into a fresh temp folder, start munged, slurmctld and slurmd (as root), and wait until
    `sinfo` shows the node idle. Every path component of munged's socket must be world-executable, hence a
    0755 folder directly under the temp dir (pytest's own tmp folders are 0700)."""
    if os.geteuid() != 0:
        raise PermissionError("the test cluster runs its daemons as root (SlurmUser=root)")
    root = Path(tempfile.mkdtemp(prefix="persrag-slurm-"))
    root.chmod(0o755)
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o755)
    cpus = cpus or os.cpu_count() or 2
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, root=root, cpus=cpus, ctld_port=free_port(), d_port=free_port(),
                                      memory=max(512, min(8192, free_memory_mb() // 2))))
    cluster = SlurmCluster(root, conf, cpus)
    try:
        start_munge(cluster, timeout)
        _start(cluster, "slurmctld", "-D", "-i", "-f", str(conf))
        _start(cluster, "slurmd", "-D", "-f", str(conf))

        def node_idle() -> bool:
            out = subprocess.run([_binary("sinfo"), "-h", "-N", "-o", "%t"], env=cluster.env, capture_output=True,
                                 text=True, timeout=10, check=False)
            return out.returncode == 0 and out.stdout.strip() == "idle"

        _wait_for("idle node in sinfo", node_idle, cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


# ---- loaded inside Slurm jobs ---------------------------------------------------------------------------------------

try:
    import lightning as L
except ImportError:  # the cluster helpers above need no Lightning
    L = None

if L is not None:
    from lightning.pytorch.callbacks import Checkpoint

    class PauseForSignal(Checkpoint):
        """At the end of epoch `epoch` of a job's first attempt, touch `marker` and wait (at most `timeout` s)
        until the job is signalled; a requeued attempt (SLURM_RESTART_COUNT > 0) never pauses. The test sends
        SIGUSR1 once the marker exists, so Lightning's handler saves its hpc checkpoint at an epoch boundary,
        the one place where a resume is exact. A Checkpoint subclass because Lightning runs those after the
        other callbacks, in order: this one after ModelCheckpoint has saved the epoch, so the hpc checkpoint is
        the newest one and the requeued job must resume from it."""

        def __init__(self, marker: str, epoch: int = 0, timeout: float = 120.0) -> None:
            self.marker, self.epoch, self.timeout = Path(marker), epoch, timeout

        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.current_epoch != self.epoch or int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
                return
            self.marker.write_text(f"{os.getpid()}\n")
            deadline = time.monotonic() + self.timeout
            while not trainer.received_sigterm and time.monotonic() < deadline:
                time.sleep(0.1)
