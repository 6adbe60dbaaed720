"""LoRA fine-tuning of a Llama-architecture model with FSDP2Strategy (first, small version).

    python examples/lora_finetune.py                       # 2 CPU processes, tiny Llama, byte-level text
    python examples/lora_finetune.py --devices 4 --max-steps 50

The model is built in ``configure_model``; the strategy builds it on the meta device, shards each decoder layer
with ``fully_shard`` and gives each process only its shard. The corpus is Python's own standard-library source
text, read as bytes (vocabulary 256), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fsdp2 import FSDP2Strategy


def corpus_bytes(limit: int = 400_000) -> torch.Tensor:
    """UTF-8 bytes of a few standard-library modules: real English-and-code text that ships with Python."""
    import argparse as a, collections as c, json as j, textwrap as t  # noqa: E401 - just to locate their files

    text = b"".join(Path(m.__file__).read_bytes() for m in (a, t, j.decoder, c))  # type: ignore[arg-type]
    return torch.tensor(list(text[:limit]), dtype=torch.long)


class ChunkDataset(Dataset):
    """Consecutive, non-overlapping windows of ``seq_len`` tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        n = len(tokens) // seq_len
        self.windows = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.windows[i]


class LoRAFineTune(L.LightningModule):
    """Causal-LM fine-tuning of the LoRA adapters of a Llama model built in ``configure_model``."""

    def __init__(self, hidden: int = 128, layers: int = 4, rank: int = 8, lr: float = 3e-3, seq_len: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        # Lightning calls this hook again for validate/test/predict: build once.
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        hp = self.hparams
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=hp.hidden,
            intermediate_size=hp.hidden * 2,
            num_hidden_layers=hp.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=hp.seq_len,
        )
        lora = LoraConfig(r=hp.rank, lora_alpha=2 * hp.rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(LlamaForCausalLM(config), lora)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        self.log("tokens/s", batch.numel() * self.trainer.world_size / max(time.perf_counter() - self._t, 1e-9),
                 prog_bar=True)
        self._t = time.perf_counter()
        return loss

    def on_train_start(self) -> None:
        # Validation loss of the starting weights, inside `fit` so that it works under every launcher (with
        # start_method="spawn" each Trainer call gets fresh worker processes and a separate `validate` would
        # rebuild the model).
        self.trainer.fit_loop.epoch_loop.val_loop.setup_data()  # Lightning sets up val data lazily otherwise
        batches = [b.to(self.device) for b in itertools.islice(self.trainer.val_dataloaders, 4)]
        with torch.no_grad():
            losses = [self.model(input_ids=b, labels=b).loss for b in batches]
        self.log("val_loss_before", torch.stack(losses).mean(), sync_dist=True)
        self._t = time.perf_counter()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="bf16-true")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--start-method", default="popen", choices=["popen", "spawn", "fork", "forkserver"])
    parser.add_argument("--out", default="outputs/lora_finetune")
    args = parser.parse_args()

    L.seed_everything(0)
    module = LoRAFineTune()
    tokens = corpus_bytes()
    split = int(len(tokens) * 0.9)
    train = DataLoader(ChunkDataset(tokens[:split], module.hparams.seq_len), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(ChunkDataset(tokens[split:], module.hparams.seq_len), batch_size=args.batch_size)

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy = FSDP2Strategy(activation_checkpointing_policy={LlamaDecoderLayer}, start_method=args.start_method)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_val_batches=4,
        val_check_interval=args.max_steps,  # validate once, after the last step
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=args.out,
    )
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    before = float(trainer.callback_metrics["val_loss_before"])
    after = float(trainer.callback_metrics["val_loss"])
    if trainer.global_rank == 0:
        print(f"validation loss: {before:.4f} before, {after:.4f} after {args.max_steps} steps "
              f"(uniform over bytes would be {math.log(256):.4f})")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "val_loss.txt").write_text(f"{before} {after}\n")
        print(f"wrote {os.path.join(args.out, 'val_loss.txt')}")


if __name__ == "__main__":
    main()
