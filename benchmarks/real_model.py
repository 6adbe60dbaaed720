"""LoRA fine-tuning of the real SmolLM2-135M-Instruct at world size 2: FSDP2Strategy against its peers, side by side.

The demo's model (``examples/smollm2.py``: 30 layers, 134.5M parameters, tied embeddings) and LoRA r=8 on q/k/v/o,
batches of 2 x 128 tokens per process packed from the demo's task (``examples/docstring_task.py``), ``bf16-true``,
CPU/gloo, one thread per process. Contenders, each loading the real weights its own way:

- ``fsdp2``: ``FSDP2Strategy()``, the default (every decoder layer sharded), weights by ``load_pretrained``;
- ``fsdp2_auto``: ``FSDP2Strategy(device_mesh="auto")`` (the layout chosen from memory: replication where it fits);
- ``model_parallel``: Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with a
  hand-written ``fully_shard`` of each decoder layer and the root in ``configure_model``, then the weights as torchtune
  loads them: rank 0 reads the file and DCP's ``set_model_state_dict(..., broadcast_from_rank0=True)`` scatters it;
- ``ddp``: Lightning's ``DDPStrategy`` with ``from_pretrained`` on every rank.

``--nf4`` runs the same with the base's linear weights in NF4 (QLoRA; the attention projections, whose shapes NF4
cannot split over 2 processes, stay bf16, as in the demo's ``--qlora``) for ``fsdp2``, ``fsdp2_auto`` and ``ddp``
(the base quantized in place by torchao's ``to_nf4`` in each process).

Measured: tokens/s over the timed steps (after warm-up; all processes' tokens), each rank's peak RSS (``VmHWM``)
above what it held when ``fit`` started, and the start-up time from ``trainer.fit`` to the first training step
(process group, model, weights). Contenders alternate and repeat; medians and ratios come from the same run.

    python benchmarks/real_model.py --repeats 3          # bf16-true
    python benchmarks/real_model.py --nf4 --repeats 3    # NF4 base

Writes ``benchmarks/results/real-model.{md,json}`` (``real-model-nf4`` with ``--nf4``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from docstring_task import encode, split  # noqa: E402
from load_pretrained import _status_kb  # noqa: E402
from smollm2 import smollm2  # noqa: E402
from throughput import LoRALlama  # noqa: E402

from tests.helpers import run_distributed  # noqa: E402

SEQ, BATCH, WARMUP, TIMED = 128, 2, 2, 6
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class RealLoRA(LoRALlama):
    """The same module for every contender; ``how`` says how the weights come in (and the sharding, for the peer)."""

    def __init__(self, model_dir: str, how: str, nf4: bool) -> None:
        super().__init__()  # the synthetic benchmark's step, optimizer and step timing
        self.model_dir, self.how, self.nf4 = model_dir, how, nf4

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        if self.how == "load_pretrained":
            from lightning_fsdp2 import load_pretrained
            from lightning_fsdp2.quantize import nf4_misfits

            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))
            if self.nf4:
                load_pretrained(base, self.model_dir, quantize="nf4", skip=nf4_misfits(base, self.trainer.world_size))
            else:
                load_pretrained(base, self.model_dir)
            self.model = get_peft_model(base, lora)
        elif self.how == "from_pretrained":  # DDP: every rank reads the whole model
            base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.bfloat16)
            if self.nf4:
                _quantize_in_place(base)
            self.model = get_peft_model(base, lora)
        else:  # "by_hand": ModelParallelStrategy's documented way, weights as torchtune loads them
            self.model = _shard_and_load_by_hand(self, get_peft_model(
                AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir)), lora))

    def train_dataloader(self) -> DataLoader:
        # The demo's training examples, packed into windows of SEQ tokens; enough for every process's steps.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        ids = torch.tensor([i for e in split()[0] for i in encode(tokenizer, e)[0]])
        n = (WARMUP + TIMED) * BATCH * max(self.trainer.world_size, 1)
        return DataLoader(ids[: n * SEQ].view(n, SEQ), batch_size=BATCH)


def _quantize_in_place(model: torch.nn.Module) -> None:
    """The same linear weights as FSDP2Strategy's NF4 base replaced by torchao's ``to_nf4`` (the hand-built QLoRA)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from lightning_fsdp2.quantize import nf4_misfits

    skip = set(nf4_misfits(model, 2))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and name.rsplit(".", 1)[-1] not in skip:
            module.weight = torch.nn.Parameter(to_nf4(module.weight.data), requires_grad=False)


