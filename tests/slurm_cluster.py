"""A real single-node Slurm cluster on this machine, for tests/test_slurm_cluster.py.

`SlurmCluster.start()` installs Debian's `slurm-wlm` and `munge` with apt-get when they are
missing, then starts munged, slurmctld and slurmd on localhost: a generated slurm.conf with the
node that `slurmd -C` reports (the machine's CPUs and memory), proctrack/linuxproc and
task/none (no cgroups needed), no GRES. Everything it writes is in one temporary folder: its
own munge key and socket, ports picked free, state and spool, so a system Slurm or munge on the
same machine is left alone. `stop()` cancels the jobs, waits for them to end, stops the
daemons and removes the folder. Where the cluster cannot start (not root, no apt-get, the
install fails) `start()` raises `ClusterUnavailable` with a one-line reason; `start_for_tests`
turns that into a skip, or a failure where MEGATRON_LEV_REQUIRE_SLURM=1 (.ci/run sets it: CI
runs as root with apt-get, so there the cluster must start).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REQUIRE_VARIABLE = "MEGATRON_LEV_REQUIRE_SLURM"
PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Job states after which nothing of the job runs any more (squeue/scontrol's names).
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


class ClusterUnavailable(RuntimeError):
    """The cluster cannot start here; the message says why, in one line."""


def _which(program: str) -> str | None:
    return shutil.which(program, path=os.environ.get("PATH", "") + os.pathsep + SYSTEM_PATH)


def install_packages() -> float:
    """apt-get install slurm-wlm and munge when a program is missing; the seconds it took."""
    missing = [p for p in PROGRAMS if _which(p) is None]
    if not missing:
        return 0.0
    what = f"{', '.join(missing)} not installed"
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"{what}, and installing {' and '.join(PACKAGES)} needs root")
    if _which("apt-get") is None:
        raise ClusterUnavailable(f"{what}, and there is no apt-get to install {' and '.join(PACKAGES)}")
    start = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300"]
    for cmd in (apt + ["update"], apt + ["install", "-y", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
            raise ClusterUnavailable(f"{what}; `{' '.join(cmd)}` failed: {last}")
    still = [p for p in PROGRAMS if _which(p) is None]
    if still:
        raise ClusterUnavailable(f"{', '.join(still)} still missing after apt-get install {' '.join(PACKAGES)}")
    return time.monotonic() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the daemon's child process: SIGTERM when the test process dies (even killed), so
    an interrupted run leaves no daemon behind (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self.node = ""
        self.node_line = ""
        self.install_s = 0.0
        self.startup_s = 0.0

    # ------------------------------------------------------------------ start and stop
    @classmethod
    def start(cls, timeout: float = 120) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise ClusterUnavailable(f"not root (uid {os.geteuid()}): slurmctld and slurmd run as root here")
        install_s = install_packages()
        begin = time.monotonic()
        root = Path(tempfile.mkdtemp(prefix="megatron-lev-slurm-"))
        root.chmod(0o755)  # munged requires every folder above its socket to be searchable by all
        cluster = cls(root)
        cluster.install_s = install_s
        try:
            cluster._start_daemons(timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.startup_s = time.monotonic() - begin
        return cluster

    def _write_config(self) -> None:
        proc = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=60)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("NodeName=")), None)
        if proc.returncode != 0 or line is None:
            raise ClusterUnavailable(f"`slurmd -C` did not describe this machine: {proc.stderr.strip()[-200:]}")
        self.node_line = line
        self.node = line.split()[0].split("=", 1)[1]
        try:
            socket.gethostbyname(self.node)
        except OSError:
            raise ClusterUnavailable(f"this machine's name {self.node!r} does not resolve (torchrun's rendezvous "
                                     "and srun need it): add it to /etc/hosts") from None
        r = self.root
        for folder in ("state", "spool"):
            (r / folder).mkdir()
        self.conf.write_text(f"""\
