"""Moving between Lightning's ``ModelParallelStrategy`` (``fully_shard`` written by hand in ``configure_model``) and
FSDP2Strategy, in both directions and both checkpoint formats: a checkpoint one writes after one epoch resumes under
the other and ends where an uninterrupted FSDP2Strategy run of two epochs ends (weights, step, learning rate).

The ``ModelParallelStrategy`` side is written as its users write it (Lightning's docs): the model built for real in
``configure_model`` from ``from_pretrained``, each decoder layer and then the model passed to ``fully_shard`` on the
strategy's data-parallel mesh; ``save_distributed_checkpoint`` picks the format. Nothing of this package runs there.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

from tests.helpers import run_distributed
from tests.models import ResumeModule, assert_same_run, fit_resumable, full_state, quiet_trainer_kwargs, world


class HandSharded(ResumeModule):
    """ResumeModule as a ModelParallelStrategy user writes it: from_pretrained, then fully_shard by hand."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(self.pretrained)
        mesh = self.device_mesh["data_parallel"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model


def _fit_model_parallel(pretrained: str, epochs: int, save_to: str | None, resume_from: str | None,
                        sharded: bool) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    module = HandSharded(pretrained)
    strategy = ModelParallelStrategy(data_parallel_size=world(), tensor_parallel_size=1,
                                     save_distributed_checkpoint=sharded)
    trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=strategy, max_epochs=epochs,
                        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"state": full_state(module), "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "ran": len(module.losses), "sharded": all(type(p).__name__ == "DTensor" for p in module.parameters())}


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_model_parallel_strategy_checkpoint_resumes_under_fsdp2(fmt: str, pretrained: Path, straight: dict,
                                                                  tmp_path: Path) -> None:
    """One epoch under ModelParallelStrategy (hand-written fully_shard), saved sharded (its DCP directory) or full
    (its single file); the second epoch under FSDP2Strategy: the uninterrupted FSDP2Strategy run's weights, step and
    learning rate."""
    path = str(tmp_path / f"model-parallel-{fmt}.ckpt")
    first = run_distributed(_fit_model_parallel, 2, str(pretrained), 1, path, None, fmt == "sharded")[0]
    assert first["sharded"] and Path(path).is_dir() == (fmt == "sharded")
    resumed = run_distributed(fit_resumable, 2, str(pretrained), 2, None, path)[0]
    assert resumed["ran"] == straight["step"] // 2  # it trained the second epoch only: the first came from the file
    assert_same_run(resumed, straight, f"ModelParallelStrategy {fmt} -> FSDP2Strategy")


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_an_fsdp2_checkpoint_resumes_under_model_parallel_strategy(fmt: str, pretrained: Path, saved: dict,
                                                                   straight: dict) -> None:
    """The reverse: FSDP2Strategy's checkpoint after one epoch, the second epoch under ModelParallelStrategy."""
    resumed = run_distributed(_fit_model_parallel, 2, str(pretrained), 2, None, str(saved[fmt]), fmt == "sharded")[0]
    assert resumed["sharded"] and resumed["ran"] == straight["step"] // 2
    assert_same_run(resumed, straight, f"FSDP2Strategy {fmt} -> ModelParallelStrategy")
