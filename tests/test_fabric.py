"""Lightning Fabric with lightning_fsdp2.fabric.FSDP2Strategy, against single-device Fabric without our code.

The reference runs in this process with Fabric's default single-device strategy; the sharded runs go through
``run_distributed``. Both start from the same weights: a Hugging Face directory and a peft adapter directory the
reference wrote, read under ``fabric.init_module()`` by ``load_pretrained`` and ``lora.load_adapter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers import run_distributed
from tests.models import TokenDataset, full_state, save_tiny_pretrained, tiny_llama_config, world

GLOBAL_BATCH = 8
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(**LORA)  # init_lora_weights=False: B is not zero, so every adapter has a gradient at once


def _reference_start(tmp: Path) -> tuple[str, str]:
    """A pretrained base and a LoRA adapter (random A and B) for both sides to start from."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    base = str(save_tiny_pretrained(tmp / "base"))
    torch.manual_seed(1)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base), _lora_config())
    model.save_pretrained(tmp / "adapter")
    return base, str(tmp / "adapter")


def _loader(batch_size: int) -> DataLoader:
    dataset = TokenDataset(32)
    sampler = DistributedSampler(dataset, shuffle=False) if torch.distributed.is_initialized() else None
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def _train(fabric: L.Fabric, model: Any, optimizer: Any, steps: int, accumulate: int, clip: float | None,
           synced: list[bool] | None = None) -> list[float]:
    """``steps`` optimizer steps over the unshuffled data, each over ``accumulate`` micro-batches. ``synced``
    collects, after each micro-batch that only accumulates, whether gradients reached the parameters (a
    reduce-scatter ran)."""
    losses = []
    batches = iter(fabric.setup_dataloaders(_loader(GLOBAL_BATCH // fabric.world_size // accumulate),
                                            use_distributed_sampler=False))
    for _ in range(steps):
        for micro in range(accumulate):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = model(input_ids=batch, labels=batch).loss / accumulate
                fabric.backward(loss)
            if synced is not None and micro < accumulate - 1:
                synced.append(any(p.grad is not None for p in model.parameters()))
            losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _reference(base: str, adapter: str, steps: int, accumulate: int = 1, clip: float | None = None) -> dict:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter, is_trainable=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    losses = _train(fabric, model, optimizer, steps, accumulate, clip)
    return {"state": full_state(model), "losses": losses}


def _sharded(base: str, adapter: str, steps: int, accumulate: int = 1, clip: float | None = None,
             joint: bool = False, strategy: dict | None = None, fabric: dict | None = None) -> dict:
    """FSDP2 at this process's world size; ``fabric``: Fabric's arguments instead of the defaults (a launcher's
    cluster environment, ``devices="auto"``)."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy
    from lightning_fsdp2.lora import load_adapter

    fabric = L.Fabric(**{"accelerator": "cpu", "devices": world(), "strategy": FSDP2Strategy(**(strategy or {})),
                         **(fabric or {})})
    fabric.launch()
    with fabric.init_module():
        model = LlamaForCausalLM(tiny_llama_config())
        on_meta = all(p.is_meta for p in model.parameters())
        load_pretrained(model, base)
        model = get_peft_model(model, _lora_config())
        load_adapter(model, adapter)
    make = lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)  # noqa: E731
    if joint:  # the optimizer made over the meta parameters, set up together with the model
        model, optimizer = fabric.setup(model, make(model))
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make(model))
    synced: list[bool] = []
    losses = _train(fabric, model, optimizer, steps, accumulate, clip, synced)
    from torch.distributed.tensor import DTensor

    return {"state": full_state(model), "losses": losses, "on_meta": on_meta, "synced": synced,
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
            "names": [n for n, _ in model.named_parameters()]}


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got["state"].keys() == want["state"].keys(), what
    worst = max((got["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    assert worst <= 1e-4, f"{what}: max abs diff {worst}"
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-4), what


@pytest.fixture(scope="module")
def start(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _reference_start(tmp_path_factory.mktemp("fabric_start"))


@pytest.mark.parametrize(
    ("accumulate", "clip", "joint"),
    [(1, None, False), (2, None, True), (1, 0.05, False)],
    ids=["plain", "accumulation-joint-setup", "clipping"],
)
def test_fabric_at_world_size_2_matches_single_device_fabric(
    start: tuple[str, str], accumulate: int, clip: float | None, joint: bool
) -> None:
    """Tiny Llama + LoRA, fp32, SGD with momentum, unshuffled data: the adapters after 4 steps and every loss within
    1e-4 of single-device Fabric's. Built on meta under init_module, loaded by load_pretrained/load_adapter."""
    want = _reference(*start, steps=4, accumulate=accumulate, clip=clip)
    for rank in run_distributed(_sharded, 2, *start, 4, accumulate, clip, joint):
        assert rank["on_meta"] and rank["sharded"]
        assert not any(rank["synced"])  # no_backward_sync: no reduce-scatter on the accumulating micro-batches
        assert len(rank["synced"]) == 4 * (accumulate - 1)
        _assert_close(rank, want, f"accumulate={accumulate} clip={clip}")
    # Clipping is not ignored: without it the reference ends elsewhere. (Accumulating the same global batch in two
    # halves reaches the same weights; what shows no_backward_sync was honoured is `synced` above.)
    if clip is not None:
        other = _reference(*start, steps=4)
        worst = max((other["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
        assert worst > 1e-3


@pytest.mark.slow
def test_fabric_with_compiled_checkpointed_blocks_matches_single_device_fabric(start: tuple[str, str]) -> None:
    """compile=True and whole-block checkpointing under Fabric: the same adapters and losses (1e-4), clean names."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    want = _reference(*start, steps=4)
    strategy = {"compile": True, "activation_checkpointing_policy": {LlamaDecoderLayer}}
    for rank in run_distributed(_sharded, 2, *start, 4, 1, None, False, strategy, timeout=900):
        _assert_close(rank, want, "compile")
        assert not any("_orig_mod" in n for n in rank["names"])


# --------------------------------------------------------------------------- checkpoints: save, load, resume
def _build_sharded(fabric: L.Fabric, base: str, adapter: str) -> Any:
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.lora import load_adapter

    with fabric.init_module():
        model = LlamaForCausalLM(tiny_llama_config())
        load_pretrained(model, base)
        model = get_peft_model(model, _lora_config())
        load_adapter(model, adapter)
    return fabric.setup_module(model)


def _optimizer_and_scheduler(model: Any) -> tuple[Any, Any]:
    # AdamW at lr 1e-3 and a per-step schedule: a resume that lost the optimizer's moments or the schedule is off by
    # about lr, ten times the tolerance (see tests/models.py ResumeModule).
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def _run(fabric: L.Fabric, model: Any, optimizer: Any, scheduler: Any, state: dict, steps: int,
         save_at: int | None = None, save_to: str | None = None) -> dict:
    """Train until `state["step"] == steps` on the unshuffled data (step s takes the s-th global batch), saving
    `state` to `save_to` after step `save_at`."""
    dataset = TokenDataset(32)
    per_rank = GLOBAL_BATCH // fabric.world_size
    while state["step"] < steps:
        batch = torch.stack([dataset[state["step"] * GLOBAL_BATCH + fabric.global_rank + i * fabric.world_size]
                             for i in range(per_rank)])
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        if state["step"] == save_at:
            fabric.save(save_to, state)
    return {"state": full_state(model), "step": state["step"], "lr": optimizer.param_groups[0]["lr"]}


def _resumable(base: str, adapter: str, steps: int, state_dict_type: str = "full", save_at: int | None = None,
               save_to: str | None = None, resume_from: str | None = None, evaluate_first: bool = False) -> dict:
    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(state_dict_type=state_dict_type))
    fabric.launch()
    model = _build_sharded(fabric, base, adapter)
    optimizer, scheduler = _optimizer_and_scheduler(model)
    optimizer = fabric.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = {}
    if evaluate_first:  # a no-grad forward leaves the root's parameters unsharded until the next forward
        with torch.no_grad():
            model(input_ids=TokenDataset(2).data)
    if resume_from is not None:
        remainder = fabric.load(resume_from, state)
    result = _run(fabric, model, optimizer, scheduler, state, steps, save_at, save_to)
    return {**result, "remainder": sorted(remainder)}


def _single_device_resume(base: str, adapter: str, steps: int, resume_from: str) -> dict:
    """Stock single-device Fabric, no lightning_fsdp2 code, resuming from our full checkpoint."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter, is_trainable=True)
    optimizer, scheduler = _optimizer_and_scheduler(model)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    fabric.load(resume_from, state)
    return _run(fabric, model, optimizer, scheduler, state, steps)


def _assert_same_run(resumed: dict, straight: dict, what: str) -> None:
    assert resumed["step"] == straight["step"], what
    assert resumed["lr"] == pytest.approx(straight["lr"]), f"{what}: LR schedule"
    assert resumed["state"].keys() == straight["state"].keys(), what
    worst = max((resumed["state"][k] - straight["state"][k]).abs().max().item() for k in straight["state"])
    assert worst <= 1e-4, f"{what}: max abs diff {worst}"


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
@pytest.mark.parametrize("resume_world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_fabric_save_and_resume_at_any_world_size(
    start: tuple[str, str], tmp_path: Path, state_dict_type: str, resume_world: int
) -> None:
    """Saved at world size 2 after 2 of 4 steps (model, optimizer, LR scheduler, a plain step counter), resumed at
    1, 2 or 4 processes: the same weights, step and learning rate as 4 uninterrupted steps (<= 1e-4)."""
    ckpt = str(tmp_path / ("ckpt" if state_dict_type == "sharded" else "ckpt.pt"))
    straight = run_distributed(_resumable, 2, *start, 4, state_dict_type)[0]
    first = run_distributed(_resumable, 2, *start, 2, state_dict_type, 2, ckpt)[0]
    assert Path(ckpt).is_dir() == (state_dict_type == "sharded")
    resumed = run_distributed(_resumable, resume_world, *start, 4, state_dict_type, None, None, ckpt)
    for rank in resumed:
        _assert_same_run(rank, straight, f"{state_dict_type} saved at 2, resumed at {resume_world}")
        assert rank["remainder"] == []  # everything saved was asked for
    # Resuming is not a no-op: the run that stopped at 2 steps is elsewhere.
    assert max((first["state"][k] - straight["state"][k]).abs().max().item() for k in straight["state"]) > 1e-4


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_a_checkpoint_loads_after_an_evaluation(start: tuple[str, str], tmp_path: Path, state_dict_type: str) -> None:
    """`fabric.load` right after a no-grad forward (which leaves the root's parameters unsharded) resumes exactly."""
    ckpt = str(tmp_path / ("ckpt" if state_dict_type == "sharded" else "ckpt.pt"))
    straight = run_distributed(_resumable, 2, *start, 4, state_dict_type)[0]
    run_distributed(_resumable, 2, *start, 2, state_dict_type, 2, ckpt)
    resumed = run_distributed(_resumable, 2, *start, 4, state_dict_type, None, None, ckpt, True)[0]
    _assert_same_run(resumed, straight, f"{state_dict_type}, loaded after an evaluation")


def test_a_full_fabric_checkpoint_resumes_in_single_device_fabric(start: tuple[str, str], tmp_path: Path) -> None:
    """The "full" file is what a one-device Fabric run writes: stock Fabric (no lightning_fsdp2) loads it with
    `fabric.load` into a plain model, optimizer and scheduler and continues exactly."""
    ckpt = str(tmp_path / "ckpt.pt")
    straight = run_distributed(_resumable, 2, *start, 4)[0]
    run_distributed(_resumable, 2, *start, 2, "full", 2, ckpt)
    _assert_same_run(_single_device_resume(*start, 4, ckpt), straight, "single-device Fabric from a full checkpoint")


# --------------------------------------------------------------------------- Fabric <-> Trainer
def _trainer_reads(fabric_ckpt: str, trainer_ckpt: str) -> dict:
    """The Trainer strategy builds the same peft model and load_pretrained reads the Fabric checkpoint's model."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_fsdp2 import FSDP2Strategy, load_pretrained
    from tests.models import LlamaModule, quiet_trainer_kwargs

    class FromFabric(LlamaModule):
        def configure_model(self) -> None:
            if self.model is None:
                model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), _lora_config())
                load_pretrained(model, fabric_ckpt)
                self.model = model

    module = FromFabric()
    trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    trainer.validate(module, verbose=False)
    trainer.save_checkpoint(trainer_ckpt, weights_only=True)
    return full_state(module.model)


def _fabric_reads(trainer_ckpt: str) -> dict:
    """Fabric builds the peft model on meta and `fabric.load_raw` reads the Trainer's checkpoint into the shards."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy())
    fabric.launch()
    with fabric.init_module():
        model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), _lora_config())
    model = fabric.setup_module(model)
    fabric.load_raw(trainer_ckpt, model)
    return full_state(model)


def test_full_checkpoints_go_from_fabric_to_the_trainer_and_back(start: tuple[str, str], tmp_path: Path) -> None:
    """A Fabric full checkpoint's model loads into a Trainer strategy's model (load_pretrained in configure_model);
    the Trainer's checkpoint loads back into a Fabric model (fabric.load_raw): the trained weights, exactly."""
    fabric_ckpt, trainer_ckpt = str(tmp_path / "fabric.pt"), str(tmp_path / "trainer.ckpt")
    trained = run_distributed(_resumable, 2, *start, 2, "full", 2, fabric_ckpt)[0]["state"]
    in_trainer = run_distributed(_trainer_reads, 2, fabric_ckpt, trainer_ckpt)[0]
    back_in_fabric = run_distributed(_fabric_reads, 2, trainer_ckpt)[0]
    for got, what in ((in_trainer, "Trainer"), (back_in_fabric, "Fabric again")):
        assert got.keys() == trained.keys(), what
        assert all(torch.equal(got[k], trained[k]) for k in trained), what


# --------------------------------------------------------------------------- precision
class _LitLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.dtype_at_build = self.dtype
        self.model = LlamaForCausalLM(tiny_llama_config())

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss


def _bf16_true() -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_fsdp2.fabric import FSDP2Precision, FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy="fsdp2", precision="bf16-true")
    fabric.launch()
    with fabric.init_module():
        module = _LitLlama()
    on_meta = all(p.is_meta for p in module.parameters())
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = TokenDataset(8).data[fabric.global_rank :: fabric.world_size]
    losses = []
    for _ in range(3):
        loss = model(batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {
        "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__,
        "plugin": isinstance(fabric.strategy.precision, FSDP2Precision) and isinstance(fabric.strategy, FSDP2Strategy),
        "on_meta": on_meta,
        "dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "optimizer_dtypes": sorted({str(s["exp_avg"].dtype) for s in optimizer.state.values()}),
        "sharded": all(isinstance(p, DTensor) for p in module.parameters()),
        "dtype_at_build": str(module.dtype_at_build),
        "dtype": str(module.dtype),
        "losses": losses,
    }


def test_bf16_true_under_fabric_stores_bf16_shards_built_on_meta() -> None:
    """The seed's case under Fabric: `Fabric(strategy="fsdp2", precision="bf16-true")`, a LightningModule built under
    init_module: parameters on meta there, then bf16 DTensor shards; `self.dtype` is bf16 during construction and
    after; AdamW's state is bf16 too; the loss is finite and falls."""
    for rank in run_distributed(_bf16_true, 2):
        assert rank["strategy"] == "lightning_fsdp2.fabric.FSDP2Strategy" and rank["plugin"]
        assert rank["on_meta"] and rank["sharded"]
        assert rank["dtypes"] == ["torch.bfloat16"] and rank["optimizer_dtypes"] == ["torch.bfloat16"]
        assert rank["dtype_at_build"] == rank["dtype"] == "torch.bfloat16"
        assert all(torch.isfinite(torch.tensor(rank["losses"]))) and rank["losses"][-1] < rank["losses"][0]


# --------------------------------------------------------------------------- bad input
def _fabric_error(case: str, path: str) -> str:
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_fsdp2.fabric import FSDP2Strategy

    try:
        plugins = [TorchCheckpointIO()] if case == "checkpoint_io" else None
        fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(state_dict_type="sharded"),
                          plugins=plugins)
        fabric.launch()
        with fabric.init_module():
            from transformers import LlamaForCausalLM

            model = LlamaForCausalLM(tiny_llama_config())
        optimizer = torch.optim.AdamW(model.parameters())
        if case == "stepped":
            optimizer.state[next(model.parameters())] = {"step": torch.tensor(1.0)}
            fabric.setup(model, optimizer)
        model = fabric.setup_module(model)
        if case == "sharded_without_state":
            fabric.save(path, {"model": model})
            fabric.load(path)
        if case == "missing_key":
            fabric.save(path, {"model": model})
            fabric.load(path, {"model": model, "step": 0})
        if case == "unset_optimizer":
            fabric.setup_optimizers(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
        if case == "foreign_optimizer":
            other = torch.nn.Linear(2, 2)
            fabric.save(path, {"model": model, "optimizer": torch.optim.SGD(other.parameters(), lr=0.1)})
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("checkpoint_io", r"ValueError: .*writes its checkpoints itself and does not use a CheckpointIO plugin"),
        ("stepped", r"ValueError: .*re-points the optimizer at the sharded parameters.* has state.*setup_module\(model\)"),
        ("sharded_without_state", r"ValueError: .* is a sharded checkpoint: .*fabric.load\(path, \{'model': model"),
        ("missing_key", r"KeyError: .*has no \['step'\].*strict=False"),
        ("unset_optimizer", r"ValueError: The SGD holds 2 parameter\(s\) of no model set up with FSDP2Strategy"),
        ("foreign_optimizer", r"CheckpointFileError: The SGD in the checkpoint's state holds parameters of no model set up"),
    ],
)
def test_fabric_bad_input_gets_a_clear_error_on_every_rank(tmp_path: Path, case: str, expected: str) -> None:
    import re

    for message in run_distributed(_fabric_error, 2, case, str(tmp_path / "ckpt")):
        assert re.search(expected, message), message


