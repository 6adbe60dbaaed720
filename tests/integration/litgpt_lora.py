"""LitGPT's own LoRA recipe (``litgpt/finetune/lora.py`` of the pinned LitGPT), run as its users run it.

``python litgpt_lora.py finetune_lora --config CONFIG``: exactly ``litgpt finetune_lora --config CONFIG`` (LitGPT's
own command line, this file only its entry point). ``LITGPT_STRATEGY`` in the environment changes the one line a
user changes: the recipe's ``ModelParallelStrategy(parallelize_fn=..., ...)`` becomes
``lightning_fsdp2.fabric.FSDP2Strategy()`` (``fsdp2``; ``unmatched_forward_timeout`` from
``UNMATCHED_FORWARD_TIMEOUT``) or Lightning's own ``DDPStrategy()`` (``ddp``); unset, the recipe runs as shipped.
Fabric's launcher starts the other rank by running this same command again, so it is deterministic.

:func:`write_inputs` makes what ``litgpt download`` and the Alpaca data module would leave on disk, tiny, and a
config file of the recipe's arguments.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True, lora_mlp=True)
WORDS = "give tell name list write describe the a of to and in is for three two one best way good day color sky".split()


def write_inputs(root: Path) -> None:
    """A tiny Llama-shaped LitGPT checkpoint (``model_config.yaml``, ``lit_model.pth``), a byte-level BPE tokenizer
    with its config, and an Alpaca-format data file, as ``litgpt download`` and the Alpaca data module leave them."""
    from litgpt.config import Config
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import Config as LoRAConfig
    from litgpt.model import GPT
    from litgpt.utils import save_config
    from tokenizers import ByteLevelBPETokenizer

    rng = torch.Generator().manual_seed(0)
    pick = lambda n: " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=rng))  # noqa: E731
    samples = [{"instruction": pick(5), "input": pick(3) if i % 2 else "", "output": pick(6)} for i in range(24)]
    data = root / "data" / "alpaca"
    data.mkdir(parents=True)
    (data / "alpaca_data_cleaned_archive.json").write_text(json.dumps(samples))

    checkpoint = root / "checkpoints" / "tiny-llama"
    checkpoint.mkdir(parents=True)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([json.dumps(s) for s in samples] * 4, vocab_size=320,
                                  special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    ))
    config = Config(name="tiny-llama", block_size=512, vocab_size=tokenizer.get_vocab_size(), padded_vocab_size=384,
                    n_layer=2, n_head=4, n_query_groups=2, n_embd=32, intermediate_size=64, rotary_percentage=1.0,
                    parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")
    save_config(config, checkpoint)
    torch.manual_seed(0)
    state = GPT(config).state_dict()
    # The adapters' starting values too (B not zero, so every adapter learns at once): LitGPT initializes them by
    # each strategy's own random draws (Lightning's ModelParallelStrategy on a CPU mesh draws each rank's shard from
    # that rank's generator, so both halves of a weight repeat each other), and the comparison is of the training
    # arithmetic. The recipe's `load_checkpoint(..., strict=False)` loads them with the base.
    lora = LoRAGPT(LoRAConfig(**{**asdict(config), **LORA}))
    state.update({name: torch.randn(p.shape) * 0.1 for name, p in lora.named_parameters() if "lora_" in name})
    torch.save(state, checkpoint / "lit_model.pth")


def write_config(root: Path, name: str, sample: bool) -> Path:
    """The recipe's arguments as a LitGPT config file (as its ``config_hub`` files): 4 optimizer steps of 4 samples
    at devices=2, LoRA on every projection, LoRA checkpoints every 2 steps. ``sample``: the recipe's evaluation at
    every step, and with it its sampling on rank 0 alone (``generate_example``)."""
    import yaml

    config = {
        "checkpoint_dir": str(root / "checkpoints" / "tiny-llama"),
        "out_dir": str(root / f"out-{name}"),
        "precision": "32-true",
        "devices": 2,
        **LORA,  # no dropout: the comparison is exact, with no draws that depend on a strategy's RNG use
        "data": {"class_path": "litgpt.data.Alpaca",
                 "init_args": {"download_dir": str(root / "data" / "alpaca"), "val_split_fraction": 0.25,
                               "num_workers": 0}},
        "train": {"save_interval": 2, "log_interval": 1, "global_batch_size": 4, "micro_batch_size": 1,
                  "lr_warmup_steps": 1, "epochs": 5, "max_steps": 4},
        "eval": {"interval": 1 if sample else 1000, "max_new_tokens": 4, "max_iters": 2},
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.02}},
        "logger_name": "csv",
        "seed": 1337,
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


if __name__ == "__main__":
    import litgpt.finetune.lora as recipe

    swap = os.environ.get("LITGPT_STRATEGY", "model_parallel")
    if swap == "fsdp2":
        from lightning_fsdp2.fabric import FSDP2Strategy

        timeout = float(os.environ.get("UNMATCHED_FORWARD_TIMEOUT", "60"))
        recipe.ModelParallelStrategy = lambda **_: FSDP2Strategy(unmatched_forward_timeout=timeout)
    elif swap == "ddp":  # the reference: Lightning's own DDP, no code of ours
        from lightning.fabric.strategies import DDPStrategy

        recipe.ModelParallelStrategy = lambda **_: DDPStrategy()
    from litgpt.__main__ import main

    main()
