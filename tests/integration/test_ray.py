"""Ray Train: FSDP2Strategy in Ray's documented Lightning recipe (TorchTrainer workers, RayLightningEnvironment,
devices="auto", RayTrainReportCallback, resuming from `ray.train.get_checkpoint()`), started by Ray itself on this
machine (tests/integration/ray_fit.py): trained, reported, resumed (started again, at the same or another number of
workers, and after a worker died), on two Ray nodes, and under Fabric; each against one process built without our
code (Lightning's single-device strategy, single-device Fabric). docs/launching.md's recipe runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fsdp2.convert import read_full_checkpoint
from tests.helpers import run_distributed
from tests.models import assert_same_run, fit_resumable_single_device

pytestmark = pytest.mark.slow  # Ray starts its own services and workers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "integration" / "ray_fit.py")
LAUNCHER_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}


def _ray_fit(pretrained: Path | str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ray.train.lightning")
    return subprocess.run([sys.executable, SCRIPT, str(pretrained), str(tmp_path / "result.pt"), str(tmp_path / "ray"),
                           *extra], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=900)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]


def _assert_each_worker_wrote_its_own_shards(result: dict) -> None:
    """In the sharded format, each rank's saves went into the temporary directory RayTrainReportCallback gave that
    rank (named after its world rank) and hold that rank's shards alone, rank 0's also the index and meta.pt: nothing
    needs a file system the workers share but Ray's storage."""
    for rank, saves in enumerate(result["saves"]):
        assert saves, f"rank {rank} saved nothing"
        for path, files in saves:
            assert f"world_rank={rank}" in path, (rank, path)
            assert files and {f for f in files if f.endswith(".distcp")} == {f"__{rank}_0.distcp"}, (rank, files)
            assert ({".metadata", "meta.pt"} <= set(files)) == (rank == 0), (rank, files)


def _reported(proc: subprocess.CompletedProcess) -> Path:
    """Ray's last reported checkpoint: a directory of Ray's storage holding RayTrainReportCallback's file."""
    return Path(proc.stdout.split("RESULT checkpoint ")[1].split()[0]) / "checkpoint.ckpt"


@pytest.fixture(scope="module")
def one_process(pretrained: Path) -> dict:
    """The same two epochs in one process, with Lightning's single-device strategy."""
    return run_distributed(fit_resumable_single_device, 1, str(pretrained), 2)[0]


def test_rays_documented_recipe_trains_as_one_process(pretrained: Path, one_process: dict, tmp_path: Path) -> None:
    """devices="auto" (one device per worker) is taken with Ray's world size and ranks: the layout, the sampler's
    split and the launch check come from RayLightningEnvironment; RayTrainReportCallback reports a checkpoint each
    epoch (every rank calls `trainer.save_checkpoint`, the full format writes one file from rank 0)."""
    proc = _ray_fit(pretrained, tmp_path)
    _ok(proc)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["environment"] == "RayLightningEnvironment" and result["world_size"] == 2
    assert result["sampler"] == {"num_replicas": 2, "rank": 0}  # Ray's world, not devices="auto"'s one device
    assert result["mesh"] == [2] and not result["resumed"]
    assert_same_run(result, one_process, "Ray Train, 2 workers")
    assert _reported(proc).is_file()  # Ray's last reported checkpoint, in our full format
    assert read_full_checkpoint(_reported(proc))["global_step"] == 4


def test_devices_that_do_not_fit_rays_workers_are_refused_saying_what_to_set(pretrained: Path,
                                                                             tmp_path: Path) -> None:
    proc = _ray_fit(pretrained, tmp_path, "--devices", "3")
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert ("RayLightningEnvironment started 2 processes (1 node(s) x 2 per node), but `devices=3` and `num_nodes=1`"
            " in Lightning. Set `devices=\"auto\"`") in said, said[-4000:]
    assert not (tmp_path / "result.pt").exists()


@pytest.mark.parametrize(("fmt", "workers"), [("full", 2), ("sharded", 2), ("sharded", 1)],
                         ids=["full", "sharded", "sharded-at-1-worker"])
def test_a_run_started_again_resumes_from_the_checkpoint_ray_reported(
    fmt: str, workers: int, pretrained: Path, one_process: dict, tmp_path: Path
) -> None:
    """One epoch, then the same `RunConfig(storage_path, name)` started again for two: `ray.train.get_checkpoint()`
    hands over the checkpoint RayTrainReportCallback reported, `trainer.fit(ckpt_path=...)` resumes from it (at the
    same or another number of workers), and the run ends with the uninterrupted run's weights. In the sharded
    format each worker writes its shards into the temporary directory Ray's callback gave it, and Ray merges the
    workers' directories into one checkpoint."""
    sharded = ("--sharded",) if fmt == "sharded" else ()
    first = _ray_fit(pretrained, tmp_path, "--epochs", "1", *sharded)
    _ok(first)
    assert not torch.load(tmp_path / "result.pt", weights_only=True)["resumed"]
    reported = _reported(first)
    if fmt == "sharded":
        _assert_each_worker_wrote_its_own_shards(torch.load(tmp_path / "result.pt", weights_only=True))
        names = {p.name for p in reported.iterdir()}
        assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= names, names  # merged by Ray
    again = _ray_fit(pretrained, tmp_path, "--epochs", "2", "--workers", str(workers), *sharded)
    _ok(again)
    assert str(reported) in again.stdout + again.stderr  # "Restoring states from the checkpoint path at ..."
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["resumed"] and result["world_size"] == workers
    assert_same_run(result, one_process, f"Ray Train, resumed from its {fmt} checkpoint at {workers} worker(s)")