# --------------------------------------------------------------------------- load_raw: plain state dicts
def _single_device_steps(base: str, adapter: str, out: str | None, steps: int, model_from: str | None = None,
                         optimizer_from: str | None = None) -> dict:
    """Stock single-device Fabric: `steps` steps, then `torch.save` of the model's and the optimizer's state dicts."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter, is_trainable=True)
    optimizer, scheduler = _optimizer_and_scheduler(model)
    model, optimizer = fabric.setup(model, optimizer)
    result = _run(fabric, model, optimizer, scheduler, {"step": 0}, steps)
    if out is not None:
        torch.save(model.state_dict(), f"{out}/model.pt")
        torch.save(optimizer.state_dict(), f"{out}/optimizer.pt")
    return result


def _sharded_from_raw(base: str, adapter: str, out: str, steps: int) -> dict:
    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy())
    fabric.launch()
    model = _build_sharded(fabric, base, adapter)
    optimizer, scheduler = _optimizer_and_scheduler(model)
    optimizer = fabric.setup_optimizers(optimizer)
    fabric.load_raw(f"{out}/model.pt", model)
    fabric.load_raw(f"{out}/optimizer.pt", optimizer)
    # No scheduler state in the plain files: the learning rate comes with the optimizer's param groups (StepLR
    # multiplies the group's current lr at each step).
    return _run(fabric, model, optimizer, scheduler, {"step": 1}, steps)


def test_load_raw_reads_plain_model_and_optimizer_state_dicts(start: tuple[str, str], tmp_path: Path) -> None:
    """`torch.save(model.state_dict())` and `torch.save(optimizer.state_dict())` from one device, after one step,
    read into the sharded model and optimizer with `fabric.load_raw`: two more steps at world size 2 end where the
    single device's three do (<= 1e-4; AdamW at 1e-3 would be about 1e-3 off had the moments been lost)."""
    straight = _single_device_steps(*start, None, 3)
    _single_device_steps(*start, str(tmp_path), 1)
    for rank in run_distributed(_sharded_from_raw, 2, *start, str(tmp_path), 3):
        _assert_same_run(rank, straight, "load_raw of plain state dicts")


