"""One process of a fit over several "nodes" on this machine, started as a multi-node launcher starts it: by
torchrun (`--nnodes 2 --node-rank N`), or with the variables SLURM sets for each task of a 2-node allocation.
Two epochs of tests.models.ResumeModule; rank 0 writes the trained state. Run by tests/integration/test_nodes.py.

    python nodes_fit.py PRETRAINED OUT DEVICES NUM_NODES [REPLICATE SHARD]
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_fsdp2 import FSDP2Strategy  # noqa: E402
from tests.models import GLOBAL_BATCH, ResumeModule, full_state, quiet_trainer_kwargs  # noqa: E402


def main(pretrained: str, out: str, devices: int, num_nodes: int, mesh: tuple[int, int] | None) -> None:
    module = ResumeModule(pretrained)
    module.batch_size = GLOBAL_BATCH // (devices * num_nodes)  # the same global batches at every layout
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=FSDP2Strategy(device_mesh=mesh),
        max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    trainer.fit(module)
    state = full_state(module)  # every rank takes part in the gather
    strategy = trainer.strategy
    if trainer.global_rank == 0:
        torch.save({
            "state": state, "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "environment": type(strategy.cluster_environment).__name__, "world_size": trainer.world_size,
            "mesh": list(strategy.device_mesh.shape),
        }, out)
    # As torch asks of a script under torchrun: shut the process group down before the interpreter exits.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], int(args[2]), int(args[3]), (int(args[4]), int(args[5])) if len(args) > 4 else None)
