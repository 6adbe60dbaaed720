"""Ray Train's documented Lightning recipe, with only the strategy swapped for FSDP2Strategy: a ``TorchTrainer`` whose
workers each build a ``Trainer(devices="auto", plugins=[RayLightningEnvironment()],
callbacks=[RayTrainReportCallback()])`` (``prepare_trainer`` left out: it only checks that the strategy is one of
Ray's own) and resume from ``ray.train.get_checkpoint()`` when Ray hands one over, as Ray's guide does: after a
worker failure (``FailureConfig``), or when a run is started again under the same ``RunConfig(storage_path, name)``.
Epochs of tests.models.ResumeModule; rank 0 writes the trained state. Run by tests/integration/test_ray.py.

    python ray_fit.py PRETRAINED OUT STORAGE [--workers 2] [--nodes 1] [--devices auto] [--epochs 2] [--sharded]
                      [--async-save] [--mesh R,S] [--fail-at-epoch E] [--fabric ADAPTER]

``--nodes 2``: a Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``, the second node on another
loopback address, so that Ray places and ranks the workers per node). ``--fail-at-epoch E``: worker 1 dies at the
start of epoch E of the first attempt (``FailureConfig(max_failures=1)``). ``--fabric ADAPTER``: Fabric instead of
the Trainer (tests/test_fabric.py's LoRA steps).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def train_func(config: dict) -> None:
    import lightning as L
    import ray.train
    import torch
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import ResumeModule, full_state, quiet_trainer_kwargs

    class DieOnce(L.Callback):
        """Worker 1 ends its process at the start of one epoch, once per run (the marker survives the restart)."""

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            marker = Path(config["storage"], "died")
            if trainer.current_epoch == config["fail_at_epoch"] and trainer.global_rank == 1 and not marker.exists():
                marker.touch()
                # Once Ray has taken in the checkpoints reported so far (a failure in the moment after a report may
                # come before Ray's controller collected it: then the run restarts from the one before).
                ray.train.get_all_reported_checkpoints()
                os._exit(1)

    written: list = []  # what each save left where this rank was told to write, as RayTrainReportCallback reads it

    class Recording(FSDP2Strategy):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            path = Path(filepath)
            written.append((str(path), sorted(p.name for p in path.iterdir()) if path.is_dir() else path.is_file()))

    module = ResumeModule(config["pretrained"])
    kwargs = {**quiet_trainer_kwargs(), "enable_checkpointing": False}
    mesh = tuple(config["mesh"]) if config["mesh"] else None
    strategy = Recording(state_dict_type="sharded" if config["sharded"] else "full", device_mesh=mesh,
                         async_save=config["async_save"])
    trainer = L.Trainer(
        devices=config["devices"], accelerator="auto", strategy=strategy, plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(), DieOnce()], max_epochs=config["epochs"], limit_val_batches=0,
        num_sanity_val_steps=0, **kwargs,
    )
    checkpoint = ray.train.get_checkpoint()  # Ray's guide: resume from the checkpoint Ray hands over, if any
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            trainer.fit(module, ckpt_path=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME))
    else:
        trainer.fit(module)
    state = full_state(module)  # every rank takes part in the gather
    nodes: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(nodes, (trainer.node_rank, trainer.local_rank))
    saves: list = [None] * trainer.world_size
    torch.distributed.all_gather_object(saves, written)
    if trainer.global_rank == 0:
        strategy = trainer.strategy
        torch.save({
            "state": state, "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "environment": type(strategy.cluster_environment).__name__, "world_size": trainer.world_size,
            "sampler": strategy.distributed_sampler_kwargs, "mesh": list(strategy.device_mesh.shape),
            "nodes": nodes, "saves": saves, "resumed": checkpoint is not None,
            "died": Path(config["storage"], "died").exists(),
        }, config["out"])


def fabric_func(config: dict) -> None:
    """Fabric in a Ray worker: ``Fabric(devices="auto", plugins=[RayLightningEnvironment()])``."""
    import torch
    from ray.train.lightning import RayLightningEnvironment

    from tests.test_fabric import _sharded

    result = _sharded(config["pretrained"], config["adapter"], 3,
                      fabric={"devices": config["devices"], "plugins": [RayLightningEnvironment()]})
    if torch.distributed.get_rank() == 0:
        torch.save({**result, "world_size": torch.distributed.get_world_size()}, config["out"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pretrained")
    parser.add_argument("out")
    parser.add_argument("storage")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sharded", action="store_true", help="FSDP2Strategy(state_dict_type='sharded')")
    parser.add_argument("--async-save", action="store_true", help="FSDP2Strategy(async_save=True), with --sharded")
    parser.add_argument("--mesh", default=None, help="device_mesh, e.g. 2,2")
    parser.add_argument("--fail-at-epoch", type=int, default=None)
    parser.add_argument("--fabric", default=None, metavar="ADAPTER")
    args = parser.parse_args()

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The workers import this repository's package and tests as the driver does.
    runtime_env = {"env_vars": {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}}
    cluster = None
    per_node = args.workers // args.nodes
    if args.nodes > 1:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": per_node, "include_dashboard": False})
        for node in range(1, args.nodes):
            cluster.add_node(num_cpus=per_node, node_ip_address=f"127.0.0.{node + 1}")
        ray.init(address=cluster.address, runtime_env=runtime_env)
    else:
        ray.init(num_cpus=args.workers, include_dashboard=False, runtime_env=runtime_env)
    config = {"pretrained": args.pretrained, "out": args.out, "storage": args.storage, "epochs": args.epochs,
              "sharded": args.sharded, "async_save": args.async_save, "fail_at_epoch": args.fail_at_epoch, "adapter": args.fabric,
              "mesh": [int(n) for n in args.mesh.split(",")] if args.mesh else None,
              "devices": int(args.devices) if args.devices.isdigit() else args.devices}
    trainer = TorchTrainer(
        fabric_func if args.fabric else train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage, name="fsdp2",
                             failure_config=FailureConfig(max_failures=1 if args.fail_at_epoch is not None else 0)),
    )
    result = trainer.fit()
    print("RESULT checkpoint", result.checkpoint.path if result.checkpoint else None, flush=True)
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main()
