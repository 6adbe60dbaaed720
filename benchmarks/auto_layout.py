"""``FSDP2Strategy(device_mesh="auto")`` at world size 2: its estimate against the measured peak, and its speed against
DDP and today's default (full sharding) on a device of a given size.

``--estimate``: the Llama sizes of ``load_pretrained.py`` (small 58M, medium 194M, large 551M; 2 x 256 tokens per
rank) and a deep one (672M in 48 layers; 1 x 64 tokens per rank), LoRA r=8 on q/k/v/o (``SIZE+full``: every
parameter trained), AdamW, fp32, in two layouts:
whole replicas ``(2, 1)`` as ``"auto"`` makes them (the frozen base plain tensors, the adapters FSDP2's; chosen with a
budget of 1000 GiB) and full sharding ``(1, 2)`` (``FSDP2Strategy()``). Per rank: the peak resident set size
(``VmHWM``) above what the process held when ``fit`` started, against the strategy's estimate for that layout
(``estimate_layouts`` with the same batch shape).

Default (``--contest``): three contenders, ``auto``, ``ddp`` (Lightning's ``DDPStrategy``) and ``fsdp2``
(``FSDP2Strategy()``: full sharding), on an emulated device: a process whose resident set grows past what it held
when ``fit`` started plus the device size is killed (exit code 137, as by the kernel's OOM killer; its peak looked at
every 10 ms), and ``"auto"`` is given the same figure as ``memory_budget``. Four cases
(``--cases SIZE:GIB:SEQUENCESxTOKENS``, ``SIZE+full`` for full fine-tuning): the small model where everything fits;
a deep one (48 layers, 672M, a small batch so that the parameters are most of the memory) on a device with little
room above a whole replica (in between); the same on a device a whole replica does not fit (DDP is killed, and so is
full sharding: glibc's heap); the medium model (194M) fully fine-tuned on a device DDP does not fit (parameters,
gradients and Adam's two moments: sharding halves all four). A contender that runs out of memory is recorded as
such. One untimed run (DDP) before each case.

    python benchmarks/auto_layout.py --estimate
    python benchmarks/auto_layout.py --contest --repeats 2

Writes ``benchmarks/results/auto-estimate.{md,json}`` (``auto-estimate-trim`` when run with glibc giving freed memory
back: ``MALLOC_TRIM_THRESHOLD_=0 MALLOC_MMAP_THRESHOLD_=65536``) and ``auto-layout.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from load_pretrained import SIZES, _status_kb  # noqa: E402
from throughput import LoRALlama  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.helpers import run_distributed  # noqa: E402

# Three untimed steps: in the 48-layer case "auto"'s first two took up to 1.7x DDP's (one-time set-up), then the two
# ran even; with one untimed step, its second weighed on a short timing.
SEQ, BATCH, WARMUP = 256, 2, 3
# Steps timed per run (``--timed``; read from the environment so that the spawned ranks see it too).
TIMED = int(os.environ.get("AUTO_LAYOUT_TIMED", "4"))
SIZES = {**SIZES,  # a deep one: the decoder layers are most of the parameters (sharding saves more than it costs)
         "deep": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=48,
                      num_attention_heads=16)}


class Lora(LoRALlama):
    """``throughput.py``'s module (its steps, timing and AdamW), with the model of ``size`` and a batch of
    ``(sequences, tokens)`` per rank."""

    def __init__(self, size: str, batch: tuple[int, int] = (BATCH, SEQ)) -> None:
        super().__init__(batch=batch[0])
        self.size, self.batch = size, batch

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # foreach=True: what torch picks by default on CUDA. On CPU its default is a loop over the tensors, which
        # costs DTensor parameters (FSDP2's: the adapters in every FSDP2 layout) about 0.1 s a step more than DDP's
        # plain ones in the 48-layer case (145 against 29 ms an update; with foreach 38 against 31).
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4, foreach=True)

    def train_dataloader(self) -> DataLoader:
        sequences, tokens = self.batch
        n = (WARMUP + TIMED) * sequences * max(self.trainer.world_size, 1)
        data = torch.randint(0, 32000, (n, tokens), generator=torch.Generator().manual_seed(0))
        return DataLoader(data, batch_size=sequences)


def build(size: str) -> torch.nn.Module:
    """``size`` of :data:`SIZES` with LoRA on q/k/v/o, or ``SIZE+full`` for every parameter trained."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    size, full = size.removesuffix("+full"), size.endswith("+full")
    config = LlamaConfig(num_key_value_heads=None, max_position_embeddings=512, tie_word_embeddings=False,
                         **SIZES[size])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if full:
        return model
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def estimated(size: str, batch: tuple[int, int] = (BATCH, SEQ)):
    from lightning_fsdp2 import estimate_layouts

    module = Lora(size, batch)
    with torch.device("meta"):
        module.configure_model()
    return estimate_layouts(module, 2, batch_shape=batch, device_type="cpu")


