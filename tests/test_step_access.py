"""Step code that reads or writes parameters (``step_access.py``), against the same code under Lightning's DDP.

The layer is 1x1, as in Lightning's own tests of such code: at world size 2 one rank's shard of it is empty.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import quiet_trainer_kwargs


class StepAccess(L.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.mode = mode
        self.seen: list[Any] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        weight = self.layer.weight
        if self.mode == "read":
            self.seen += [weight.item(), weight.tolist()[0][0], float(weight), int(weight * 1000), bool(weight > 0)]
            if isinstance(self.trainer.strategy, FSDP2Strategy):  # what printing shows: where the values are
                self.printed = str(weight)
        elif self.mode == "assign":  # Lightning's spike-detection test: a reset of the weights, then the layer
            weight.data = torch.ones_like(weight.data)
            self.layer.bias.data = torch.full((1,), 0.5)  # a whole tensor, as one process would give it
        elif self.mode == "reshape":
            try:
                weight.data = torch.ones(2, 1)
            except RuntimeError as err:
                self.seen.append(str(err))
                self.mode = "done"
        out = self.layer(batch)
        self.seen.append(float(out.detach().sum()))
        return out.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.arange(8.0).view(8, 1), batch_size=2)


def _fit(mode: str, strategy: str) -> list[Any]:
    torch.manual_seed(0)
    module = StepAccess(mode)
    L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy() if strategy == "fsdp2" else "ddp", max_steps=2,
              **quiet_trainer_kwargs()).fit(module)
    return module.seen + ([module.printed] if hasattr(module, "printed") else [])


@pytest.mark.parametrize("mode", ["read", "assign"])
def test_reads_and_writes_of_parameters_in_a_step_behave_as_under_ddp(mode: str) -> None:
    """`.item()`, `.tolist()`, `float()`/`int()` of a 1x1 weight (one rank's shard of it is empty) give every rank the
    value DDP gives; `param.data = ...` (a `DTensor` from `ones_like`, or a whole tensor) changes what the next forward
    computes, as under DDP (before: the assignment changed nothing, and `.item()` failed on the empty shard)."""
    want = run_distributed(_fit, 2, mode, "ddp")
    got = run_distributed(_fit, 2, mode, "fsdp2")
    for rank in range(2):
        if mode == "read":  # printing: the shape, this rank's shard, how to see the whole tensor
            printed = got[rank].pop()
            assert "Sharded parameter of shape (1, 1)" in printed and "param.full_tensor()" in printed, printed
        assert got[rank] == pytest.approx(want[rank], abs=1e-6), (rank, got[rank], want[rank])


def test_a_new_shape_for_a_sharded_parameter_is_refused_by_name() -> None:
    for seen in run_distributed(_fit, 2, "reshape", "fsdp2"):
        assert "`param.data = value` with a value of shape (2, 1) on a sharded parameter of shape (1, 1)" in seen[0]
