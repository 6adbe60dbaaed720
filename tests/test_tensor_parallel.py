"""Tensor parallelism composed with FSDP2: `FSDP2Strategy(tensor_parallel_size=N)` (or `device_mesh=(replicate,
shard, tensor)`) splits the layers of the model's own plan (or the user's) over groups of N ranks, then shards over
the rest. Compared with one process built without this package, with the placements checked on every rank (so a
strategy that ignored the tensor dimension fails)."""

from __future__ import annotations

import copy
import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import LlamaModule, TokenDataset, full_state, quiet_trainer_kwargs
from tests.test_strategy import _assert_same_weights, _start_state


class TensorParallelModule(LlamaModule):
    """LlamaModule trained with SGD (momentum 0.9), reading the data-parallel split the strategy reports: ranks of
    one tensor group read the same batch."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        dataset = TokenDataset(self.n_samples)
        sampler = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            sampler = DistributedSampler(dataset, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)


def _trainer_kwargs(**extra) -> dict:
    kwargs = dict(max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    kwargs.update(extra)
    return kwargs


def _placements(module: torch.nn.Module) -> dict:
    """Each parameter's mesh dimension names and placements, and this rank's local shape."""
    from torch.distributed.tensor import DTensor

    return {n: (p.device_mesh.mesh_dim_names, tuple(repr(x) for x in p.placements), tuple(p.to_local().shape))
            for n, p in module.named_parameters() if isinstance(p, DTensor)}


def _fit_tp(start_state: dict, module_kwargs: dict, trainer_kwargs: dict, strategy_kwargs: dict) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    module = TensorParallelModule(start_state=start_state, **module_kwargs)
    strategy = FSDP2Strategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, **_trainer_kwargs(**trainer_kwargs))
    trainer.fit(module)
    return {"state": full_state(module), "placements": _placements(module), "losses": module.losses,
            "sampler": strategy.distributed_sampler_kwargs}


def _fit_reference(start_state: dict, module_kwargs: dict, trainer_kwargs: dict, data_parallel: int) -> dict:
    kwargs = dict(module_kwargs)
    kwargs["batch_size"] = kwargs.get("batch_size", 4) * data_parallel  # one process sees the global batch
    module = TensorParallelModule(start_state=start_state, **kwargs)
    module.configure_model()
    trainer = L.Trainer(accelerator="cpu", devices=1, **_trainer_kwargs(**trainer_kwargs))
    trainer.fit(module)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "losses": module.losses}


Q = "model.base_model.model.model.layers.0.self_attn.q_proj"
O = "model.base_model.model.model.layers.0.self_attn.o_proj.weight"


def _check_split(rank: dict, tensor: int) -> None:
    """The plan's layers are split over the tensor dimension (q_proj by rows, o_proj by columns, LoRA's B with its
    colwise base, A whole), the rest not."""
    placements = rank["placements"]
    names, split, local = placements[f"{Q}.base_layer.weight"]
    assert "tensor" in names and split[names.index("tensor")] == "Shard(dim=0)", placements[f"{Q}.base_layer.weight"]
    names, split, _ = placements[O]
    assert split[names.index("tensor")] == "Shard(dim=1)"
    names, split, _ = placements[f"{Q}.lora_B.default.weight"]
    assert split[names.index("tensor")] == "Shard(dim=0)"
    names, _, _ = placements[f"{Q}.lora_A.default.weight"]
    assert "tensor" not in names
    norm = placements["model.base_model.model.model.norm.weight"]
    assert "tensor" not in norm[0]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "plain"])
def test_tensor_parallel_2_matches_one_process(lora: bool) -> None:
    """World size 2 as one tensor group of 2 (no data parallelism left: both ranks compute the whole batch): the
    weights of one process after 3 SGD steps with momentum (<= 1e-4)."""
    module_kwargs = {"lora": lora, "lr": 5e-2}
    start = _start_state(lora=lora)
    reference = _fit_reference(start, module_kwargs, {}, data_parallel=1)
    results = run_distributed(_fit_tp, 2, start, module_kwargs, {}, {"tensor_parallel_size": 2})
    for rank in results:
        assert rank["sampler"] == {"num_replicas": 1, "rank": 0}
        if lora:
            _check_split(rank, 2)
        _assert_same_weights(rank["state"], reference["state"])
    moved = max((reference["state"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3


# =========================================================================== architectures (Fabric, load_pretrained)
GLOBAL_BATCH = 8


def _lora(arch: str, dropout: float = 0.0):
    from peft import LoraConfig

    targets = ["qkv_proj", "o_proj"] if arch == "phi3" else ["q_proj", "v_proj", "o_proj", "down_proj"]
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False)


def _pretrained(arch: str, directory: str, lora: bool) -> tuple[str, str | None]:
    """The architecture's tiny model saved by `save_pretrained`, and a LoRA adapter with non-zero A and B."""
    from peft import get_peft_model

    from tests.models import tiny_model

    torch.manual_seed(0)
    model, _ = tiny_model(arch)
    base = os.path.join(directory, f"{arch}-base")
    model.save_pretrained(base)
    if not lora:
        return base, None
    adapter = os.path.join(directory, f"{arch}-adapter")
    torch.manual_seed(1)
    get_peft_model(model, _lora(arch)).save_pretrained(adapter)
    return base, adapter