def _strategy(name: str, budget: int | None, batch: tuple[int, int]):
    from lightning_fsdp2 import FSDP2Strategy

    if name == "auto":
        return FSDP2Strategy(device_mesh="auto", memory_budget=budget, batch_shape=batch)
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if name == "replicas":  # "auto" with room for whole replicas: the frozen base plain, the adapters FSDP2's
        return FSDP2Strategy(device_mesh="auto", memory_budget="1000GiB", batch_shape=batch)
    if name.startswith("mesh"):  # "mesh2x1"
        replicate, shard = (int(n) for n in name[4:].split("x"))
        return FSDP2Strategy(device_mesh=(replicate, shard) if replicate > 1 else None)
    return FSDP2Strategy()


def _train(size: str, name: str, device_gib: float | None, batch: tuple[int, int] = (BATCH, SEQ)) -> dict:
    torch.set_num_threads(1)
    budget = int(device_gib * 2**30) if device_gib else None
    start_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    if budget is not None:  # the emulated device: a process whose resident set grows past `budget` is killed
        _watch(start_kb * 1024 + budget)
    module = Lora(size, batch)
    strategy = _strategy(name, budget, batch)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true",
                        max_steps=WARMUP + TIMED, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    timed = module.times[WARMUP:]
    choice = getattr(strategy, "layout_choice", None)
    return {"tokens_per_s": TIMED * batch[0] * batch[1] * 2 / (timed[-1] - timed[0]),
            "peak_mb": (_status_kb("VmHWM") - start_kb) / 1024,
            "chosen": (list(choice.chosen.mesh) + [choice.chosen.reshard_after_forward, choice.chosen.frozen_plain]
                       if choice else None)}


def _watch(limit: int) -> None:
    """Kill this process, as the kernel's OOM killer would (exit code 137), once its peak resident set (``VmHWM``, so
    that no spike between two looks is missed) passes ``limit`` bytes. Looked at every 10 ms from a thread: every
    millisecond, the thread's GIL requests slowed the contenders with more Python per step (FSDP2's hooks) more."""
    def watch() -> None:
        while _status_kb("VmHWM") * 1024 <= limit:
            time.sleep(0.01)
        os._exit(137)

    threading.Thread(target=watch, daemon=True).start()


