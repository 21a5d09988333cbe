"""A throw-away two-node Slurm cluster on one machine: slurmctld and munged in the host's network namespace, one
slurmd per node in a network namespace of its own (a veth pair onto a private bridge, its own address, hostname,
spool and log), all state in one temp folder. Nothing leaves the machine: the addresses live on the bridge and in the
namespaces this module creates, and `stop` removes them (and the leftovers of a killed earlier run).

`crash(node)` takes a node off the network and SIGKILLs every process in its namespace (slurmd, slurmstepd, the
job's tasks), as a power cut would; `revive(node)` brings it back. Jobs load `RecordRanks` and `PauseMidEpoch`
(below) with `--trainer.callbacks+=...`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.slurm_cluster import (
    SlurmCluster,
    _binary,
    _start,
    _wait_for,
    free_memory_mb,
    free_port,
    start_munge,
)

PREFIX = "prs"  # every namespace, link and /etc/netns folder of this module starts with it (and holds the pid)
NETNS_ETC = Path("/etc/netns")

SLURM_CONF = """\
ClusterName=persragmulti
SlurmctldHost={ctl_host}({ctl_addr})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
# private munged socket (a path: reachable from every network namespace); cred_expire: see tests/helpers/slurm_cluster.py
AuthInfo=socket={root}/munge/munge.sock,cred_expire=5
StateSaveLocation={root}/state
# one spool, pid file and log per node: the slurmds share the file system and the process table
SlurmdSpoolDir={root}/spool-%n
SlurmdPidFile={root}/slurmd-%n.pid
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
# a node that was down (crashed) rejoins by itself when its slurmd registers again
ReturnToService=2
JobRequeue=1
# small timeouts so that a crashed node is declared down, and its job requeued, in seconds
SlurmdTimeout={slurmd_timeout}
KillWait=2
MinJobAge=3600
InactiveLimit=0
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""


