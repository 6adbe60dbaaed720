"""The wrapping policy, post-order sharding, adapters and tied weights, activation checkpointing."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from lightning_fsdp2 import FSDP2Strategy
from lightning_fsdp2.init import initialize_module, materialize_module, meta_init_context
from lightning_fsdp2.wrap import default_block_classes, resolve_policy, shard_model
from tests.helpers import run_distributed
from tests.models import LlamaModule, TokenDataset, build_llama, quiet_trainer_kwargs


def test_default_blocks_come_from_hf_no_split_modules() -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert default_block_classes(build_llama(lora=True)) == {LlamaDecoderLayer}


def test_default_blocks_fall_back_to_torch_transformer_layers_then_repeated_children() -> None:
    demo = Transformer(vocab_size=32, ninp=16, nhead=2, nhid=16, nlayers=2)
    assert default_block_classes(demo) == {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    stack = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([Block(), Block(), Block()]), nn.Linear(4, 8))
    assert default_block_classes(stack) == {Block}
    assert default_block_classes(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == set()


def test_policy_forms() -> None:
    linear = nn.Linear(2, 2)
    assert resolve_policy({nn.Linear}, linear)("x", linear)
    assert not resolve_policy(lambda name, module: name.startswith("a"), linear)("b", linear)
    with pytest.raises(TypeError, match="set of nn.Module classes or a callable"):
        resolve_policy(42, linear)  # type: ignore[arg-type]


def _shard(policy_name: str, tie: bool) -> dict:
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        with meta_init_context():
            model = build_llama(lora=True, tie_word_embeddings=tie)
        holder = nn.Module()  # stands for the LightningModule: the network is its child `model`
        holder.model = model
        names_before = [n for n, _ in holder.named_parameters()]
        policy = {"default": None, "linear+embedding": {nn.Linear, nn.Embedding}, "nothing": {nn.Conv2d}}[policy_name]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            groups = shard_model(holder, mesh, policy)
        initialize_module(holder, materialize_module(holder, torch.device("cpu")))
        inner = model.base_model.model
        ids = torch.randint(0, 128, (2, 8))
        logits = model(input_ids=ids).logits
        return {
            "groups": groups,
            "names_same": [n for n, _ in holder.named_parameters()] == names_before,
            "tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
            "finite": bool(torch.isfinite(logits).all()),
            "warnings": [str(w.message) for w in caught if "selected no module" in str(w.message)],
        }
    finally:
        dist.destroy_process_group()


def test_default_policy_shards_decoder_layers_post_order_then_root() -> None:
    result = run_distributed(_shard, 2, "default", False)[0]
    prefix = "model.base_model.model.model.layers"
    # Children before parents: layer 1 is visited before layer 0 in the reversed walk; the root (the child of the
    # sharded module that holds the parameters) comes last.
    assert result["groups"] == [f"{prefix}.1", f"{prefix}.0", "model"]
    assert result["names_same"] and result["finite"]


def test_a_policy_that_selects_nothing_is_said_once() -> None:
    """Only the roots sharded means the whole model gathered at once: rank 0 warns, naming the fix."""
    first, second = run_distributed(_shard, 2, "nothing", False)
    assert first["groups"] == ["model"]
    assert len(first["warnings"]) == 1 and "auto_wrap_policy={BlockClass}" in first["warnings"][0]
    assert second["warnings"] == []
    assert run_distributed(_shard, 2, "default", False)[0]["warnings"] == []


def test_adapters_stay_with_their_layer_and_tied_weights_with_the_root() -> None:
    """A policy that selects every Linear and Embedding must not split lora_A/lora_B from their layer, nor put the
    tied embedding in a group the head cannot share (FSDP2 would raise 'shared with a parameter already managed')."""
    result = run_distributed(_shard, 2, "linear+embedding", True)[0]
    groups = result["groups"]
    assert not any(".lora_A" in g or ".lora_B" in g or ".base_layer" in g for g in groups)
    assert not any(g.endswith("q_proj") or g.endswith("v_proj") for g in groups)  # peft layers: not nn.Linear
    assert any(g.endswith("k_proj") for g in groups)  # plain Linear layers are groups
    assert not any(g.endswith("embed_tokens") or g.endswith("lm_head") for g in groups)
    assert result["tied"] and result["names_same"] and result["finite"]


class CountingModule(LlamaModule):
    def on_fit_start(self) -> None:
        self.forward_calls = 0
        layer = self.model.base_model.model.model.layers[0]
        layer.register_forward_pre_hook(lambda *_: setattr(self, "forward_calls", self.forward_calls + 1))


def _count_forwards(checkpointing: bool) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    module = CountingModule()
    strategy = FSDP2Strategy(activation_checkpointing_policy={LlamaDecoderLayer} if checkpointing else None)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, limit_val_batches=0, **quiet_trainer_kwargs()
    )
    trainer.fit(module)
    return {"calls": module.forward_calls, "names": [n for n, _ in module.named_parameters()]}


def test_activation_checkpointing_recomputes_blocks_and_keeps_names_clean() -> None:
    plain = run_distributed(_count_forwards, 2, False)[0]
    checkpointed = run_distributed(_count_forwards, 2, True)[0]
    assert plain["calls"] == 1
    assert checkpointed["calls"] == 2  # the forward, then its recomputation in backward
    eager = LlamaModule()
    eager.configure_model()
    assert checkpointed["names"] == [n for n, _ in eager.named_parameters()]


class DirectParameterModule(LlamaModule):
    """Holds a parameter of its own, so the LightningModule itself must be the root."""

    def configure_model(self) -> None:
        super().configure_model()
        self.temperature = nn.Parameter(torch.ones(1))  # fully_shard refuses 0-dim parameters

    def reset_parameters(self) -> None:
        # Built on meta like everything in configure_model: without this rule the strategy would refuse to train
        # on an uninitialized `temperature` (UninitializedError).
        nn.init.ones_(self.temperature)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch).logits / self.temperature
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


class OutsideStepModule(LlamaModule):
    """Calls the model outside any *_step hook, as callbacks and generation code do."""

    def on_train_start(self) -> None:
        with torch.no_grad():
            self.outside = float(self.model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.sum())


def _roots_and_training(kind: str) -> dict:
    module = {"direct": DirectParameterModule, "outside": OutsideStepModule}[kind]()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=2, limit_val_batches=0, **quiet_trainer_kwargs()
    )
    trainer.fit(module)
    roots = [n for n, m in module.named_modules() if isinstance(m, FSDPModule) and "layers" not in n]
    return {
        "roots": roots,
        "outside": getattr(module, "outside", 0.0),
        "temperature_grad": kind == "direct" and module.temperature.grad is not None,
    }


def test_model_child_is_the_root_and_callable_outside_steps() -> None:
    result = run_distributed(_roots_and_training, 2, "outside")[0]
    assert result["roots"] == ["model"]
    assert torch.isfinite(torch.tensor(result["outside"]))


def test_lightning_module_with_own_parameters_is_the_root() -> None:
    result = run_distributed(_roots_and_training, 2, "direct")[0]
    assert result["roots"] == [""]
    assert result["temperature_grad"]


class T5Module(L.LightningModule):
    """A tiny T5 (its config keeps the key/value cache on, as the Hub's do), trained with its blocks checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import T5Config, T5ForConditionalGeneration

            config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                              decoder_start_token_id=0, use_cache=True)
            self.model = T5ForConditionalGeneration(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(8), batch_size=2)


def _t5_with_checkpointing() -> dict:
    from transformers.models.t5.modeling_t5 import T5Block

    module = T5Module()
    strategy = FSDP2Strategy(activation_checkpointing_policy={T5Block})
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, limit_val_batches=0, **quiet_trainer_kwargs()
    )
    trainer.fit(module)
    module.model.eval()
    with torch.no_grad():
        out = module.model(input_ids=torch.zeros(1, 4, dtype=torch.long), decoder_input_ids=torch.zeros(1, 1, dtype=torch.long))
    return {"losses": module.losses, "use_cache": module.model.config.use_cache, "eval_cache": out.past_key_values is not None}


def test_activation_checkpointing_turns_off_a_models_kv_cache_for_training() -> None:
    """T5 keeps its cache in training by default, which checkpointing cannot recompute: off during training steps
    only; the config (saved with the model) and evaluation keep it."""
    result = run_distributed(_t5_with_checkpointing, 2)[0]
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["use_cache"] is True and result["eval_cache"]