ClusterName=megatronlevtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
{line.split(' UpTime=')[0]} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / f"{name}.out", "w")
        with out:
            self.daemons[name] = subprocess.Popen(cmd, env=self.env(), stdin=subprocess.DEVNULL, stdout=out,
                                                  stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def _start_daemons(self, timeout: float) -> None:
        r = self.root
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn("munged", [_which("munged"), "--foreground", f"--socket={r}/munge.socket",
                               f"--key-file={key}", f"--pid-file={r}/munged.pid", f"--seed-file={r}/munged.seed",
                               f"--log-file={r}/munged.log"])
        self._wait(lambda: (r / "munge.socket").exists(), 30, "munged's socket")
        self._write_config()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.node_state() == "idle", timeout, f"node {self.node} to be idle")

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"timed out after {timeout:.0f}s"
                raise ClusterUnavailable(f"waiting for {what}: {why}; logs in {self.root}\n{self.daemon_logs()}")
            time.sleep(0.2)

    def daemon_logs(self, lines: int = 15) -> str:
        return "\n".join(f"--- {path.name}\n{_tail(path, lines)}" for path in sorted(self.root.glob("*.out"))
                         + sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """Cancel every job, wait until the node has none, stop the daemons, remove the folder."""
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            jobs = self.client(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            if jobs:
                self.client(["scancel", *jobs], check=False)
            try:
                self._wait(lambda: not self.client(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
                           and self.node_state() == "idle", 90, "the jobs to end")
            except ClusterUnavailable:
                pass
        for name in ("slurmd", "slurmctld", "munged"):  # the reverse of the start order
            proc = self.daemons.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill_leftovers()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """Any process this cluster started that is still there (a job step's slurmstepd, a task
        that outlived its job): they all carry SLURM_CONF naming this cluster's file."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ clients
    def env(self, base: dict | None = None, **overrides) -> dict:
        """An environment for this cluster's commands: no other Slurm's variables, SLURM_CONF
        naming this cluster, Slurm's programs on PATH."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + SYSTEM_PATH
        env.update({k: str(v) for k, v in overrides.items()})
        return env

    def client(self, cmd: list[str], env: dict | None = None, check: bool = True, **kwargs):
        proc = subprocess.run(cmd, env=self.env(env), capture_output=True, text=True, timeout=60, **kwargs)
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(map(str, cmd))}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def node_state(self) -> str:
        proc = self.client(["sinfo", "-h", "-n", self.node or "x", "-o", "%t"], check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def sbatch(self, args: list, env: dict, cwd: Path | str) -> int:
        """Submit; the job id."""
        proc = self.client(["sbatch", "--parsable", *map(str, args)], env=env, cwd=cwd)
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as a dict (JobState, Reason, Restarts, ExitCode, ...)."""
        out = self.client(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_for(self, job_id: int, predicate, timeout: float, what: str, logs=lambda: "") -> dict:
        """Poll the job until predicate(job dict) holds; the job dict."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: timed out after {timeout:.0f}s waiting for {what} "
                                     f"(JobState={job.get('JobState')} Reason={job.get('Reason')})\n{logs()}")
            time.sleep(0.2)

    def wait_finished(self, job_id: int, timeout: float, logs=lambda: "") -> dict:
        return self.wait_for(job_id, lambda j: j.get("JobState") in FINISHED, timeout, "the job to end", logs)


def start_for_tests(report: list[str]) -> SlurmCluster:
    """SlurmCluster.start() for the `slurm_cluster` fixture: a line for the end of the run in
    `report` (the cluster and its start-up time, or why it did not start), and a skip, or under
    MEGATRON_LEV_REQUIRE_SLURM=1 a failure, when it cannot start."""
    import pytest

    try:
        cluster = SlurmCluster.start()
    except ClusterUnavailable as exc:
        reason = f"real Slurm cluster not started: {str(exc).splitlines()[0]}"
        report.append(reason)
        if os.environ.get(REQUIRE_VARIABLE) == "1":
            pytest.fail(f"{REQUIRE_VARIABLE}=1, and the {reason}\n{exc}", pytrace=False)
        pytest.skip(reason)
    installed = f"; {' and '.join(PACKAGES)} installed in {cluster.install_s:.0f}s" if cluster.install_s else ""
    report.append(f"real Slurm cluster ({cluster.node_line.split(' UpTime=')[0]}) up in {cluster.startup_s:.1f}s"
                  f"{installed}")
    return cluster
