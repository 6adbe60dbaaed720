"""LoRA fine-tuning of a Hugging Face Llama-architecture model, sharded with FSDP2, from a Lightning Trainer.

    python examples/lora_finetune.py                                   # tiny Llama made locally, 2 CPU processes
    python examples/lora_finetune.py --model path/to/llama --accelerator cuda --devices 8 --precision bf16-mixed
    python examples/lora_finetune.py --adapter outputs/lora_finetune/adapter/final   # continue from saved adapters
    python examples/lora_finetune.py --qlora      # QLoRA: the base's linear weights in 4-bit NF4 (torchao)

The base model comes from a Hugging Face directory (``--model``); without one, a tiny random Llama is written to
``outputs/tiny-llama`` on the first run (nothing is downloaded). The text is Python's own standard-library source,
tokenized with the model's tokenizer if its directory has one, else as bytes (vocabulary 256).

What happens, in order: ``configure_model`` builds the model on the meta device (free), declares its weights with
``load_pretrained`` and wraps it with peft's LoRA; FSDP2Strategy shards each decoder layer, gives every process
only its shard and reads only that shard's slice of the weights; training shows loss and tokens/s on the progress
bar; at the end every process helps write the adapters (peft's format), the merged model and the loss curve.

Outputs under ``--out`` (default ``outputs/lora_finetune``): ``adapter/final`` (``adapter_model.safetensors`` +
``adapter_config.json``; ``adapter/step=N`` with ``--export-every N``), ``merged/`` (unless ``--no-merge``;
loadable with ``AutoModelForCausalLM.from_pretrained``), ``loss.png``, ``val_loss.txt``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
import uuid
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fsdp2 import FSDP2Strategy, load_pretrained
from lightning_fsdp2.lora import AdapterExport, load_adapter, save_merged


# ------------------------------------------------------------------------------------------------ data
def corpus_text(limit: int = 400_000) -> str:
    """A few standard-library modules' source: real English-and-code text that ships with Python."""
    import collections
    import json.decoder
    import textwrap

    modules = (argparse, textwrap, json.decoder, collections)
    return "".join(Path(m.__file__).read_text() for m in modules)[:limit]  # type: ignore[arg-type]