def _batches(steps: int, replicas: int, rank: int) -> list[torch.Tensor]:
    """Each step's global batch of the unshuffled data, this data-parallel rank's contiguous part of it."""
    data, per = TokenDataset(32).data, GLOBAL_BATCH // replicas
    return [data[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH][rank * per:(rank + 1) * per] for s in range(steps)]


def _train_loop(fabric, model, steps: int, replicas: int, rank: int, clip: float | None = None) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    if fabric is not None:
        optimizer = fabric.setup_optimizers(optimizer)
    losses = []
    for batch in _batches(steps, replicas, rank):
        loss = model(input_ids=batch, labels=batch).loss
        fabric.backward(loss) if fabric is not None else loss.backward()
        if clip is not None:
            if fabric is not None:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _fabric_reference(arch: str, base: str, adapter: str | None, steps: int, clip: float | None = None) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    losses = _train_loop(None, model, steps, 1, 0, clip)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def _fabric_tp(arch: str, base: str, adapter: str | None, steps: int, strategy: dict, clip: float | None = None) -> dict:
    from peft import get_peft_model

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy
    from lightning_fsdp2.lora import load_adapter
    from tests.models import tiny_model

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=FabricStrategy(**strategy))
    fabric.launch()
    with fabric.init_module():
        model = tiny_model(arch)[0]
        load_pretrained(model, base)
        if adapter is not None:
            model = get_peft_model(model, _lora(arch))
            load_adapter(model, adapter)
    model = fabric.setup_module(model)
    split = fabric.strategy.distributed_sampler_kwargs
    losses = _train_loop(fabric, model, steps, split["num_replicas"], split["rank"], clip)
    return {"state": full_state(model), "losses": losses, "placements": _placements(model)}


def _assert_matches(got: dict, want: dict, what: str) -> None:
    assert got["state"].keys() == want["state"].keys(), what
    worst = max((got["state"][k].float() - want["state"][k].float()).abs().max().item() for k in want["state"])
    assert worst <= 1e-4, f"{what}: max abs diff {worst}"


def _split_on_tensor(placements: dict) -> list[str]:
    return [n for n, (names, split, _) in placements.items()
            if "tensor" in names and split[names.index("tensor")].startswith(("Shard", "_StridedShard"))]


ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architectures_with_lora_under_tensor_parallelism_match_one_process(arch: str, tmp_path) -> None:
    """Fabric, world size 2 as one tensor group: each architecture's own plan (Qwen3's per-head norms with their
    gradients all-reduced, Gemma's tied embedding and head split alike, Phi-3's fused projections gathered), loaded
    by load_pretrained and lora.load_adapter (each rank its slices), 3 SGD steps: the adapters and the losses of one
    process (<= 1e-4), with the plan's layers split on every rank. Phi-3 without LoRA: its plan gathers the fused
    projections' outputs ('colwise_gather_output'), behind which peft does not split adapters (refused, below)."""
    lora = arch != "phi3"
    base, adapter = _pretrained(arch, str(tmp_path), lora=lora)
    want = _fabric_reference(arch, base, adapter, steps=3)
    for rank in run_distributed(_fabric_tp, 2, arch, base, adapter, 3, {"tensor_parallel_size": 2}):
        split = _split_on_tensor(rank["placements"])
        assert any("embed_tokens" in n for n in split) and any("down_proj" in n for n in split), split
        assert not lora or any("lora_" in n for n in split), split
        _assert_matches(rank, want, arch)
        assert rank["losses"] == pytest.approx(want["losses"], abs=1e-4)
