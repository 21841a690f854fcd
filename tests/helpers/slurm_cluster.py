"""A real two-node Slurm cluster on this machine, for the tests: Debian's Slurm 22.05 daemons,
two "hosts" that are Linux network namespaces on a bridge, no systemd.

    with SlurmCluster(tmp_dir) as cluster:
        cluster.run("sbatch", "job.sh")          # clients read cluster.env (SLURM_CONF, ...)

What it builds (everything under `tmp_dir`, everything removed on exit):
- a bridge in the root namespace holding the controller's address, and one namespace per node
  with a veth whose inner end is called `eth0` in both, so one GLOO_SOCKET_IFNAME=eth0
  serves every rank; the addresses are a private /24 used only between these three;
- a private `munged` (its own key and socket), one `slurmctld` in the root namespace and one
  `slurmd -N nodeK` inside each namespace (entered with nsenter: `ip netns exec` remounts
  /sys, and slurmd's set-up then fails), each node one CPU;
- `cred_expire=5`, so a requeued job can start again after seconds instead of two minutes.

The daemons run in the foreground as our children, so we can wait on them (a daemon that
exits is a zombie until reaped, and `kill -0` still finds it). On exit: jobs cancelled
first (slurmd waits for running steps), then the daemons by pid, then the network.

`python tests/helpers/slurm_cluster.py DIR` brings one up and keeps it until ctrl-C, with the
variables to export printed: for trying a job by hand.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

NODES = ("node1", "node2")
INTERFACE = "eth0"  # the node side of each veth, in its namespace
REQUIRED = (
    "slurmctld",
    "slurmd",
    "munged",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
    "nsenter",
    "ip",
)


def missing_commands() -> list[str]:
    return [c for c in REQUIRED if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def install_hint() -> str:
    return "apt-get install slurm-wlm munge (Debian's Slurm 22.05), as root"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _subnet() -> str:
    """A 10.X.Y.0/24 no interface here uses yet (X, Y from our pid: two test runs at once
    get two networks)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for k in range(200):
        n = (os.getpid() + k) % 250
        prefix = f"10.{233 + n // 250}.{n}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.233.x.0/24 subnet for the test cluster")


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class SlurmCluster:
    def __init__(self, root: Path, *, kill_wait: int = 30, slurmd_timeout: int = 10):
        self.root = Path(root)
        self.kill_wait, self.slurmd_timeout = kill_wait, slurmd_timeout
        tag = f"{os.getpid() % 100000}"
        self.bridge = f"aapbr{tag}"
        self.namespaces = {node: f"aap{tag}-{node}" for node in NODES}
        self.veths = {node: f"aapv{tag}{i}" for i, node in enumerate(NODES)}
        prefix = _subnet()
        self.controller_addr = f"{prefix}.1"
        self.addresses = {node: f"{prefix}.{11 + i}" for i, node in enumerate(NODES)}
        self.conf = self.root / "slurm.conf"
        self.env: dict[str, str] = {}
        self._daemons: dict[str, subprocess.Popen] = {}

    # -- set-up ----------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self._network()
            self._munge()
            self._write_conf()
            self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for node, ns in self.namespaces.items():
                self._start(
                    f"slurmd-{node}",
                    [
                        "nsenter",
                        f"--net=/run/netns/{ns}",
                        "slurmd",
                        "-D",
                        "-N",
                        node,
                        "-f",
                        str(self.conf),
                    ],
                )
            self.wait_idle(NODES, timeout=60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _network(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.controller_addr}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node, ns in self.namespaces.items():
            veth = self.veths[node]
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _sh("ip", "link", "set", veth, "master", self.bridge)
            _sh("ip", "link", "set", veth, "up")
            _sh("ip", "link", "set", f"{veth}p", "netns", ns)
            inside = ("ip", "netns", "exec", ns, "ip")
            _sh(*inside, "link", "set", f"{veth}p", "name", INTERFACE)
            _sh(*inside, "addr", "add", f"{self.addresses[node]}/24", "dev", INTERFACE)
            _sh(*inside, "link", "set", INTERFACE, "up")
            _sh(*inside, "link", "set", "lo", "up")

    def _munge(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(parents=True)
        munge.chmod(0o711)  # clients reach the socket through it
        # munged refuses a key readable by others, and a world-writable directory above it
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = munge / "munge.socket.2"
        self._start(
            "munged",
            [
                "munged",
                "-F",
                "-f",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not create {self.munge_socket}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir()
        hostname = socket.gethostname()
        nodes = "\n".join(
            f"NodeName={node} NodeHostname={hostname} NodeAddr={addr} CPUs=1 State=UNKNOWN"
            for node, addr in self.addresses.items()
        )
        self.conf.write_text(f"""\
ClusterName=allattn
SlurmctldHost={hostname}({self.controller_addr})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
CredType=cred/munge
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "spool"}/slurmd-%n.pid
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log"}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
KillWait={self.kill_wait}
MinJobAge=600
{nodes}
PartitionName=cpu Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        path = os.environ.get("PATH", "")
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": path if "/usr/sbin" in path else f"{path}:/usr/sbin",
        }

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self._daemons[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env or None
        )
        log.close()

    def _check_alive(self) -> None:
        for name, proc in self._daemons.items():
            if proc.poll() is not None:
                out = (self.root / f"{name}.out").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{out}")

    # -- use -------------------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        result = subprocess.run(
            cmd,
            env=kw.pop("env", self.env),
            capture_output=True,
            text=True,
            timeout=kw.pop("timeout", 60),
            **kw,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)}: exit {result.returncode}\n{result.stdout}{result.stderr}"
            )
        return result

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, nodes=NODES, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                states = self.node_states()
            except (RuntimeError, subprocess.TimeoutExpired):
                states = {}
            if all(states.get(n) == "idle" for n in nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes not idle after {timeout} s: {states}\n{self.logs()}")

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        fields = {}
        for item in out.split():
            key, eq, value = item.partition("=")
            if eq:
                fields[key] = value
        return fields

    def wait_job(self, job_id: str, until, timeout: float, what: str) -> dict[str, str]:
        """Poll the job until `until(fields)` holds."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if until(fields):
                return fields
            time.sleep(0.25)
        raise AssertionError(
            f"job {job_id}: not {what} after {timeout} s: "
            f"{fields.get('JobState')} {fields.get('Reason')}\n{self.logs()}"
        )

    def exec_in(self, node: str, *cmd: str) -> list[str]:
        """`cmd` run inside `node`'s network namespace (as slurmd runs there)."""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[node]}", *cmd]

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(
                f"--- {path.name} (tail)\n"
                + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
            )
        return "\n".join(parts)

    # -- tear-down -------------------------------------------------------------------------

    def cancel_all(self, timeout: float = 15) -> None:
        """Cancel every job and wait (up to `timeout`) until the queue is empty."""
        self.run("scancel", "--full", "--user", "root", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", check=False).stdout.strip():
                break
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            self.cancel_all()  # every job, so that slurmd does not wait for running steps
        for name in reversed(list(self._daemons)):  # slurmd, slurmctld, then munged
            proc = self._daemons[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for node, ns in self.namespaces.items():
            # whatever still runs in a node (a job step) goes with it
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "link", "del", self.veths[node]], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


if __name__ == "__main__":
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/allattn-slurm")
    directory.mkdir(parents=True, exist_ok=False)
    with SlurmCluster(directory) as cluster:
        print(f"export SLURM_CONF={cluster.conf}  # nodes: {cluster.addresses}", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