def _shard_and_load_by_hand(module: RealLoRA, model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` each decoder layer and the root on ModelParallelStrategy's data-parallel mesh, give the
    (meta) parameters storage, and load the file read on rank 0 with DCP's full-state-dict broadcast."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    base = model.base_model.model
    rope = base.model.rotary_emb  # buffers no file holds: computed as the model's own init computes them
    inv_freq, _ = rope.compute_default_rope_parameters(base.config)
    rope.inv_freq.copy_(inv_freq)
    rope.original_inv_freq.copy_(inv_freq)
    full = {}
    if dist.get_rank() == 0:
        full = {f"base_model.model.{k}": v for k, v in load_file(Path(module.model_dir) / "model.safetensors").items()}
        full["base_model.model.lm_head.weight"] = full["base_model.model.model.embed_tokens.weight"]
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
    base.tie_weights()
    with torch.no_grad():  # peft's init of the adapters (B = 0: the base's function at first)
        for name, p in model.named_parameters():
            if "lora_A" in name:
                torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
            elif "lora_B" in name:
                p.zero_()
    return model


def _strategy(name: str):
    if name.startswith("fsdp2"):
        from lightning_fsdp2 import FSDP2Strategy

        return FSDP2Strategy(device_mesh="auto") if name == "fsdp2_auto" else FSDP2Strategy()
    if name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy()


HOW = {"fsdp2": "load_pretrained", "fsdp2_auto": "load_pretrained", "model_parallel": "by_hand",
       "ddp": "from_pretrained"}


def _train(name: str, model_dir: str, nf4: bool) -> dict:
    torch.set_num_threads(1)
    module = RealLoRA(model_dir, HOW[name], nf4)
    start_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(name),
        precision="bf16-true",
        max_steps=WARMUP + TIMED, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    begin = time.perf_counter()
    trainer.fit(module)
    timed = module.times[WARMUP:]  # times[0] is the start of training, times[k] the end of step k
    return {"tokens_per_s": TIMED * BATCH * SEQ * 2 / (timed[-1] - timed[0]),
            "peak_mb": (_status_kb("VmHWM") - start_kb) / 1024, "startup_s": module.times[0] - begin}


def measure(names: list[str], model_dir: str, nf4: bool, repeats: int) -> dict[str, dict]:
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else list(reversed(names)):  # alternate the order
            result = run_distributed(_train, 2, name, model_dir, nf4, timeout=1800)
            runs[name].append(result)
            print(f"repeat {repeat}: {name}: {result[0]['tokens_per_s']:.0f} tokens/s, start-up"
                  f" {result[0]['startup_s']:.1f} s", flush=True)
    return {name: {
        "runs": per_run,  # every repeat, every rank
        "tokens_per_s": statistics.median(r[0]["tokens_per_s"] for r in per_run),
        "peak_mb_per_rank": [statistics.median(r[rank]["peak_mb"] for r in per_run) for rank in range(2)],
        "startup_s": statistics.median(max(r[rank]["startup_s"] for rank in range(2)) for r in per_run),
    } for name, per_run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nf4", action="store_true", help="the base's linear weights in NF4 (QLoRA)")
    parser.add_argument("--only", nargs="*", help="contenders to run (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    model_dir = str(smollm2(ROOT / "outputs" / "SmolLM2-135M-Instruct"))
    names = args.only or (["fsdp2", "fsdp2_auto", "ddp"] if args.nf4 else ["fsdp2", "fsdp2_auto", "model_parallel", "ddp"])
    rows = measure(names, model_dir, args.nf4, args.repeats)
    ddp, peer = rows.get("ddp", {}).get("tokens_per_s"), rows.get("model_parallel", {}).get("tokens_per_s")
    base = "an NF4 base (MLP weights; attention projections bf16)" if args.nf4 else "bf16-true"
    lines = [f"LoRA fine-tuning of SmolLM2-135M-Instruct (30 layers, 134.5M parameters; LoRA r=8 on q/k/v/o) at"
             f" world size 2, {base}, {BATCH} x {SEQ} tokens per process packed from the demo's task, CPU/gloo,"
             f" 1 thread per process, median of {args.repeats}. Start-up: `trainer.fit` to the first step, the slower"
             " rank.", "",
             "| contender | tokens/s | x DDP | x hand-written FSDP2 | peak RSS per rank (MB) | start-up (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        vs_ddp = f"{row['tokens_per_s'] / ddp:.2f}x" if ddp else "-"
        vs_peer = f"{row['tokens_per_s'] / peer:.2f}x" if peer else "-"
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_mb_per_rank"])
        lines.append(f"| {name} | {row['tokens_per_s']:.0f} | {vs_ddp} | {vs_peer} | {peaks} | {row['startup_s']:.1f} |")
    command = f"python benchmarks/real_model.py{' --nf4' if args.nf4 else ''} --repeats {args.repeats}"
    command += f" --only {' '.join(args.only)}" if args.only else ""
    stem = Path(args.out) / ("real-model-nf4" if args.nf4 else "real-model")
    stem.parent.mkdir(parents=True, exist_ok=True)
    lines += ["", f"Command: `{command}`"]
    stem.with_suffix(".json").write_text(json.dumps({"rows": rows, "command": command}, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