def netns_unavailable() -> str | None:
    """Why this machine cannot host the cluster (None when it can): root and iproute2 are needed."""
    if os.geteuid() != 0:
        return "network namespaces, veth pairs and a bridge need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed; `bash .ci/install_slurm.sh` installs it"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` (util-linux) is not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def _remove_netns(netns: str) -> None:
    """SIGKILL what still runs in the namespace (a namespace outlives its name while a process is in it), then
    delete it and its hosts file."""
    for _ in range(20):
        pids = netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    _ip("netns", "del", netns, check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


class NetworkUnavailable(RuntimeError):
    """The namespaces were made, but the machine's firewall keeps them from talking to each other."""


PROBE_SERVER = ("import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); "
                "s.settimeout(15); c, _ = s.accept(); c.sendall(b'ok')")
PROBE_CLIENT = ("import socket, sys, time\ndeadline = time.monotonic() + 8\nwhile time.monotonic() < deadline:\n"
                "    try:\n        print(socket.create_connection((sys.argv[1], int(sys.argv[2])), 2).recv(2).decode())\n"
                "        break\n    except OSError:\n        time.sleep(0.1)")


def check_bridge(a: Node, b: Node) -> None:
    """A TCP connection from node a's namespace to node b's address, through the bridge (srun and gloo need it)."""
    import sys

    port = 7000 + os.getpid() % 1000
    server = subprocess.Popen(["nsenter", f"--net=/run/netns/{b.netns}", sys.executable, "-c", PROBE_SERVER,
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run(["nsenter", f"--net=/run/netns/{a.netns}", sys.executable, "-c", PROBE_CLIENT, b.addr,
                              str(port)], capture_output=True, text=True, timeout=30, check=False)
    finally:
        server.kill()
        server.wait(timeout=5)
    if out.stdout.strip() != "ok":
        raise NetworkUnavailable(
            f"{a.name} cannot reach {b.name} ({b.addr}) through the test bridge: bridged traffic is filtered here "
            "(net.bridge.bridge-nf-call-iptables=1 with a FORWARD policy of DROP, as Docker sets, does that)")


def remove_leftovers() -> list[str]:
    """Namespaces, bridges and /etc/netns folders of earlier runs whose process is gone (a killed pytest)."""
    pattern = re.compile(rf"^{PREFIX}(\d+)")
    removed = []
    names = set(_ip("netns", "list", check=False).stdout.split())
    names |= {p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set()
    for name in sorted(names):
        m = pattern.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _remove_netns(name)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        m = pattern.match(link)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", link, check=False)
            removed.append(link)
    if NETNS_ETC.is_dir() and not any(NETNS_ETC.iterdir()):
        NETNS_ETC.rmdir()
    return removed


def free_subnet() -> str:
    """A private /24 (10.250-253.x) that no route of this machine covers, as 'a.b.c' (the bridge is .1)."""
    routes = _ip("-4", "route", "show", "table", "all", check=False).stdout + _ip("-4", "addr").stdout
    used = set(re.findall(r"\b(10\.\d+\.\d+)\.\d+", routes))
    for i in range(1000):
        n = os.getpid() + i
        subnet = f"10.{250 + n % 4}.{(n // 4) % 256}"
        if subnet not in used:
            return subnet
    raise RuntimeError("no free 10.250-253.x.0/24 subnet")


@dataclass
class Node:
    name: str      # Slurm node name and hostname inside the namespace
    netns: str
    addr: str
    veth: str      # host end (on the bridge); the namespace's end is veth + "p"


@dataclass
class MultiNodeCluster(SlurmCluster):
    nodes: list[Node] = field(default_factory=list)
    bridge: str = ""

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start_slurmd(self, node: Node) -> None:
        """slurmd in the node's network namespace, with a UTS namespace whose hostname is the node's name (so
        gethostname() in jobs, and gloo's choice of address, see the node) and a mount namespace in which the
        node's hosts file covers /etc/hosts. nsenter, not `ip netns exec`: that remounts /sys, which hides
        /sys/fs/cgroup from slurmd."""
        hosts = NETNS_ETC / node.netns / "hosts"
        script = f'mount --bind {hosts} /etc/hosts && hostname {node.name} && exec "$0" -D -N {node.name} -f "$1"'
        with open(self.root / f"slurmd-{node.name}.out", "a") as log:  # the daemon keeps its own descriptor
            self.procs[f"slurmd-{node.name}"] = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount", "--propagation",
                 "private", "sh", "-c", script, _binary("slurmd"), str(self.conf)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def node_states(self) -> dict[str, str]:
        out = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_nodes(self, state: str, names: list[str] | None = None, timeout: float = 60) -> None:
        names = names or [n.name for n in self.nodes]
        _wait_for(f"{state} {names} in sinfo",
                  lambda: all(self.node_states().get(n, "").rstrip("*~#!%$@^-") == state for n in names),
                  self, timeout)

    def crash(self, name: str) -> list[int]:
        """A power cut: the node's link goes down first (its sockets die silently, as a dead host's do, so only
        slurmctld's missed pings reveal it), then every process in its namespace is SIGKILLed."""
        node = self.node(name)
        _ip("netns", "exec", node.netns, "ip", "link", "set", node.veth + "p", "down")
        pids = netns_pids(node.netns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = self.procs.pop(f"slurmd-{name}", None)
        if proc is not None:
            proc.wait(timeout=10)
        return pids

    def revive(self, name: str) -> None:
        """Link up and a fresh slurmd (ReturnToService=2 returns the node to service once it registers)."""
        node = self.node(name)
        _ip("netns", "exec", node.netns, "ip", "link", "set", node.veth + "p", "up")
        self.start_slurmd(node)

    def logs(self, lines: int = 30) -> str:
        tails = []
        for path in [self.root / "slurmctld.log", *sorted(self.root.glob("slurmd-*.log")),
                     *sorted(self.root.glob("slurmd-*.out")), self.root / "munge" / "munged.log"]:
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                tails.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def stop(self, remove: bool = True, keep_logs: Path | None = None) -> None:
        """Cancel what is left, stop the slurmds, slurmctld and munged, copy the daemons' logs to `keep_logs`, and
        remove namespaces, veths, bridge, hosts files and (with `remove`) the temp folder, whatever state a failed
        test left them in."""
        try:
            if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
                subprocess.run([_binary("scancel"), "--full", "--user=root"], env=self.env, capture_output=True,
                               timeout=10, check=False)
            for name in [*(f"slurmd-{n.name}" for n in self.nodes), "slurmctld", "munged"]:
                proc = self.procs.pop(name, None)
                if proc is None or proc.poll() is not None:
                    continue
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        finally:
            if keep_logs is not None:
                keep_logs.mkdir(parents=True, exist_ok=True)
                for path in [*self.root.glob("*.log"), *self.root.glob("*.out"), self.root / "slurm.conf"]:
                    shutil.copy(path, keep_logs / path.name)
            for node in self.nodes:
                _remove_netns(node.netns)
                _ip("link", "del", node.veth, check=False)
            if self.bridge:
                _ip("link", "del", self.bridge, check=False)
            if NETNS_ETC.is_dir() and not any(NETNS_ETC.iterdir()):
                NETNS_ETC.rmdir()
            if remove:
                shutil.rmtree(self.root, ignore_errors=True)


def start_multinode_cluster(nodes: int = 2, cpus: int | None = None, slurmd_timeout: int = 6,
                            timeout: float = 90) -> MultiNodeCluster:
    """A bridge with the controller's address, one namespace per node (loopback up, a veth onto the bridge,
    /etc/netns/<ns>/hosts naming every node and the controller), munged + slurmctld in the host namespace, one
    slurmd per namespace; returns once `sinfo` shows every node idle. Everything is removed again on failure."""
    why = netns_unavailable()
    if why:
        raise PermissionError(why)
    remove_leftovers()
    root = Path(tempfile.mkdtemp(prefix="persrag-slurm-multi-"))
    root.chmod(0o755)  # munged's socket path must be world-executable (see tests/helpers/slurm_cluster.py)
    for sub in ("state", "munge", *(f"spool-node{i}" for i in range(1, nodes + 1))):
        (root / sub).mkdir()
    (root / "munge").chmod(0o755)
    pid, subnet = os.getpid(), free_subnet()
    cpus = cpus or os.cpu_count() or 2
    ctl_host, ctl_addr = socket.gethostname().split(".")[0], f"{subnet}.1"
    members = [Node(f"node{i}", f"{PREFIX}{pid}n{i}", f"{subnet}.{10 + i}", f"{PREFIX}{pid}v{i}")
               for i in range(1, nodes + 1)]
    memory = max(512, min(4096, free_memory_mb() // (2 * nodes)))
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(
        ctl_host=ctl_host, ctl_addr=ctl_addr, root=root, ctld_port=free_port(), d_port=free_port(),
        slurmd_timeout=slurmd_timeout, node_list=",".join(n.name for n in members),
        nodes="\n".join(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} CPUs={cpus} "
                        f"RealMemory={memory} State=UNKNOWN" for n in members)))
    cluster = MultiNodeCluster(root, conf, cpus, nodes=members, bridge=f"{PREFIX}{pid}br")
    try:
        _ip("link", "add", cluster.bridge, "type", "bridge")
        _ip("addr", "add", f"{ctl_addr}/24", "dev", cluster.bridge)
        _ip("link", "set", cluster.bridge, "up")
        hosts = "".join(f"{n.addr} {n.name}\n" for n in members) + f"{ctl_addr} {ctl_host}\n127.0.0.1 localhost\n"
        for n in members:
            _ip("netns", "add", n.netns)
            _ip("link", "add", n.veth, "type", "veth", "peer", "name", n.veth + "p")
            _ip("link", "set", n.veth + "p", "netns", n.netns)
            _ip("link", "set", n.veth, "master", cluster.bridge)
            _ip("link", "set", n.veth, "up")
            for args in (("addr", "add", f"{n.addr}/24", "dev", n.veth + "p"), ("link", "set", n.veth + "p", "up"),
                         ("link", "set", "lo", "up")):
                _ip("netns", "exec", n.netns, "ip", *args)
            (NETNS_ETC / n.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / n.netns / "hosts").write_text(hosts)  # `ip netns exec` bind-mounts it over /etc/hosts
        check_bridge(members[0], members[-1])
        start_munge(cluster, timeout)
        _start(cluster, "slurmctld", "-D", "-i", "-f", str(conf))
        for n in members:
            cluster.start_slurmd(n)
        cluster.wait_nodes("idle", timeout=timeout)
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
    from lightning.pytorch.callbacks import Callback

    class RecordRanks(Callback):
        """Writes `<out>/<tag>-restart<n>-rank<r>.json` at every epoch end: where this rank ran (hostname, global,
        node and local rank, world size, master address and port, cluster environment, process-group backend)
        and the example ids of every training batch it saw, by epoch; the rank's weights when training starts and
        ends (`...-initial.pt`, `...-weights.pt`). Those, not last.ckpt: with a monitored metric, Lightning's `save_last` copies
        the newest top-k checkpoint, which is an older epoch's whenever the metric did not improve."""

        def __init__(self, out: str, tag: str = "run") -> None:
            self.out, self.tag = Path(out), tag
            self.seen: dict[int, list[list[str]]] = {}

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int):
            self.seen.setdefault(trainer.current_epoch, []).append(list(batch.example_ids))

        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self._write(trainer)

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self._save_weights(trainer, pl_module, "initial")

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self._write(trainer)
            self._save_weights(trainer, pl_module, "weights")

        def _save_weights(self, trainer: L.Trainer, pl_module: L.LightningModule, what: str) -> None:
            import torch

            self.out.mkdir(parents=True, exist_ok=True)
            restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
            torch.save({k: v.detach().cpu() for k, v in pl_module.state_dict().items()},
                       self.out / f"{self.tag}-restart{restart}-rank{trainer.global_rank}-{what}.pt")

        def _write(self, trainer: L.Trainer) -> Path:
            strategy = trainer.strategy
            env = strategy.cluster_environment
            record = {
                "hostname": socket.gethostname(), "global_rank": trainer.global_rank, "node_rank": trainer.node_rank,
                "local_rank": trainer.local_rank, "world_size": trainer.world_size, "num_nodes": trainer.num_nodes,
                "cluster_environment": type(env).__name__ if env is not None else None,
                "master": [getattr(env, "main_address", None), getattr(env, "main_port", None)],
                "backend": getattr(strategy, "process_group_backend", None),
                "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "global_step": trainer.global_step,
                "epochs": {str(e): b for e, b in sorted(self.seen.items())},
            }
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / f"{self.tag}-restart{record['restart']}-rank{trainer.global_rank}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(path)
            return path

    class PauseMidEpoch(Callback):
        """After batch `batch` of epoch `epoch` of a job's first attempt, touch `<marker>-rank<r>` (holding the
        hostname) and sleep (at most `timeout` s) so that the test can crash a node mid-epoch; a requeued attempt
        (SLURM_RESTART_COUNT > 0) never pauses."""

        def __init__(self, marker: str, epoch: int = 1, batch: int = 1, timeout: float = 300.0) -> None:
            self.marker, self.epoch, self.batch, self.timeout = marker, epoch, batch, timeout

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                               batch_idx: int) -> None:
            if (trainer.current_epoch, batch_idx) != (self.epoch, self.batch) or \
                    int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
                return
            Path(f"{self.marker}-rank{trainer.global_rank}").write_text(socket.gethostname())
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                time.sleep(0.2)
