"""Ray Train's documented Lightning recipe, with only the strategy swapped for FSDP2Strategy: a ``TorchTrainer`` whose
workers each build a ``Trainer(devices="auto", plugins=[RayLightningEnvironment()],
callbacks=[RayTrainReportCallback()])`` (``prepare_trainer`` left out: it only checks that the strategy is one of
Ray's own). Two epochs of tests.models.ResumeModule; rank 0 writes the trained state. Run by
tests/integration/test_ray.py.

    python ray_fit.py PRETRAINED OUT WORKERS STORAGE [DEVICES]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def train_func(config: dict) -> None:
    import lightning as L
    import torch
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import ResumeModule, full_state, quiet_trainer_kwargs

    module = ResumeModule(config["pretrained"])
    kwargs = {**quiet_trainer_kwargs(), "enable_checkpointing": False}
    trainer = L.Trainer(
        devices=config["devices"], accelerator="auto", strategy=FSDP2Strategy(), plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()], max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0, **kwargs,
    )
    trainer.fit(module)
    state = full_state(module)  # every rank takes part in the gather
    if trainer.global_rank == 0:
        strategy = trainer.strategy
        torch.save({
            "state": state, "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "environment": type(strategy.cluster_environment).__name__, "world_size": trainer.world_size,
            "sampler": strategy.distributed_sampler_kwargs, "mesh": list(strategy.device_mesh.shape),
        }, config["out"])


def main(pretrained: str, out: str, workers: int, storage: str, devices: str = "auto") -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The workers import this repository's package and tests as the driver does.
    ray.init(num_cpus=workers, include_dashboard=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}})
    trainer = TorchTrainer(
        train_func, train_loop_config={"pretrained": pretrained, "out": out,
                                       "devices": int(devices) if devices.isdigit() else devices},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(storage_path=storage, name="fsdp2"),
    )
    result = trainer.fit()
    print("RESULT checkpoint", result.checkpoint.path if result.checkpoint else None, flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3], int(sys.argv[3]), *sys.argv[4:])
