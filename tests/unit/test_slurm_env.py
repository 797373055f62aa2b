"""A rank started by srun (by hand or DeepSpeed's --launcher slurm) takes RANK/WORLD_SIZE/LOCAL_RANK and the
rendezvous from SLURM's variables (aidaptiv_ds.job.rank_env); a fake environment stands in for srun."""

import os

import pytest

from aidaptiv_ds.job import rank_env as slurm_env
from aidaptiv_ds.job import rank_env as train

ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# What srun sets for task 5 of 8, two nodes of four tasks, on the second node (as printed by `srun env`).
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu-a[07-08]",
    "SLURM_JOB_NODELIST": "gpu-a[07-08]",
    "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
}


@pytest.fixture
def srun_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ENV_VARS:
            monkeypatch.delenv(k)
    for k, v in SRUN.items():
        monkeypatch.setenv(k, v)
    return monkeypatch


def test_first_host_of_a_slurm_host_list():
    assert slurm_env.first_host("gpu-a[07-08,11],gpu-b3") == "gpu-a07"
    assert slurm_env.first_host("node[1-2]-ib,x") == "node1-ib"
    assert slurm_env.first_host("n1,n2") == "n1"
    assert slurm_env.first_host("single") == "single"
    assert slurm_env.first_host("") is None


def test_tasks_on_node():
    assert [slurm_env.tasks_on_node("4(x2),2", i) for i in range(4)] == [4, 4, 2, None]
    assert slurm_env.tasks_on_node("garbage", 0) is None


def test_rendezvous_from_srun_variables():
    found = slurm_env.rendezvous(SRUN)
    assert {k: v for k, (v, _) in found.items()} == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu-a07",
        "MASTER_PORT": str(20000 + 123456 % 10000),
    }
    assert (
        found["WORLD_SIZE"][1] == "SLURM_STEP_NUM_TASKS"
        and found["MASTER_ADDR"][1] == "first host of SLURM_STEP_NODELIST"
    )


def test_fallbacks_and_what_is_already_set():
    env = {
        k: v
        for k, v in SRUN.items()
        if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
    }
    found = slurm_env.rendezvous(dict(env, MASTER_PORT="31000"))
    assert found["WORLD_SIZE"] == ("8", "SLURM_NTASKS")
    assert found["MASTER_ADDR"] == ("10.0.0.7", "SLURM_LAUNCH_NODE_IPADDR")
    assert "MASTER_PORT" not in found  # the user's port is kept
    assert slurm_env.rendezvous(dict(env))["MASTER_PORT"][0] == "29500"
    assert slurm_env.rendezvous(dict(SRUN, RANK="2", WORLD_SIZE="4")) == {}  # a launcher set them


def test_a_batch_script_shell_is_not_an_srun_step():
    # sbatch's own shell has SLURM_PROCID=0 and the job's task count but no step: one process, not rank 0 of 8.
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert slurm_env.rendezvous(dict(batch, SLURM_PROCID="0")) == {}


def test_train_takes_its_rank_from_srun(srun_env, capsys):
    train.ensure_single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["MASTER_ADDR"] == "gpu-a07" and os.environ["MASTER_PORT"] == str(20000 + 123456 % 10000)
    assert capsys.readouterr().err == ""  # only rank 0 says where its variables came from


def test_rank_zero_logs_which_variables_came_from_slurm(srun_env, capsys):
    srun_env.setenv("SLURM_PROCID", "0")
    srun_env.setenv("SLURM_NODEID", "0")
    srun_env.setenv("SLURM_LOCALID", "0")
    train.ensure_single_process_env()
    err = capsys.readouterr().err
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "8"
    assert (
        "srun step" in err and "RANK=0 (from SLURM_PROCID)" in err and "WORLD_SIZE=8 (from SLURM_STEP_NUM_TASKS)" in err
    )