def run_estimate(args: argparse.Namespace, out: Path) -> None:
    rows = {}
    for case in args.sizes:  # SIZE, or SIZE:SEQUENCESxTOKENS
        size, _, shape = case.partition(":")
        batch = tuple(int(n) for n in shape.split("x")) if shape else (BATCH, SEQ)
        report = estimated(size, batch)
        by_layout = {(e.mesh, e.reshard_after_forward): e for e in report.candidates}
        for mesh in ((2, 1), (1, 2)):
            name = "replicas" if mesh == (2, 1) else "mesh1x2"
            result = run_distributed(_train, 2, size, name, None, batch, timeout=3600)
            measured = max(r["peak_mb"] for r in result)
            e = by_layout[(mesh, True)]
            guess, tensors = e.total / 2**20, (e.total - e.allocator) / 2**20
            rows[f"{size} {mesh}" + (f", {batch[0]} x {batch[1]} tokens" if shape else "")] = {"estimated_mb": guess, "tensors_mb": tensors, "measured_mb": measured,
                                      "ratio": guess / measured, "tensors_ratio": tensors / measured,
                                      "components_mb": {k: getattr(e, k) / 2**20 for k in
                                                        ("parameters", "gradients", "optimizer", "gathered",
                                                         "activations", "allocator")}}
            print(size, mesh, f"estimated {guess:.0f} MB ({tensors:.0f} in tensors), measured {measured:.0f} MB",
                  flush=True)
    trim = os.environ.get("MALLOC_TRIM_THRESHOLD_") == "0"
    lines = ["`device_mesh=\"auto\"`'s estimate against the measured per-rank peak, world size 2, LoRA r=8 on q/k/v/o,"
             f" AdamW, {BATCH} x {SEQ} tokens per rank, fp32, CPU (peak RSS above the start of `fit`"
             + (", glibc giving freed memory back at once: `MALLOC_TRIM_THRESHOLD_=0 MALLOC_MMAP_THRESHOLD_=65536`"
                if trim else ", glibc's defaults") + "). \"tensors\": the estimate without the allocator's share.", "",
             "| model, layout | estimated (MB) | measured (MB) | estimated / measured | tensors (MB) | tensors /"
             " measured | parameters / gathered / activations / allocator (MB) |", "|---|---:|---:|---:|---:|---:|---|"]
    for key, row in rows.items():
        c = row["components_mb"]
        lines.append(f"| {key} | {row['estimated_mb']:.0f} | {row['measured_mb']:.0f} | {row['ratio']:.2f} |"
                     f" {row['tensors_mb']:.0f} | {row['tensors_ratio']:.2f} | {c['parameters']:.0f} /"
                     f" {c['gathered']:.0f} / {c['activations']:.0f} / {c['allocator']:.0f} |")
    command = f"python benchmarks/auto_layout.py --estimate --sizes {' '.join(args.sizes)}"
    if trim:
        command = "MALLOC_TRIM_THRESHOLD_=0 MALLOC_MMAP_THRESHOLD_=65536 " + command
    _write(out / ("auto-estimate-trim" if trim else "auto-estimate"), rows, lines, command)


def _contest_run(size: str, name: str, gib: float, batch: tuple[int, int]) -> dict:
    try:
        return run_distributed(_train, 2, size, name, gib, batch, timeout=3600)[0]
    except RuntimeError as err:  # a rank past the emulated device's memory
        if "exited with 137" in str(err):
            return {"out_of_memory": True}
        if "no layout fits the budget" in str(err):  # "auto" refused before allocating anything
            return {"refused": True}
        raise


