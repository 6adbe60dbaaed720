"""The small things the Fabric example (``examples/fabric_lora.py``) trains on: a tiny random Llama written locally
on the first run, and text from Python's own standard-library source (nothing is downloaded)."""

from __future__ import annotations

import argparse
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch.utils.data import Dataset


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
