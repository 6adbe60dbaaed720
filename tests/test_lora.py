"""LoRA adapters out of and into the sharded model: peft's format, a merged Hugging Face model, starting from saved
adapters. Each compared with the trained sharded model's own logits."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fsdp2 import FSDP2Strategy, load_pretrained
from lightning_fsdp2.lora import AdapterExport, load_adapter, save_merged
from tests.helpers import run_distributed
from tests.models import ResumeModule, TokenDataset, probe_logits, quiet_trainer_kwargs, tiny_llama_config


def _train_and_export(pretrained: str, out: str) -> dict:
    """Two LoRA steps at world size 2 with the adapters exported every step and at the end, then a merged export."""
    module = ResumeModule(pretrained, lora=True)
    module.lr = 3e-2  # large enough that the adapters move visibly in two steps
    export = AdapterExport(Path(out) / "adapters", every_n_train_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_epochs=1, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[export], **quiet_trainer_kwargs(),
    )
    trainer.fit(module)
    save_merged(module, Path(out) / "merged")
    return {"logits": probe_logits(module.model), "saved": [p.name for p in export.saved]}


class FromAdapter(L.LightningModule):
    """Starts from a pretrained base and saved adapters; records logits in validation."""

    def __init__(self, pretrained: str, adapter: str, verify: bool = True) -> None:
        super().__init__()
        self.pretrained, self.adapter, self.verify = pretrained, adapter, verify
        self.model = None
        self.logits: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        base = LlamaForCausalLM(tiny_llama_config())
        load_pretrained(base, self.pretrained)
        self.model = get_peft_model(base, LoraConfig.from_pretrained(self.adapter))
        load_adapter(self.model, self.adapter, verify=self.verify)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.logits.append(self.model(input_ids=batch).logits.detach().float())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(4), batch_size=4)


def _start_from_adapter(pretrained: str, adapter: str) -> torch.Tensor:
    module = FromAdapter(pretrained, adapter)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    return module.logits[0]


@pytest.mark.slow
def test_exported_adapters_and_merged_model_give_the_trainedprobe_logits(pretrained: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trained = run_distributed(_train_and_export, 2, str(pretrained), str(tmp_path))
    assert trained[0]["saved"] == trained[1]["saved"] == ["step=1", "step=2", "final"]
    expected = trained[0]["logits"]
    assert torch.allclose(trained[1]["logits"], expected)

    final = tmp_path / "adapters" / "final"
    assert {p.name for p in final.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    base_logits = probe_logits(AutoModelForCausalLM.from_pretrained(pretrained))
    assert (base_logits - expected).abs().max() > 1e-3, "the adapters were trained"

    # The whole adapter, not rank 0's slice: loads into the base in one process with peft and gives the same logits.
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), final)
    assert torch.allclose(probe_logits(with_adapter), expected, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert torch.allclose(probe_logits(merged), expected, atol=1e-4)

    # A fine-tune started from the saved adapters (sharded again) has them.
    restarted = run_distributed(_start_from_adapter, 2, str(pretrained), str(final))
    for logits in restarted:
        assert torch.allclose(logits, expected, atol=1e-5)


def test_merged_and_adapter_exports_pick_one_adapter_keep_ties_and_leave_the_model_alone(tmp_path: Path) -> None:
    """In one process (no FSDP): a tied-embedding model with two adapters. Exporting the second one merges and saves
    only it, the tie survives, and the live model is not changed by the merge."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from lightning_fsdp2.lora import save_adapter

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj", "k_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    model.set_adapter("other")
    expected = probe_logits(model)
    state_before = {k: v.clone() for k, v in model.state_dict().items()}

    save_merged(model, tmp_path / "merged", adapter_name="other")
    save_adapter(model, tmp_path / "adapter", adapter_name="other")

    assert all(torch.equal(v, state_before[k]) for k, v in model.state_dict().items()), "the live model was changed"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert torch.allclose(probe_logits(merged), expected, atol=1e-5)
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert torch.allclose(probe_logits(reloaded), expected, atol=1e-5)


# --------------------------------------------------------------------------- generate() on the sharded model
class Sampling(L.LightningModule):
    """Two SGD steps (LoRA from peft's saved adapter, or the plain model); greedy `generate` after each step."""

    def __init__(self, pretrained: str, adapter: str | None) -> None:
        super().__init__()
        self.pretrained, self.adapter = pretrained, adapter
        self.model = None
        self.samples: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.model is None:
            from peft import PeftConfig, get_peft_model
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM(tiny_llama_config())
            load_pretrained(self.model, self.pretrained)
            if self.adapter:
                config = PeftConfig.from_pretrained(self.adapter)
                config.inference_mode = False  # peft saves adapters marked for inference; train them further
                self.model = get_peft_model(self.model, config)
                load_adapter(self.model, self.adapter)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        rank, world = self.global_rank, self.trainer.world_size
        tokens = TokenDataset(2).data[rank::world]
        return self.model(input_ids=tokens, labels=tokens).loss

    def on_train_batch_end(self, *args) -> None:  # mid-training, outside the step: peft's generate bypasses forward
        prompt = TokenDataset(2, seed=3).data[:, :6]
        self.samples.append(self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                                max_new_tokens=6, do_sample=False, pad_token_id=0))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TokenDataset(2), batch_size=1)


def _sample_sharded(pretrained: str, adapter: str | None) -> list[torch.Tensor]:
    module = Sampling(pretrained, adapter)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=2, limit_val_batches=0,
                        num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    return module.samples


@pytest.mark.parametrize("lora", [True, False], ids=["peft", "plain"])
def test_generate_mid_training_gives_the_tokens_of_one_process(lora: bool, pretrained: Path, tmp_path: Path) -> None:
    """Greedy sampling after each training step at world size 2 (peft's generate calls the Hugging Face model's,
    bypassing the peft model's forward) gives the tokens one process gives after the same steps."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    reference = LlamaForCausalLM.from_pretrained(pretrained)
    adapter = None
    if lora:
        reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # adapters that change the outputs from the start
            for param in reference.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.3)
        adapter = str(tmp_path / "adapter")
        reference.save_pretrained(adapter)
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    tokens, prompt = TokenDataset(2).data, TokenDataset(2, seed=3).data[:, :6]
    expected = []
    for _ in range(2):
        optimizer.zero_grad()
        reference(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        expected.append(reference.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                           do_sample=False, pad_token_id=0))
    if lora:  # the adapters change what is sampled
        with reference.disable_adapter():
            plain = reference.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                       do_sample=False, pad_token_id=0)
        assert not torch.equal(plain, expected[-1])
    for samples in run_distributed(_sample_sharded, 2, str(pretrained), adapter):
        assert len(samples) == 2
        for got, want in zip(samples, expected):
            assert torch.equal(got, want), (got, want)
