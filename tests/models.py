"""Tiny models and LightningModules shared by the tests."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB = 128
SEQ = 16


def tiny_llama_config(**overrides: Any):
    """A two-layer Llama with hidden size 64."""
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_llama(lora: bool = True, **config: Any) -> nn.Module:
    """A tiny ``transformers`` Llama, with a peft LoRA on q/v projections when ``lora``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(**config))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    return model


class TokenDataset(Dataset):
    """Fixed random token sequences (same for every process given the seed)."""

    def __init__(self, n: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LlamaModule(L.LightningModule):
    """Causal-LM training of a tiny Llama (+LoRA) built in ``configure_model``.

    ``start_state``: a full state dict loaded into the (possibly sharded) model at ``on_fit_start`` so that a
    sharded run and a single-process reference start from the same weights.
    """

    def __init__(
        self,
        lora: bool = True,
        start_state: dict[str, torch.Tensor] | None = None,
        lr: float = 1e-2,
        batch_size: int = 4,
        n_samples: int = 32,
        forwards_per_step: int = 1,
        **config: Any,
    ) -> None:
        super().__init__()
        self.lora, self.config_overrides = lora, config
        self.start_state, self.lr, self.batch_size, self.n_samples = start_state, lr, batch_size, n_samples
        self.forwards_per_step = forwards_per_step
        self.model: nn.Module | None = None
        self.seen_dtypes: list[torch.dtype] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_llama(self.lora, **self.config_overrides)

    def on_fit_start(self) -> None:
        if self.start_state is not None:
            load_full_state(self, self.start_state)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen_dtypes.append(self.dtype)
        # Several forwards before one backward: each half of the batch separately.
        chunks = batch.chunk(self.forwards_per_step)
        loss = sum(self.model(input_ids=c, labels=c).loss for c in chunks) / len(chunks)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, foreach=True)

    def train_dataloader(self) -> DataLoader:
        # In order, split across ranks like a DistributedSampler without shuffling: rank r takes samples r, r+N, ...
        # so that the ranks' batches together are exactly the single-process reference's batch (needs
        # `Trainer(use_distributed_sampler=False)`, since Lightning's own sampler shuffles).
        # The strategy's data-parallel split: ranks of one tensor-parallel group read the same samples.
        dataset = TokenDataset(self.n_samples)
        sampler = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            sampler = DistributedSampler(dataset, shuffle=False, **data_parallel_split(self))
        return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(8, seed=1), batch_size=self.batch_size)


def data_parallel_split(module: L.LightningModule) -> dict[str, int]:
    """``num_replicas`` and ``rank`` of this process among the data-parallel ranks (its strategy's
    ``distributed_sampler_kwargs``; every process without a trainer)."""
    trainer = getattr(module, "_trainer", None)
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
    if kwargs:
        return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]}
    return {"num_replicas": torch.distributed.get_world_size(), "rank": torch.distributed.get_rank()}


def train_plainly(model: nn.Module, steps: int, global_batch: int = 8) -> list[float]:
    """A single-process reference without this package: SGD (lr 0.1, momentum 0.9) over the trainable parameters,
    the first ``steps`` global batches of ``TokenDataset(32)`` in order; returns the losses."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    data, losses = TokenDataset(32).data, []
    for step in range(steps):
        batch = data[step * global_batch : (step + 1) * global_batch]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def probe_logits(model: nn.Module) -> torch.Tensor:
    """A causal LM's logits (fp32) on a fixed batch, to compare models without training them."""
    with torch.no_grad():
        return model(input_ids=TokenDataset(4).data).logits.float()


def load_full_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict into a plain or FSDP2-sharded module."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # set_model_state_dict replaces the dict's values (with shards, or with the tensors it loads into): hand it a copy
    # so the caller's dict stays the reference it was.
    state = {k: v.detach().clone() for k, v in state.items()}
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a plain or sharded module on CPU, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def quiet_trainer_kwargs() -> dict[str, Any]:
    """Trainer arguments that keep test output and disk use down."""
    return dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )


# --------------------------------------------------------------------------- checkpoints: pretrained and resume
GLOBAL_BATCH = 8  # split over the ranks, so every world size takes the same optimizer steps