# --------------------------------------------------------------------------- optimizers made at other moments
def _optimizer_moments(case: str) -> dict:
    """A tiny Llama trained 2 steps at lr 0.5 with the optimizer made at another moment than after setup_module."""
    from transformers import LlamaForCausalLM

    from lightning_fsdp2.fabric import FSDP2Strategy

    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy=FSDP2Strategy())
    fabric.launch()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = TokenDataset(8).data[fabric.global_rank :: fabric.world_size]
    if case == "before_setup":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model = fabric.setup_module(model)
    else:  # after an evaluation, which leaves the root's parameters unsharded
        model = fabric.setup_module(model)
        with torch.no_grad():
            model(input_ids=batch)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer = fabric.setup_optimizers(optimizer)
    for _ in range(2):
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    after = full_state(model)
    return {"unchanged": sorted(k for k in before if torch.equal(before[k], after[k]))}


@pytest.mark.parametrize("case", ["before_setup", "after_evaluation"])
def test_an_optimizer_made_before_setup_or_after_an_evaluation_trains_every_parameter(case: str) -> None:
    """An optimizer over the unsharded parameters (made before `setup_module`, or from `model.parameters()` after a
    no-grad forward left the root's embedding, norm and head unsharded) is pointed at the shards by
    `setup_optimizers`: every parameter changes (none would before setup; the root's would not after evaluation)."""
    for rank in run_distributed(_optimizer_moments, 2, case):
        assert rank["unchanged"] == []


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)


def _lightning_module_steps(precision: str) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=world(), strategy="fsdp2", precision=precision)
    fabric.launch()
    torch.manual_seed(0)
    module = _Regression()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model, optimizer = fabric.setup(module, optimizer)
    g = torch.Generator().manual_seed(fabric.global_rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)  # fp32, as a dataset gives them
    losses = []
    for step in range(5):
        loss = model.training_step((x, y), step)  # Fabric routes LightningModule steps like forward
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "dtypes": sorted({str(p.dtype) for p in module.parameters()})}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_a_lightning_modules_training_step_runs_under_fabric(precision: str) -> None:
    """A LightningModule set up by Fabric, its `training_step` called with fp32 inputs (Fabric's way): its children
    are the FSDP roots (so the step's calls gather them), and under bf16-true they cast the inputs to bf16, as
    Fabric's own wrapper does for other strategies. The loss falls."""
    for rank in run_distributed(_lightning_module_steps, 2, precision):
        assert rank["dtypes"] == (["torch.bfloat16"] if precision == "bf16-true" else ["torch.float32"])
        assert rank["losses"][-1] < rank["losses"][0]
