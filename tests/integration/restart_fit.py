"""One process of a fit under `torchrun --nproc-per-node 2 --max-restarts 1`, resumed by torchrun after a crash: 4
epochs (8 steps) of tests.models.ResumeModule with a `ModelCheckpoint` writing `last.ckpt` after every step; each
attempt resumes from `last.ckpt` when there is one. With CRASH_AT > 0, rank 1 dies at the start of that step
(`os._exit(1)`, as a killed process does: no teardown), once: it leaves `OUT.crashed` to tell the next attempt. Rank 0
writes the trained state to OUT. Run by tests/integration/test_restart.py.

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 restart_fit.py PRETRAINED OUT CKPT_DIR FORMAT \
        CRASH_AT [DEVICES NUM_NODES]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_fsdp2 import FSDP2Strategy  # noqa: E402
from tests.models import ResumeModule, full_state, quiet_trainer_kwargs  # noqa: E402


class CrashingModule(ResumeModule):
    def __init__(self, pretrained: str, crash_at: int, marker: Path) -> None:
        super().__init__(pretrained)
        self.crash_at, self.marker = crash_at, marker

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.global_rank == 1 and self.trainer.global_step + 1 == self.crash_at and not self.marker.exists():
            self.marker.touch()
            os.write(1, f"rank 1 dies at step {self.crash_at}\n".encode())
            os._exit(1)


def main(pretrained: str, out: str, ckpt_dir: str, fmt: str, crash_at: int, devices: int, num_nodes: int) -> None:
    last = Path(ckpt_dir) / "last.ckpt"
    resume = str(last) if last.exists() else None
    # One write each (print writes the text and the newline apart): the two ranks share torchrun's output.
    os.write(1, f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')} rank {os.environ.get('RANK')} resumes from"
                f" {resume}\n".encode())
    module = CrashingModule(pretrained, crash_at, Path(f"{out}.crashed"))
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1)
    kwargs = {**quiet_trainer_kwargs(), "enable_checkpointing": True}
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=FSDP2Strategy(state_dict_type=fmt),
        max_epochs=4, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[checkpoints], **kwargs,
    )
    trainer.fit(module, ckpt_path=resume)
    state = full_state(module)  # every rank takes part in the gather
    if trainer.global_rank == 0:
        torch.save({"state": state, "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
                    "resumed_from": resume}, out)
    # As torch asks of a script under torchrun: shut the process group down before the interpreter exits.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    pretrained, out, ckpt_dir, fmt, crash_at, *layout = sys.argv[1:]
    devices, num_nodes = (int(n) for n in layout) if layout else (2, 1)
    main(pretrained, out, ckpt_dir, fmt, int(crash_at), devices, num_nodes)
