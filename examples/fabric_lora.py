"""LoRA fine-tuning of a Hugging Face Llama-architecture model, sharded with FSDP2, as a Lightning Fabric loop.

    python examples/fabric_lora.py                                    # tiny Llama made locally, 2 CPU processes
    python examples/fabric_lora.py --model path/to/llama --accelerator cuda --devices 8 --precision bf16-mixed
    python examples/fabric_lora.py --resume outputs/fabric_lora/checkpoint.pt --max-steps 120   # continue a run

A LoRA fine-tune of a tiny Llama on standard-library text (``examples/tiny_llama.py``; the Trainer demo,
``examples/lora_finetune.py``, fine-tunes the real SmolLM2-135M-Instruct), with the training loop written out:
``fabric.init_module()`` builds the model on the meta device and ``load_pretrained`` declares its weights;
``fabric.setup_module`` shards each decoder layer, gives every process only its shard and reads only that shard's
slice of the weights; the loop accumulates gradients without communication (``no_backward_sync``),
clips by the global norm and steps. ``fabric.save`` writes a checkpoint every ``--checkpoint-every`` steps and at the
end (one file, readable by a one-device Fabric run; ``--sharded`` for a directory of every rank's shards), and
``--resume`` continues from one at any number of processes. At the end every process helps write the adapters
(peft's format), the merged model and the loss curve.

Outputs under ``--out`` (default ``outputs/fabric_lora``): ``checkpoint.pt`` (or ``checkpoint/`` with
``--sharded``), ``adapter/`` (``PeftModel.from_pretrained(base, path)``), ``merged/`` (unless ``--no-merge``;
``AutoModelForCausalLM.from_pretrained(path)``), ``loss.png``, ``val_loss.txt``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from lora_finetune import is_decoder_layer, plot_losses
from tiny_llama import ChunkDataset, corpus_text, tiny_llama, tokenize
from torch.utils.data import DataLoader

from lightning_fsdp2 import load_pretrained
from lightning_fsdp2.fabric import FSDP2Strategy
from lightning_fsdp2.lora import load_adapter, save_adapter, save_merged


def build(model_dir: Path, adapter: str | None, rank: int) -> torch.nn.Module:
    """The peft model; under ``fabric.init_module()`` on the meta device, its weights read after sharding."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    load_pretrained(base, model_dir)
    if adapter:
        lora = LoraConfig.from_pretrained(adapter)
        lora.inference_mode = False  # saved adapters are marked for inference; we train them further
    else:
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                          task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    if adapter:
        load_adapter(model, adapter)
    return model


@torch.no_grad()
def evaluate(fabric: L.Fabric, model: torch.nn.Module, val: DataLoader, batches: int = 4) -> float:
    """Mean validation loss over the first ``batches`` batches of every process."""
    model.eval()
    losses = [model(input_ids=b, labels=b).loss for _, b in zip(range(batches), val)]
    model.train()
    return float(fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean"))


def forever(loader: DataLoader) -> Iterator[torch.Tensor]:
    """Batches without end, a new shuffle each epoch (the sampler's epoch set, as Lightning's loops do)."""
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """--help shows each default, and the description as written."""

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    parser.add_argument("--model", help="Hugging Face model directory (default: a tiny Llama made locally)")
    parser.add_argument("--adapter", help="start from peft adapters saved earlier (a directory)")
    parser.add_argument("--resume", help="continue from a checkpoint this script saved (file or --sharded directory)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", default="2", help="as Fabric(devices=...): a number, 'auto', or a list '0,1'")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="bf16-true", help="bf16-true, bf16-mixed, 32-true, ...")
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps in total (counting resumed ones)")
    parser.add_argument("--batch-size", type=int, default=4, help="per process and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip gradients to this global norm")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also save a checkpoint every N steps")
    parser.add_argument("--sharded", action="store_true", help="save sharded checkpoints (a directory)")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True, help="write the merged model")
    parser.add_argument("--out", default="outputs/fabric_lora")
    args = parser.parse_args()

    strategy = FSDP2Strategy(
        activation_checkpointing_policy=is_decoder_layer,
        state_dict_type="sharded" if args.sharded else "full",
    )
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
    )
    # Before `launch`: Lightning's launcher starts the other processes after the main one has made the tiny model.
    # (Once the process group exists, transformers' `save_pretrained` writes only on rank 0.)
    model_dir = Path(args.model) if args.model else tiny_llama(Path("outputs/tiny-llama"))
    fabric.launch()
    fabric.seed_everything(0)
    out = Path(args.out)
    if fabric.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoConfig

    tokens = tokenize(corpus_text(), model_dir, AutoConfig.from_pretrained(model_dir).vocab_size)
    split = int(len(tokens) * 0.9)
    train = DataLoader(ChunkDataset(tokens[:split], args.seq_len), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(ChunkDataset(tokens[split:], args.seq_len), batch_size=args.batch_size)
    train, val = fabric.setup_dataloaders(train, val)

    with fabric.init_module():  # parameters on meta: nothing allocated yet
        model = build(model_dir, args.adapter, args.rank)
    model = fabric.setup_module(model)  # sharded; each process reads its slices of the weights
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    )
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # into the shards, at any number of processes
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    checkpoint = out / ("checkpoint" if args.sharded else "checkpoint.pt")
    before = evaluate(fabric, model, val)
    curve: list[tuple[int, float]] = []
    batches = forever(train)
    started = time.perf_counter()
    while state["step"] < args.max_steps:
        total = 0.0
        for micro in range(args.accumulate):
            batch = next(batches)
            # Micro-batches that only accumulate skip the gradient reduce-scatter; the last one reduces the sum.
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = model(input_ids=batch, labels=batch).loss / args.accumulate
                fabric.backward(loss)
            total += float(loss.detach())
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        curve.append((state["step"], float(fabric.all_reduce(torch.tensor(total), reduce_op="mean"))))
        if state["step"] % 10 == 0 or state["step"] == args.max_steps:
            seen = args.batch_size * args.seq_len * args.accumulate * fabric.world_size * len(curve)
            fabric.print(f"step {state['step']:4d}  loss {curve[-1][1]:.4f}"
                         f"  {seen / (time.perf_counter() - started):,.0f} tokens/s")
        if args.checkpoint_every and state["step"] % args.checkpoint_every == 0:
            fabric.save(checkpoint, state)
    after = evaluate(fabric, model, val)

    # On every process: saving and the exports gather the shards, so all processes take part.
    fabric.save(checkpoint, state)
    save_adapter(model, out / "adapter")
    if args.merge:
        save_merged(model, out / "merged")
    if fabric.is_global_zero:
        (out / "val_loss.txt").write_text(f"{before} {after}\n")
        plot_losses(curve, before, after, out / "loss.png")
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        print(f"validation loss: {before:.4f} before, {after:.4f} after {state['step']} steps"
              f" (uniform over the vocabulary would be {math.log(vocab):.4f})")
        print(f"checkpoint:   {checkpoint}  (fabric.load(path, state), --resume)")
        print(f"adapter:      {out / 'adapter'}  (PeftModel.from_pretrained(base, path))")
        if args.merge:
            print(f"merged model: {out / 'merged'}  (AutoModelForCausalLM.from_pretrained(path))")
        print(f"loss curve:   {out / 'loss.png'}")
        print(f"val loss:     {out / 'val_loss.txt'}")


if __name__ == "__main__":
    main()
