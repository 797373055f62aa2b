"""A real SLURM cluster on this machine for the whole test session (scripts/cluster.sh): a controller and four
compute nodes, each a network namespace with its own slurmd, sshd and node-local folder, and one shared folder.

The fixture brings it up once and takes it down at the end of the session (a cluster that was already up
when the session began is left up). Where the machine cannot hold it (not root, a package or a kernel
feature missing: cluster.sh exits 3), every test here skips with cluster.sh's own message; any other
failure to come up fails the tests."""

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
from helpers import REPO, child_env

SCRIPT = os.path.join(REPO, "scripts", "cluster.sh")
NODES = 4
PYTHON = sys.executable


@dataclass
class Cluster:
    dir: str
    shared: str  # the same files on every node and here
    local: str  # the same path on every node, each node's own folder behind it
    env: dict = field(default_factory=dict)  # for sbatch / srun here, and inherited by the jobs (--export=ALL)

    def run(self, *args, timeout=60, check=True, **kw):
        r = subprocess.run(args, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{shlex.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def cluster(self, *args, timeout=120, check=True):
        """scripts/cluster.sh ARGS (lose, revive, exec, status)."""
        return self.run("bash", SCRIPT, *args, timeout=timeout, check=check)

    def sbatch(self, *args, env=None, cwd=None):
        """Submit; return the job id."""
        r = self.run("sbatch", "--parsable", *args, env=env or self.env, cwd=cwd or self.shared)
        return r.stdout.strip().split(";")[0]

    def states(self, job):
        """{job or array task id: state} from the controller (finished jobs stay for MinJobAge)."""
        r = self.run("scontrol", "-o", "show", "job", job, check=False)
        out = {}
        for line in r.stdout.splitlines():
            jid = re.search(r"\bJobId=(\d+)", line).group(1)
            array = re.search(r"\bArrayJobId=(\d+) ArrayTaskId=(\S+)", line)
            state = re.search(r"\bJobState=(\S+)", line).group(1)
            out[f"{array.group(1)}_{array.group(2)}" if array else jid] = state
        return out

    def wait(self, job, timeout):
        """Wait until every task of the job has ended; return {task: state}."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.states(job)
            if states and all(s not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") for s in states.values()):
                return states
            if time.monotonic() > deadline:
                self.run("scancel", job, check=False)
                raise AssertionError(f"job {job} still running after {timeout} s: {states}")
            time.sleep(1)

    def requeue(self, job):
        """scontrol requeue, made eligible at once: SLURM holds a requeued job back about 2 minutes. Not within
        the second its tasks ended: slurmd revokes a finished job's credential by its id, compared in whole
        seconds, and a task of the same job started in that second is killed as "Job credential revoked"
        (slurmctld.log; it failed this test once in CI and once in four runs here)."""
        time.sleep(2)
        self.run("scontrol", "requeue", job)
        self.run("scontrol", "update", f"JobId={job}", "StartTime=now")

    def job_env(self, **extra):
        return dict(self.env, **extra)


def _base_env(slurm_conf):
    """Environment for sbatch / srun and the jobs: this checkout and its Python first, one OpenMP thread,
    SLURM_CONF, and none of the variables of a SLURM job this session itself may run in."""
    env = child_env(SLURM_CONF=slurm_conf)
    env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env["PATH"]
    for k in list(env):
        if k.startswith("SLURM_") and k != "SLURM_CONF":
            env.pop(k)
    return env


@pytest.fixture(scope="session")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the cluster needs root (namespaces, links and daemons): run the tests as root")
    was_up = subprocess.run(["bash", SCRIPT, "status"], capture_output=True).returncode == 0
    r = subprocess.run(["bash", SCRIPT, "up", str(NODES)], capture_output=True, text=True, timeout=300)
    if r.returncode == 3:
        pytest.skip(f"this machine cannot hold the test cluster:\n{r.stderr.strip()}")
    if r.returncode != 0:
        subprocess.run(["bash", SCRIPT, "down"], capture_output=True, timeout=120)
        pytest.fail(f"scripts/cluster.sh up {NODES} failed ({r.returncode}):\n{r.stderr}")
    env_lines = subprocess.run(["bash", SCRIPT, "env"], capture_output=True, text=True, check=True).stdout
    variables = dict(re.findall(r"^export (\w+)=(\S+)$", env_lines, re.M))
    c = Cluster(
        dir=variables["AIDAPTIV_CLUSTER_DIR"],
        shared=variables["AIDAPTIV_CLUSTER_SHARED"],
        local=variables["AIDAPTIV_CLUSTER_LOCAL"],
    )
    c.env = _base_env(variables["SLURM_CONF"])
    try:
        yield c
    finally:
        subprocess.run(["scancel", "--user", "root"], env=c.env, capture_output=True, timeout=30)
        if not was_up:
            subprocess.run(["bash", SCRIPT, "down"], capture_output=True, timeout=120)
            assert leftovers(c.dir) == [], "scripts/cluster.sh down left these behind"


def leftovers(cluster_dir):
    """What of a cluster is still there: its namespaces, links, daemons, mounts and state folder."""
    found = [f"namespace {ln.split()[0]}" for ln in _out("ip", "netns", "list") if ln.startswith("aidc-")]
    found += [f"link {ln.split(': ')[1].split('@')[0]}" for ln in _out("ip", "-o", "link") if ": aidc-" in ln]
    found += [f"process {ln.strip()}" for ln in _out("ps", "-eo", "pid,args") if cluster_dir in ln]
    found += [f"mount {ln}" for ln in _out("findmnt", "-rn", "-o", "TARGET") if ln.startswith(cluster_dir)]
    return found + ([f"folder {cluster_dir}"] if os.path.exists(cluster_dir) else [])


def _out(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()
