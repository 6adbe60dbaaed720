"""torchrun's `--max-restarts`: a rank dies mid-fit, torchrun starts the group again, the fit resumes from the last
checkpoint and ends with the weights of an uninterrupted run.

torchrun's agent keeps the store it hosts across restarts; a restarted attempt that reads the previous attempt's keys
fails to start its process group (gloo: "connectFullMesh ... Connection refused"), as Lightning's DDP does on the
pinned torch (pytorch/pytorch#135712, #167288). FSDP2Strategy starts each attempt under a key prefix of its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_fsdp2._frontend import _attempt_store
from tests.helpers import free_port
from tests.models import assert_same_run

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "integration" / "restart_fit.py")
LAUNCHER_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE")
TIMEOUT = 300  # a run takes 15-25 s on 2 idle cores


def _torchrun(*launches: list[str], cwd: Path) -> list[str]:
    """Run `python -m torch.distributed.run LAUNCH...` once per launch (one per "node"), all at once; their outputs.
    Bounded: past TIMEOUT each torchrun is asked to stop its workers (they run in sessions of their own), then
    killed."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for launch in launches]
    deadline, outputs = time.monotonic() + TIMEOUT, []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=60)[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0])
        pytest.fail(f"torchrun did not finish within {TIMEOUT} s:\n" + "\n".join(o[-3000:] for o in outputs))
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-6000:]
    return outputs


def _fit(pretrained: Path, root: Path, fmt: str, crash_at: int, *layout: int) -> list[str]:
    return [SCRIPT, str(pretrained), str(root / "result.pt"), str(root / "checkpoints"), fmt, str(crash_at),
            *(str(n) for n in layout)]


def _check(root: Path, fmt: str, outputs: list[str], uninterrupted: dict, what: str) -> None:
    """Rank 1 died at step 5; each rank started twice, the second time from `last.ckpt` (step 4); the weights are the
    uninterrupted run's; the checkpoint directory holds the last two checkpoints only (no `.<name>.tmp-*`/`.old-*`
    left by the attempt that died)."""
    output = "\n".join(outputs)
    ckpt_dir = root / "checkpoints"
    assert "rank 1 dies at step 5" in output, output[-6000:]
    for rank in (0, 1):
        starts = re.findall(rf" rank {rank} resumes from (None|\S*?last\.ckpt)", output)
        assert starts == ["None", str(ckpt_dir / "last.ckpt")], output[-6000:]
    result = torch.load(root / "result.pt", weights_only=True)
    assert result["resumed_from"] == str(ckpt_dir / "last.ckpt")
    assert_same_run(result, uninterrupted, what)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["epoch=3-step=8.ckpt", "last.ckpt"]
    assert not [p for p in ckpt_dir.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
    assert (ckpt_dir / "last.ckpt").is_dir() == (fmt == "sharded")


def test_each_attempt_gets_a_namespace_of_its_own_that_all_its_ranks_agree_on() -> None:
    """`_attempt_store` on one store kept across attempts (as torchrun's agent keeps it): each attempt's ranks get the
    same prefix, a new one per attempt, whose keys the next attempt does not see; also when the other ranks start
    before rank 0 and first read what the previous attempt's rank 0 answered."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def attempt(world_size: int, rank_0_late: bool) -> list[torch.distributed.Store]:
        stores: list = [None] * world_size

        def run(rank: int) -> None:
            client = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False)
            stores[rank] = _attempt_store(client, rank, world_size, timedelta(seconds=30))

        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world_size)]
        for thread in threads[1:] if rank_0_late else threads:
            thread.start()
        if rank_0_late:
            time.sleep(0.5)
            threads[0].start()
        for thread in threads:
            thread.join(timeout=60)
        assert all(store is not None for store in stores)
        return stores

    first = attempt(3, rank_0_late=False)
    first[1].set("address/1", "attempt 0")
    assert first[0].get("address/1") == b"attempt 0"  # one namespace for the attempt's ranks
    for rank_0_late in (True, False):
        again = attempt(3, rank_0_late)
        again[2].set("address/2", "attempt 1")
        assert [store.check(["address/2"]) for store in again] == [True] * 3
        assert [store.check(["address/1"]) for store in again] == [False] * 3  # the earlier attempt's keys: unseen


@pytest.fixture(scope="module")
def uninterrupted(pretrained: Path, tmp_path_factory) -> dict:
    """The same 8 steps under torchrun without a crash."""
    root = tmp_path_factory.mktemp("uninterrupted")
    output = _torchrun(["--nproc-per-node", "2", *_fit(pretrained, root, "full", 0)], cwd=root)[0]
    assert "dies" not in output and output.count("resumes from None") == 2, output[-6000:]
    return torch.load(root / "result.pt", weights_only=True)


@pytest.mark.slow  # torchrun starts its workers twice
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_rank_killed_mid_fit_is_restarted_by_torchrun_and_the_fit_resumes(
    fmt: str, pretrained: Path, uninterrupted: dict, tmp_path: Path
) -> None:
    """`torchrun --nproc-per-node 2 --max-restarts 1` (the c10d rendezvous torchrun picks for one node, its agent
    hosting the store): rank 1 of the first attempt exits (`os._exit(1)`) at step 5 of 8; torchrun starts both ranks
    again, and they resume."""
    outputs = _torchrun(["--nproc-per-node", "2", "--max-restarts", "1", *_fit(pretrained, tmp_path, fmt, 5)],
                        cwd=tmp_path)
    _check(tmp_path, fmt, outputs, uninterrupted, f"{fmt} checkpoints, rank 1 killed at step 5, restarted by torchrun")


@pytest.mark.slow
def test_two_nodes_restart_together_though_their_restart_counts_differ(
    pretrained: Path, uninterrupted: dict, tmp_path: Path
) -> None:
    """Two torchrun agents (one process each) meeting at a c10d rendezvous, as on two machines. When rank 1 dies, its
    agent counts a restart; the other one may restart for the membership change without counting one (its worker then
    sees TORCHELASTIC_RESTART_COUNT=0 again, as it did in our runs), so the count cannot name the attempt. Each rank
    still starts exactly twice: the second attempt starts the process group at its first try."""
    port = free_port()
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "restart-test", "--max-restarts", "1",
              *_fit(pretrained, tmp_path, "full", 5, 1, 2)]
    outputs = _torchrun(launch, launch, cwd=tmp_path)
    _check(tmp_path, "full", outputs, uninterrupted, "2 nodes, rank 1 killed at step 5, restarted by torchrun")
