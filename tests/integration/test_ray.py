"""Ray Train: FSDP2Strategy in Ray's documented Lightning recipe (TorchTrainer workers, RayLightningEnvironment,
devices="auto", RayTrainReportCallback), started by Ray itself on this machine (tests/integration/ray_fit.py). The
run ends with the weights of the same two epochs at world size 2 (the `straight` fixture: FSDP2 at world size 2,
started by the test helper, itself checked against one process in tests/integration/test_resume.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models import assert_same_run

pytestmark = pytest.mark.slow  # Ray starts its own services and workers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "integration" / "ray_fit.py")
LAUNCHER_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _ray_fit(pretrained: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ray.train.lightning")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return subprocess.run([sys.executable, SCRIPT, str(pretrained), str(tmp_path / "result.pt"), "2",
                           str(tmp_path / "ray"), *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)


def test_rays_documented_recipe_trains_as_fsdp2_at_world_size_2(pretrained: Path, straight: dict,
                                                                 tmp_path: Path) -> None:
    """devices="auto" (one device per worker) is taken with Ray's world size and ranks: the layout, the sampler's
    split and the launch check come from RayLightningEnvironment; RayTrainReportCallback reports a checkpoint each
    epoch (every rank calls `trainer.save_checkpoint`, the full format writes one file from rank 0)."""
    proc = _ray_fit(pretrained, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = tmp_path / "result.pt"
    result = torch.load(out, weights_only=True)
    assert result["environment"] == "RayLightningEnvironment" and result["world_size"] == 2
    assert result["sampler"] == {"num_replicas": 2, "rank": 0}  # Ray's world, not devices="auto"'s one device
    assert result["mesh"] == [2]
    assert_same_run(result, straight, "Ray Train, 2 workers")
    reported = proc.stdout.split("RESULT checkpoint ")[1].split()[0]
    assert (Path(reported) / "checkpoint.ckpt").is_file()  # Ray's last reported checkpoint, in our full format


def test_devices_that_do_not_fit_rays_workers_are_refused_saying_what_to_set(pretrained: Path,
                                                                             tmp_path: Path) -> None:
    proc = _ray_fit(pretrained, tmp_path, "3")
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert ("RayLightningEnvironment started 2 processes (1 node(s) x 2 per node), but `devices=3` and `num_nodes=1`"
            " in Lightning. Set `devices=\"auto\"`") in said, said[-4000:]
    assert not (tmp_path / "result.pt").exists()
