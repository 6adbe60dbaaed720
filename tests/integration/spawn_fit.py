"""Fit a tiny Llama (+LoRA) under Lightning's spawn/fork launcher, then compare the main process's model with the
checkpoint the workers wrote at the end of fit. Run by tests/integration/test_launchers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_fsdp2 import FSDP2Strategy  # noqa: E402
from tests.models import LlamaModule, quiet_trainer_kwargs  # noqa: E402


class SavesAtTheEnd(LlamaModule):
    def __init__(self, ckpt: str, built_in_init: bool) -> None:
        super().__init__(lora=True, lr=5e-2)
        self.ckpt = ckpt
        if built_in_init:
            self.configure_model()  # real, in the main process before the launch

    def on_train_end(self) -> None:
        self.trainer.save_checkpoint(self.ckpt)  # every rank: the trained weights, gathered


def main(start_method: str, ckpt: str, built_in_init: bool) -> None:
    module = SavesAtTheEnd(ckpt, built_in_init)
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(start_method=start_method),
                        max_steps=2, limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    mine = module.state_dict()
    assert saved.keys() <= mine.keys(), sorted(saved.keys() - mine.keys())[:3]
    worst = max((mine[k] - v).abs().max().item() for k, v in saved.items())
    moved = max(((mine[k] - v).abs().max().item() for k, v in initial.items() if k in mine), default=float("inf"))
    print(f"RESULT max_diff={worst} moved={moved}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "init")