def test_a_worker_that_dies_is_restarted_and_resumes(pretrained: Path, one_process: dict, tmp_path: Path) -> None:
    """`FailureConfig(max_failures=1)`: worker 1 ends its process at the start of the second epoch; Ray restarts
    both workers, which resume from the checkpoint of the first epoch, to the uninterrupted run's weights. Sharded,
    with `async_save=True`: under Ray each save is complete when it returns (Ray's callback reports the directory at
    once, then deletes it)."""
    proc = _ray_fit(pretrained, tmp_path, "--fail-at-epoch", "1", "--sharded", "--async-save")
    _ok(proc)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["died"] and result["resumed"]
    _assert_each_worker_wrote_its_own_shards(result)
    assert_same_run(result, one_process, "Ray Train, resumed after a worker died")


@pytest.mark.parametrize(("mesh", "fmt"), [(None, "full"), ("2,2", "sharded")], ids=["fsdp-over-4", "hsdp-2x2"])
def test_two_ray_nodes_of_two_workers_train_as_one_process(
    mesh: str | None, fmt: str, pretrained: Path, one_process: dict, tmp_path: Path
) -> None:
    """A Ray cluster of two nodes (Ray's own `ray.cluster_utils.Cluster`, the second node on another loopback
    address), two workers each: Ray ranks them per node, and FSDP over the 4 or HSDP (2 replicas of 2 shards, each
    replica within a node) ends with one process's weights; the sharded checkpoints each worker wrote into its own
    directory, merged by Ray."""
    proc = _ray_fit(pretrained, tmp_path, "--workers", "4", "--nodes", "2", *(("--mesh", mesh) if mesh else ()),
                    *(("--sharded",) if fmt == "sharded" else ()))
    _ok(proc)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["world_size"] == 4 and result["nodes"] == [(0, 0), (0, 1), (1, 0), (1, 1)], result["nodes"]
    assert result["mesh"] == ([2, 2] if mesh else [4])
    assert_same_run(result, one_process, f"two Ray nodes, device_mesh={mesh}")
    if fmt == "sharded":
        _assert_each_worker_wrote_its_own_shards(result)
        assert {f"__{r}_0.distcp" for r in range(4)} <= {p.name for p in _reported(proc).iterdir()}


def test_fabric_in_ray_workers_trains_as_single_device_fabric(tmp_path: Path) -> None:
    """`Fabric(devices="auto", plugins=[RayLightningEnvironment()], strategy=FSDP2Strategy())` in each of 2 Ray
    workers: three LoRA steps equal single-device Fabric's."""
    from tests.test_fabric import _assert_close, _reference, _reference_start

    base, adapter = _reference_start(tmp_path / "start")
    proc = _ray_fit(base, tmp_path, "--fabric", adapter)
    _ok(proc)
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["world_size"] == 2 and result["on_meta"] and result["sharded"]
    _assert_close(result, run_distributed(_reference, 1, base, adapter, 3)[0], "Fabric under Ray Train")


def test_the_recipe_in_launching_md_runs_as_written(pretrained: Path, tmp_path: Path) -> None:
    """docs/launching.md's Ray Train recipe, as a script: the user's module is tests.models.ResumeModule, 8 GPU
    workers are 2 CPU ones, the storage is a temporary directory. Both epochs are reported, in the sharded format
    the recipe sets, each checkpoint holding both workers' shards."""
    pytest.importorskip("ray.train.lightning")
    page = (ROOT / "docs" / "launching.md").read_text()
    code = re.search(r"<!-- not run: Ray starts the workers[^>]*-->\n```python\n(.*?)```", page, re.S).group(1)
    for old, new in {"num_workers=8": "num_workers=2", "use_gpu=True": "use_gpu=False",
                     '"/mnt/shared/ray_results"': repr(str(tmp_path / "ray"))}.items():
        assert old in code, old
        code = code.replace(old, new)
    prelude = (
        "import ray\n"
        f"ray.init(num_cpus=2, include_dashboard=False, runtime_env={{'env_vars': {{'PYTHONPATH': {str(ROOT)!r}}}}})\n"
        "from tests.models import ResumeModule\n"
        f"MyLightningModule = lambda: ResumeModule({str(pretrained)!r})\n"
    )
    script = tmp_path / "recipe.py"
    script.write_text(prelude + code)
    env = {**_clean_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    _ok(proc)
    checkpoints = sorted((tmp_path / "ray").glob("*/checkpoint_*/checkpoint.ckpt"))
    assert len(checkpoints) == 2, checkpoints
    for checkpoint in checkpoints:
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in checkpoint.iterdir()}
    assert read_full_checkpoint(checkpoints[-1])["global_step"] == 4
