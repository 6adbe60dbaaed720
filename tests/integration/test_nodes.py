"""Several nodes, proven on one machine: the processes of a 2-node job started as torchrun, Lightning and SLURM start them,
each node's processes on their own, meeting at a rendezvous on 127.0.0.1. Each run ends with the weights of the
same two epochs at world size 2 (the `straight` fixture: FSDP2 at world size 2, started by the test helper)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port
from tests.models import assert_same_run

pytestmark = pytest.mark.slow  # several interpreters start per test

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "integration" / "nodes_fit.py")
LAUNCHER_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}


def _run_nodes(commands: list[tuple[list[str], dict[str, str]]], cwd: Path) -> None:
    """Start every node's command at once, as separate machines would; wait for all; fail with their output."""
    procs = [subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in commands]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]


@pytest.mark.parametrize("mesh", [None, (2, 2)], ids=["fsdp", "hsdp-one-shard-group-per-node"])
def test_torchrun_two_nodes(mesh: tuple[int, int] | None, pretrained: Path, straight: dict, tmp_path: Path) -> None:
    """`torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2` with a static rendezvous on 127.0.0.1 and
    `Trainer(devices=2, num_nodes=2)`: sharded over all 4 ranks, or HSDP with one shard group per node."""
    port = str(free_port())
    out = tmp_path / "result.pt"
    extra = [str(n) for n in mesh] if mesh else []
    commands = [
        ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
          "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port,
          SCRIPT, str(pretrained), str(out), "2", "2", *extra], _clean_environment())
        for node in (0, 1)
    ]
    _run_nodes(commands, tmp_path)
    result = torch.load(out, weights_only=True)
    assert (result["environment"], result["world_size"]) == ("TorchElasticEnvironment", 4)
    assert result["mesh"] == ([2, 2] if mesh else [4])
    assert_same_run(result, straight, f"torchrun, 2 nodes x 2 processes, mesh {mesh}")


def test_lightnings_launcher_on_two_nodes(pretrained: Path, straight: dict, tmp_path: Path) -> None:
    """The recipe of docs/launching.md: the same command on each machine with `MASTER_ADDR`, `MASTER_PORT` and
    `NODE_RANK`; Lightning's launcher starts 2 processes on each (re-running the script), `Trainer(devices=2,
    num_nodes=2)`."""
    port = str(free_port())
    out = tmp_path / "result.pt"
    commands = []
    for node in (0, 1):
        env = _clean_environment()
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
        commands.append(([sys.executable, SCRIPT, str(pretrained), str(out), "2", "2"], env))
    _run_nodes(commands, tmp_path)
    result = torch.load(out, weights_only=True)
    assert (result["environment"], result["world_size"]) == ("LightningEnvironment", 4)
    assert_same_run(result, straight, "Lightning's launcher, 2 nodes x 2 processes")


def test_slurm_two_nodes(pretrained: Path, straight: dict, tmp_path: Path) -> None:
    """Each task of a 2-node, 1-task-per-node SLURM allocation (what `srun` starts), with the `SLURM_*` variables
    SLURM sets and `Trainer(devices=1, num_nodes=2)`: Lightning's SLURM environment, the same weights."""
    port = str(free_port())
    out = tmp_path / "result.pt"
    commands = []
    for node in (0, 1):
        env = _clean_environment()
        env.update(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="lora", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
            SLURM_NNODES="2", SLURM_NODELIST="node[0-1]", SLURM_NODEID=str(node), SLURM_PROCID=str(node),
            SLURM_LOCALID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )
        commands.append(([sys.executable, SCRIPT, str(pretrained), str(out), "1", "2"], env))
    _run_nodes(commands, tmp_path)
    result = torch.load(out, weights_only=True)
    assert (result["environment"], result["world_size"]) == ("SLURMEnvironment", 2)
    assert_same_run(result, straight, "SLURM, 2 nodes x 1 task")