def run_contest(args: argparse.Namespace, out: Path) -> None:
    """Each case ``size:GiB:SEQUENCESxTOKENS``: the model, the emulated device per rank, the per-rank batch."""
    rows: dict[str, dict] = {}
    cases = []
    for case in args.cases:
        size, gib, batch = case.split(":")
        cases.append((size, float(gib), tuple(int(n) for n in batch.split("x"))))
    for size, gib, batch in cases:
        # Untimed: the first run after the machine was idle was up to 15% slower, whichever contender it was (memory
        # the VM hands back when idle is faulted in again).
        print("warm-up", size, gib, _contest_run(size, "ddp", gib, batch), flush=True)
        for repeat in range(args.repeats):
            for name in ("auto", "ddp", "fsdp2") if repeat % 2 == 0 else ("fsdp2", "ddp", "auto"):
                result = _contest_run(size, name, gib, batch)
                rows.setdefault(f"{size} {gib} {name}", {"runs": []})["runs"].append(result)
                print(size, gib, name, result, flush=True)
    lines = ["`device_mesh=\"auto\"` against DDP and full sharding (`FSDP2Strategy()`), world size 2, Llama + LoRA r=8"
             f" on q/k/v/o (or every parameter trained: \"full fine-tuning\"), AdamW, fp32, CPU, 1 thread per process,"
             f" {TIMED} steps timed per run after {WARMUP} untimed, median of {args.repeats} runs (contenders alternated). The device is emulated:"
             " a process whose resident set grows past what it held when `fit` started plus the device size is killed"
             " (as by the OOM killer), and \"auto\" is given the device size as memory_budget.", "",
             "| model, batch per rank | device per rank | auto chose | auto tokens/s | DDP tokens/s | full sharding"
             " tokens/s | auto / DDP | auto / full sharding |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for size, gib, batch in cases:
        def tps(name: str) -> float | None:
            runs = rows[f"{size} {gib} {name}"]["runs"]
            if any(r.get("refused") for r in runs):
                return "refused"
            return None if any(r.get("out_of_memory") for r in runs) else statistics.median(
                r["tokens_per_s"] for r in runs)
        auto, ddp, full = tps("auto"), tps("ddp"), tps("fsdp2")
        chosen = rows[f"{size} {gib} auto"]["runs"][0].get("chosen")
        shown = lambda v: "out of memory" if v is None else v if isinstance(v, str) else f"{v:.0f}"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"  # noqa: E731
        said = (f"({chosen[0]}, {chosen[1]}){', frozen plain' if chosen[3] else ''}, reshard {chosen[2]}" if chosen
                else "-")
        said_size = SIZES_SAID[size.removesuffix("+full")] + (", full fine-tuning" if size.endswith("+full") else "")
        lines.append(f"| {size} ({said_size}), {batch[0]} x {batch[1]} | {gib} GiB | {said} | {shown(auto)} |"
                     f" {shown(ddp)} | {shown(full)} | {ratio(auto, ddp)} | {ratio(auto, full)} |")
    pairs = []
    for size, gib, batch in cases:  # each repeat's auto against the DDP run next to it: the machine's drift cancels
        auto_runs, ddp_runs = rows[f"{size} {gib} auto"]["runs"], rows[f"{size} {gib} ddp"]["runs"]
        each = [a["tokens_per_s"] / d["tokens_per_s"] for a, d in zip(auto_runs, ddp_runs)
                if "tokens_per_s" in a and "tokens_per_s" in d]
        if each:
            pairs.append(f"{size} {gib} GiB: {', '.join(f'{r:.2f}' for r in each)} (geometric mean"
                         f" {statistics.geometric_mean(each):.2f})")
    if pairs:
        lines += ["", "auto / DDP in each repeat: " + "; ".join(pairs) + "."]
    command = f"python benchmarks/auto_layout.py --contest --cases {' '.join(args.cases)} --repeats {args.repeats}"
    if args.timed != 4:
        command += f" --timed {args.timed}"
    if args.name:
        command += f" --name {args.name}"
    _write(out / (args.name or "auto-layout"), rows, lines, command)


SIZES_SAID = {"small": "58M", "medium": "194M", "large": "551M", "deep": "672M, 48 layers"}


def _write(stem: Path, rows: dict, lines: list[str], command: str) -> None:
    lines += ["", f"Command: `{command}`"]
    stem.with_suffix(".json").write_text(json.dumps({"rows": rows, "command": command}, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    global TIMED
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimate", action="store_true", help="the estimate against the measured peak")
    parser.add_argument("--contest", action="store_true", help="auto against DDP and full sharding (default)")
    parser.add_argument("--sizes", nargs="*", default=["small", "medium", "large", "deep:1x64", "small+full:1x64",
                                                         "medium+full:1x64"],
                        help="--estimate's models: SIZE, or SIZE:SEQUENCESxTOKENS for another batch per rank")
    parser.add_argument("--cases", nargs="*", default=["small:4:2x256", "deep:3.6:1x64", "deep:2.9:1x64",
                                                       "medium+full:4:1x64"],
                        help="--contest's cases, SIZE:GIB:SEQUENCESxTOKENS (model, device per rank, batch per rank)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timed", type=int, default=TIMED, help="steps timed per run (after one untimed step)")
    parser.add_argument("--name", default=None, help="--contest's results file (default auto-layout)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    os.environ["AUTO_LAYOUT_TIMED"] = str(args.timed)
    TIMED = args.timed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.estimate:
        run_estimate(args, out)
    else:
        run_contest(args, out)


if __name__ == "__main__":
    main()