def tokenize(text: str, model_dir: Path, vocab_size: int) -> torch.Tensor:
    """Token ids from the model's own tokenizer if its directory has one, else UTF-8 bytes."""
    if any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return torch.tensor(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"], dtype=torch.long)
    if vocab_size < 256:
        raise SystemExit(f"{model_dir} has no tokenizer and a vocabulary of {vocab_size} < 256: cannot use bytes.")
    return torch.tensor(list(text.encode()), dtype=torch.long)


class ChunkDataset(Dataset):
    """Consecutive, non-overlapping windows of ``seq_len`` tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        n = len(tokens) // seq_len
        self.windows = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.windows[i]


def tiny_llama(path: Path, **shape: int) -> Path:
    """A small random Llama (4 layers, hidden 128, byte vocabulary; ``shape`` overrides), written on the first run.

    Any process may be first (a launcher, torchrun or SLURM task, on any machine): each writes a private copy (the
    same bytes: the seed is fixed) and renames it into place; whoever loses the race drops its copy.
    """
    if (path / "config.json").exists():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{
        **dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
        **shape,
    })
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    LlamaForCausalLM(config).save_pretrained(tmp)
    try:
        os.replace(tmp, path)  # all at once: a process that sees config.json sees the weights
    except OSError:
        if not (path / "config.json").exists():
            raise
        shutil.rmtree(tmp)  # another process was first
    return path


# ------------------------------------------------------------------------------------------------ model
class LoRAFineTune(L.LightningModule):
    """Causal-LM fine-tuning of LoRA adapters on a pretrained model that is built in ``configure_model``."""

    def __init__(self, model_dir: str, adapter: str | None = None, rank: int = 8, lr: float = 3e-3,
                 out: str = "outputs/lora_finetune", merge: bool = True, qlora: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        self.curve: list[tuple[int, float]] = []  # (step, loss averaged over all processes)

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls this hook again for validate/test/predict: build once
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        hp = self.hparams
        # On the meta device under FSDP2Strategy: no memory yet. The weights are read after sharding.
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hp.model_dir))
        # QLoRA: the base's linear weights stored in 4-bit NF4 (torchao), quantized as they are read.
        load_pretrained(base, hp.model_dir, quantize="nf4" if hp.qlora else None)
        if hp.adapter:
            lora = LoraConfig.from_pretrained(hp.adapter)
            lora.inference_mode = False  # saved adapters are marked for inference; we train them further
        else:
            lora = LoraConfig(r=hp.rank, lora_alpha=2 * hp.rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                              task_type="CAUSAL_LM")
        self.model = get_peft_model(base, lora)
        if hp.adapter:
            load_adapter(self.model, hp.adapter)

    def on_train_start(self) -> None:
        # Validation loss of the starting weights, inside `fit` so that it works under every launcher (with
        # start_method="spawn" each Trainer call gets fresh worker processes).
        val_loop = self.trainer.fit_loop.epoch_loop.val_loop
        val_loop.setup_data()  # Lightning sets up val data lazily otherwise
        batches = [b.to(self.device) for _, b in zip(range(4), self.trainer.val_dataloaders)]
        with torch.no_grad():
            losses = [self.model(input_ids=b, labels=b).loss for b in batches]
        self.log("val_loss_before", torch.stack(losses).mean(), sync_dist=True)
        self._t = time.perf_counter()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        now = time.perf_counter()
        self.log("tokens/s", batch.numel() * self.trainer.world_size / max(now - self._t, 1e-9), prog_bar=True)
        self._t = now
        self.curve.append((self.trainer.global_step + 1, float(self.trainer.strategy.reduce(loss.detach()))))
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)

    def on_train_end(self) -> None:
        # Still inside `fit`, on every process: the exports gather the shards, so all processes take part.
        out = Path(self.hparams.out)
        if self.hparams.merge:
            save_merged(self, out / "merged")
        if self.trainer.is_global_zero:
            metrics = self.trainer.callback_metrics
            before, after = float(metrics["val_loss_before"]), float(metrics["val_loss"])
            (out / "val_loss.txt").write_text(f"{before} {after}\n")
            plot_losses(self.curve, before, after, out / "loss.png")
            vocab = self.model.get_base_model().config.vocab_size
            print(f"validation loss: {before:.4f} before, {after:.4f} after {self.trainer.global_step} steps"
                  f" (uniform over the vocabulary would be {math.log(vocab):.4f})")
            print(f"adapter:      {out / 'adapter' / 'final'}  (PeftModel.from_pretrained(base, path))")
            if self.hparams.merge:
                print(f"merged model: {out / 'merged'}  (AutoModelForCausalLM.from_pretrained(path))")
            print(f"loss curve:   {out / 'loss.png'}")
            print(f"val loss:     {out / 'val_loss.txt'}")


def plot_losses(curve: list[tuple[int, float]], before: float, after: float, path: Path) -> None:
    """Training loss per step, and the validation loss before and after, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*curve) if curve else ((), ())
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, label="training loss (mean over processes)")
    ax.scatter([0, steps[-1] if steps else 0], [before, after], color="C1", zorder=3, label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
def is_decoder_layer(name: str, module: torch.nn.Module) -> bool:
    """Activation checkpointing policy: each decoder layer of any Llama-like model (a plain function, not a lambda,
    so that the strategy can be pickled for start_method="spawn")."""
    return type(module).__name__.endswith("DecoderLayer")


def epochs_for(steps: int, batches: int, devices: str, num_nodes: int) -> int | None:
    """Enough epochs for ``steps`` optimizer steps when each process gets ``1/world`` of the ``batches``; ``None``
    (Lightning's default: as many as needed) when the number of devices is not a plain number."""
    if not devices.isdigit():
        return None
    per_process = max(1, math.ceil(batches / (int(devices) * num_nodes)))
    return math.ceil(steps / per_process)


def main() -> None:
    class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """--help shows each default, and the description as written."""

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    parser.add_argument("--model", help="Hugging Face model directory (default: a tiny Llama made locally)")
    parser.add_argument("--adapter", help="start from peft adapters saved earlier (a directory)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", default="2", help="as Trainer(devices=...): a number, 'auto', or a list '0,1'")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="bf16-true", help="bf16-true, bf16-mixed, 32-true, ...")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--export-every", type=int, default=0, help="also save the adapters every N steps")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True, help="write the merged model")
    parser.add_argument("--qlora", action="store_true",
                        help="QLoRA: store the base's linear weights in 4-bit NF4 (needs lightning-fsdp2[qlora])")
    parser.add_argument("--start-method", default="popen", choices=["popen", "spawn", "fork", "forkserver"])
    parser.add_argument("--out", default="outputs/lora_finetune")
    args = parser.parse_args()

    if args.model:
        model_dir = Path(args.model)
    elif args.qlora:  # NF4 quantizes blocks of 16,384 values, split evenly over the processes: wider projections
        model_dir = tiny_llama(Path("outputs/tiny-llama-qlora"), hidden_size=256, intermediate_size=512,
                               num_key_value_heads=4)
    else:
        model_dir = tiny_llama(Path("outputs/tiny-llama"))
    L.seed_everything(0)
    from transformers import AutoConfig

    tokens = tokenize(corpus_text(), model_dir, AutoConfig.from_pretrained(model_dir).vocab_size)
    split = int(len(tokens) * 0.9)
    train = DataLoader(ChunkDataset(tokens[:split], args.seq_len), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(ChunkDataset(tokens[split:], args.seq_len), batch_size=args.batch_size)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    module = LoRAFineTune(str(model_dir), args.adapter, args.rank, args.lr, args.out, args.merge, args.qlora)
    strategy = FSDP2Strategy(
        activation_checkpointing_policy=is_decoder_layer,
        start_method=args.start_method,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        max_epochs=epochs_for(args.max_steps, len(train), args.devices, args.num_nodes),  # for the progress bar
        limit_val_batches=4,
        val_check_interval=args.max_steps,  # validate once, after the last step
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=args.out,
        callbacks=[AdapterExport(Path(args.out) / "adapter", every_n_train_steps=args.export_every or None)],
    )
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)


if __name__ == "__main__":
    main()