def world() -> int:
    """This process's world size (1 without a process group)."""
    # Lightning's environment deletes WORLD_SIZE when a Trainer tears down; later Trainers in the process ask torch.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def save_tiny_pretrained(path, seed: int = 0, **config: Any):
    """A tiny Llama saved by `save_pretrained`, split into several safetensors files with an index."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config(**config)).save_pretrained(path, max_shard_size="100KB")
    return path


class ResumeModule(LlamaModule):
    """A tiny Llama (LoRA or fully trained) whose initial weights come from `load_pretrained`, with AdamW and a
    per-step LR schedule, so that a resume has weights, optimizer state, scheduler and loop progress to restore.
    The per-rank batch is `GLOBAL_BATCH / world size`: every world size takes the same steps."""

    def __init__(self, pretrained: str, lora: bool = False, **kwargs: Any) -> None:
        # lr 1e-3: Adam turns rounding differences of near-zero gradients into steps of up to lr, and a single-device
        # run rounds differently from a sharded one; a resume that lost any state is off by about lr, 10x the 1e-4.
        super().__init__(lora=lora, batch_size=GLOBAL_BATCH // world(), n_samples=16, lr=1e-3, **kwargs)
        self.pretrained = pretrained

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        from lightning_fsdp2 import load_pretrained

        model = LlamaForCausalLM(tiny_llama_config(**self.config_overrides))
        load_pretrained(model, self.pretrained)
        if self.lora:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        self.model = model

    def train_dataloader(self) -> DataLoader:
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # per data-parallel rank
            self.batch_size = GLOBAL_BATCH // data_parallel_split(self)["num_replicas"]
        return super().train_dataloader()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit_resumable(
    pretrained: str,
    epochs: int,
    save_to: str | None = None,
    resume_from: str | None = None,
    strategy: dict | None = None,
    module: dict | None = None,
) -> dict:
    """Fit a ResumeModule for `epochs` (in total, counting resumed ones) under FSDP2 at this process's world size."""
    from lightning_fsdp2 import FSDP2Strategy

    model = ResumeModule(pretrained, **(module or {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=world(), strategy=FSDP2Strategy(**(strategy or {})), max_epochs=epochs,
        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    trainer.fit(model, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"state": full_state(model), "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "ran": len(model.losses)}


def fit_resumable_single_device(
    pretrained: str, epochs: int, save_to: str | None = None, resume_from: str | None = None
) -> dict:
    """The same in this process with Lightning's default single-device strategy."""
    model = ResumeModule(pretrained)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, limit_val_batches=0, num_sanity_val_steps=0,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"state": full_state(model), "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}


def assert_same_run(resumed: dict, straight: dict, what: str) -> None:
    """Same step count, learning rate and weights (max abs diff <= 1e-4) as the uninterrupted run."""
    import pytest

    assert resumed["step"] == straight["step"], what
    assert resumed["lr"] == pytest.approx(straight["lr"]), f"{what}: LR schedule"
    assert resumed["state"].keys() == straight["state"].keys(), what
    worst = max((resumed["state"][k] - straight["state"][k]).abs().max().item() for k in straight["state"])
    assert worst <= 1e-4, f"{what}: max abs diff {worst}"


# --------------------------------------------------------------------------- architectures
def tiny_model(name: str):
    """A tiny model of architecture ``name`` and an input for it (keyword arguments of its forward)."""
    import transformers as tf

    lm = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    tokens = {"input_ids": TokenDataset(2).data}
    seq2seq = {**tokens, "decoder_input_ids": TokenDataset(2, seed=1).data[:, :8].clone()}
    builders = {
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **lm, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        "qwen3_moe_2": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(  # fewer experts than ranks sharing them
            **lm, moe_intermediate_size=32, num_experts=2, num_experts_per_tok=2)),
        "llama": lambda: tf.LlamaForCausalLM(tiny_llama_config()),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **lm, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**lm, num_local_experts=4, num_experts_per_tok=2)),
        "gpt_oss": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(  # experts with biases, attention sinks, windows
            **{**lm, "intermediate_size": 32}, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**lm)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**lm, head_dim=16)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**lm)),
        "mistral_window": lambda: tf.MistralForCausalLM(tf.MistralConfig(**lm, sliding_window=8)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**lm, head_dim=16)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**lm, head_dim=16)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**lm, pad_token_id=0)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=64)),
        "bert": lambda: tf.BertForSequenceClassification(tf.BertConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, num_labels=3)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)),
        "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)),
        "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=8, num_labels=3)),
    }
    inputs = {"t5": seq2seq, "bart": seq2seq}.get(name, tokens)
    if name == "vit":
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    return builders[name](), inputs


def training_inputs(name: str, inputs: dict) -> dict:
    """The training inputs: the model's own loss needs labels (classes for BERT and ViT, tokens otherwise)."""
    if name in ("bert", "vit"):
        batch = next(iter(inputs.values())).shape[0]
        return {**inputs, "labels": torch.arange(batch) % 3}
    if name in ("t5", "bart"):
        return {**inputs, "labels": inputs["decoder_input_ids"]}
    return {**inputs, "labels": inputs["input_ids"]}
