"""QLoRA: a base stored in NF4 by `load_pretrained(..., quantize="nf4")`, against a QLoRA built by hand in one process.

The reference uses no lightning_fsdp2 code: the eager model from `from_pretrained`, each linear weight but the head
replaced by torchao's `to_nf4(weight)`, peft's LoRA on top, the adapters from a saved adapter directory, plain SGD.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.helpers import run_distributed
from tests.models import (
    TokenDataset,
    data_parallel_split,
    quiet_trainer_kwargs,
    tiny_llama_config,
    train_plainly,
    world,
)

pytest.importorskip("torchao")

# NF4 splits blocks of 64 values with one scale per 256 blocks (16,384 values), and FSDP2 splits each weight into
# world-size shards: 256 x 256 projections (65,536 values) shard at world size 4.
QLORA_SHAPE = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=4)
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
STEPS = 3


def _adapters(model: Any) -> dict[str, torch.Tensor]:
    """The trainable (adapter) tensors, whole, on every rank. Only those: gathering the NF4 base with DCP's full
    state dict (DTensor redistribute of NF4 shards) is not a path this package uses, and crashed once in CI."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    return {k: v.detach().cpu().clone() for k, v in get_model_state_dict(model, options=options).items()}


def _config():
    return tiny_llama_config(**QLORA_SHAPE)


@pytest.fixture(scope="module")
def start(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A pretrained base (safetensors directory) and a LoRA adapter with non-zero A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("qlora")
    torch.manual_seed(0)
    LlamaForCausalLM(_config()).save_pretrained(tmp / "base")
    torch.manual_seed(1)
    get_peft_model(LlamaForCausalLM(_config()), LoraConfig(**LORA)).save_pretrained(tmp / "adapter")
    return str(tmp / "base"), str(tmp / "adapter")


def _nf4_parts(tensor: Any) -> dict[str, torch.Tensor]:
    """An NF4 tensor's stored bytes: codes, quantized scales, their factors and mean."""
    return {k: getattr(tensor, k).detach().clone() for k in
            ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")}


def _reference(base: str, adapter: str, dtype: torch.dtype) -> dict:
    from peft import PeftModel
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=dtype)
    nf4 = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
            nf4[f"{name}.weight"] = _nf4_parts(module.weight)
    model = PeftModel.from_pretrained(model, adapter, is_trainable=True, autocast_adapter_dtype=True)
    losses = train_plainly(model, STEPS)
    adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    return {"nf4": nf4, "adapters": adapters, "losses": losses}


class QLoRAModule(L.LightningModule):
    def __init__(self, base: str, adapter: str, skip: tuple[str, ...] = (), n_samples: int = 32) -> None:
        super().__init__()
        self.base, self.adapter, self.skip, self.n_samples = base, adapter, skip, n_samples
        self.model: Any = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        from lightning_fsdp2 import load_pretrained
        from lightning_fsdp2.lora import load_adapter

        model = LlamaForCausalLM(_config())
        load_pretrained(model, self.base, quantize="nf4", skip=list(self.skip))
        self.model = get_peft_model(model, LoraConfig(**LORA))
        load_adapter(self.model, self.adapter)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader, DistributedSampler

        dataset = TokenDataset(self.n_samples)
        split = data_parallel_split(self)  # a context group's ranks read one batch
        return DataLoader(dataset, batch_size=8 // split["num_replicas"],
                          sampler=DistributedSampler(dataset, shuffle=False, **split))


def _fit_qlora(base: str, adapter: str, precision: str, strategy: dict | None = None, trainer: dict | None = None,
               skip: tuple[str, ...] = ()) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.quantize import is_nf4

    strategy = dict(strategy or {})
    if strategy.get("activation_checkpointing_policy") == "blocks":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy["activation_checkpointing_policy"] = {LlamaDecoderLayer}
    module = QLoRAModule(base, adapter, skip)
    fit = L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(**strategy),
                    precision=precision, max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0,
                    **{**quiet_trainer_kwargs(), **(trainer or {})})
    fit.fit(module)
    params = dict(module.model.named_parameters())
    local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in params.items()}
    nf4 = {}
    for name, param in params.items():
        if is_nf4(param):
            # Sharded from world size 2; at world size 1 FSDP2 leaves them whole (nothing to split).
            assert isinstance(param, DTensor) == (world() > 1) and not param.requires_grad
            nf4[name] = _nf4_parts(local[name])
    return {
        "nf4": nf4,
        "local_type": type(local["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]).__name__,
        "adapters": _adapters(module.model),
        "dtypes": {k: str(p.dtype) for k, p in params.items()},
        "losses": module.losses,
    }


def _whole(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    """A weight's NF4 parts put back together from every rank's shard (dim-0 chunks, in rank order)."""
    parts = [r["nf4"][name] for r in ranks]
    whole = {k: torch.cat([p[k].reshape(-1) for p in parts]) for k in ("quantized_data", "quantized_scalers",
                                                                       "quantization_factor")}
    return {**whole, "scaler_mean": parts[0]["scaler_mean"], "nf4": parts[0]["nf4"]}


def _ours(name: str) -> str:
    """The peft model's name of a reference (plain model) weight: peft wraps q/v in `base_layer`."""
    peft = f"base_model.model.{name}"
    return peft.replace("q_proj.weight", "q_proj.base_layer.weight").replace("v_proj.weight", "v_proj.base_layer.weight")


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_qlora_matches_a_hand_built_qlora_in_one_process(start: tuple[str, str], world_size: int) -> None:
    """fp32 base (`"32-true"`, the exact case): every NF4 byte of every quantized weight is the reference's (whole
    tensors quantized once, then sharded); each rank's shard is an `NF4Tensor`; after 3 SGD steps the adapters are
    within 1e-5 of the reference's and the losses within 1e-5 (only the order of gradient sums differs)."""
    want = _reference(*start, torch.float32)
    ranks = run_distributed(_fit_qlora, world_size, *start, "32-true")
    assert ranks[0]["local_type"] == "NF4Tensor"
    assert {_ours(n) for n in want["nf4"]} == set(ranks[0]["nf4"])  # every linear weight but the head
    for name, parts in want["nf4"].items():
        got = _whole(ranks, _ours(name))
        for key, value in parts.items():
            assert torch.equal(got[key].reshape(-1), value.reshape(-1)), f"{name}: {key}"
    adapters = ranks[0]["adapters"]
    assert adapters.keys() == {f"base_model.model.{k.removeprefix('base_model.model.')}" for k in want["adapters"]}
    worst = max((adapters[k] - want["adapters"][k]).abs().max().item() for k in want["adapters"])
    assert worst <= 1e-5, f"max abs diff of the adapters {worst}"
    assert ranks[0]["losses"] == pytest.approx(want["losses"], abs=1e-5)


def test_qlora_under_context_parallelism_matches_the_hand_built_reference(start: tuple[str, str]) -> None:
    """At CP 2 (the NF4 weights sharded over the context group, which FSDP2 shards over): every NF4 byte, the
    adapters and the losses of one process (within 1e-5)."""
    want = _reference(*start, torch.float32)
    ranks = run_distributed(_fit_qlora, 2, *start, "32-true", {"context_parallel_size": 2})
    for name, parts in want["nf4"].items():
        got = _whole(ranks, _ours(name))
        for key, value in parts.items():
            assert torch.equal(got[key].reshape(-1), value.reshape(-1)), f"{name}: {key}"
    worst = max((ranks[0]["adapters"][k] - want["adapters"][k]).abs().max().item() for k in want["adapters"])
    assert worst <= 1e-5, f"max abs diff of the adapters {worst}"
    assert ranks[0]["losses"] == pytest.approx(want["losses"], abs=1e-5)


@pytest.mark.slow
def test_qlora_under_hsdp_holds_one_process_bytes_in_each_replica(start: tuple[str, str]) -> None:
    """`device_mesh=(2, 2)`: each weight is quantized once and split over a shard group of 2; both replicas hold the
    reference's NF4 bytes, and after 3 SGD steps the adapters are within 1e-5 of the reference's."""
    want = _reference(*start, torch.float32)
    ranks = run_distributed(_fit_qlora, 4, *start, "32-true", {"device_mesh": (2, 2)})
    for name, parts in want["nf4"].items():
        for replica in (ranks[:2], ranks[2:]):
            got = _whole(replica, _ours(name))
            for key, value in parts.items():
                assert torch.equal(got[key].reshape(-1), value.reshape(-1)), f"{name}: {key}"
    for rank in ranks:
        worst = max((rank["adapters"][k] - want["adapters"][k]).abs().max().item() for k in want["adapters"])
        assert worst <= 1e-5, f"max abs diff of the adapters {worst}"


def test_qlora_under_bf16_true_with_checkpointing_accumulation_and_clipping(start: tuple[str, str]) -> None:
    """bf16-true: the NF4 base holds bf16 (its embeddings and norms are bf16, the adapters fp32), with activation
    checkpointing, accumulation over 2 micro-batches and clipping; the loss is finite and falls."""
    ranks = run_distributed(
        _fit_qlora, 2, *start, "bf16-true", {"activation_checkpointing_policy": "blocks"},
        {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0},
    )
    dtypes = ranks[0]["dtypes"]
    assert dtypes["base_model.model.model.embed_tokens.weight"] == "torch.bfloat16"
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] == "torch.float32"
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == "torch.bfloat16"  # NF4 of bf16
    losses = ranks[0]["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.slow
def test_qlora_with_compiled_blocks_matches_the_hand_built_reference(start: tuple[str, str]) -> None:
    """compile=True over NF4 blocks (torchao's NF4Tensor under inductor) at world size 2: adapters and losses within
    1e-4 of the eager one-process QLoRA reference after 3 steps."""
    want = _reference(*start, torch.float32)
    ranks = run_distributed(_fit_qlora, 2, *start, "32-true", {"compile": True}, timeout=900)
    worst = max((ranks[0]["adapters"][k] - want["adapters"][k]).abs().max().item() for k in want["adapters"])
    assert worst <= 1e-4, f"max abs diff of the adapters {worst}"
    assert ranks[0]["losses"] == pytest.approx(want["losses"], abs=1e-4)


def test_skip_leaves_modules_unquantized(start: tuple[str, str]) -> None:
    ranks = run_distributed(_fit_qlora, 2, *start, "32-true", None, None, ("down_proj", "layers.1.self_attn.q_proj"))
    names = set(ranks[0]["nf4"])
    assert not any("down_proj" in n for n in names)
    assert "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight" not in names
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in names


def _whole_nf4_while_sharding(base: str, adapter: str) -> dict:
    """Fit one step with FSDP2's `fully_shard` (as the package calls it) counting, at each call, the NF4 weights this
    rank holds whole (not yet split into a DTensor); and count the weights this rank quantized itself (torchao's
    `to_nf4` calls)."""
    from torch.distributed.tensor import DTensor
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_fsdp2 import FSDP2Strategy, wrap
    from lightning_fsdp2.quantize import is_nf4

    module = QLoRAModule(base, adapter)
    seen: list[int] = []
    made: list[tuple[int, ...]] = []
    to_nf4, fully_shard = nf4_tensor.to_nf4, wrap.fully_shard

    def counting_to_nf4(tensor: torch.Tensor, *args: Any) -> Any:
        made.append(tuple(tensor.shape))
        return to_nf4(tensor, *args)

    def counting_fully_shard(sub: torch.nn.Module, **kwargs: Any) -> Any:
        seen.append(sum(is_nf4(p) and not isinstance(p, DTensor) for p in module.model.parameters()))
        return fully_shard(sub, **kwargs)

    nf4_tensor.to_nf4, wrap.fully_shard = counting_to_nf4, counting_fully_shard
    try:
        L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(auto_wrap_policy={LlamaDecoderLayer}),
                  precision="32-true", max_steps=1, **quiet_trainer_kwargs()).fit(module)
    finally:
        nf4_tensor.to_nf4, wrap.fully_shard = to_nf4, fully_shard
    return {"whole": seen, "nf4": sum(is_nf4(p) for p in module.model.parameters()), "made": len(made)}


def test_each_group_is_quantized_just_before_it_is_sharded_and_the_ranks_share_the_work(
    start: tuple[str, str],
) -> None:
    """A rank never holds the whole NF4 base: a group's weights are quantized right before its fully_shard, so at each
    fully_shard call the only whole NF4 weights are that group's (7 projections of one layer; quantizing the whole
    base first would show all 14, quantizing after sharding none). Each rank quantizes half of the weights and
    receives the other half (identical bytes to one process: see test_qlora_matches_a_hand_built_qlora_in_one_process)."""
    ranks = run_distributed(_whole_nf4_while_sharding, 2, *start)
    for rank in ranks:
        assert rank["nf4"] == 14  # 2 layers x 7 projections
        # two decoder layers, then the root (nothing left to quantize): 7, 7, 0
        assert rank["whole"] == [7, 7, 0], rank["whole"]
    assert [rank["made"] for rank in ranks] == [7, 7]


def _fail_quantizing_on_rank_1(base: str, adapter: str) -> str:
    import os
    from datetime import timedelta

    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    from lightning_fsdp2 import FSDP2Strategy

    def broken(*args: Any) -> Any:
        raise ValueError("planted: this rank cannot quantize")

    if os.environ["RANK"] == "1":
        nf4_tensor.to_nf4 = broken
    try:
        L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(timeout=timedelta(seconds=60)),
                  precision="32-true", max_steps=1, **quiet_trainer_kwargs()).fit(QLoRAModule(base, adapter))
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "trained"


def test_a_rank_that_fails_to_quantize_its_share_fails_every_rank(start: tuple[str, str]) -> None:
    """The ranks share the quantizing: one that fails (a file it cannot read, memory, torchao) never broadcasts its
    share, so all learn of it first and raise together instead of the others waiting until the timeout."""
    first, second = run_distributed(_fail_quantizing_on_rank_1, 2, *start)
    assert "another rank failed to read or quantize its share" in first, first
    assert "planted: this rank cannot quantize" in second, second


# --------------------------------------------------------------------------- checkpoints and exports
def _fit_epochs(base: str, adapter: str, epochs: int, state_dict_type: str, save_to: str | None = None,
                resume_from: str | None = None) -> dict:
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.checkpoint.files import FORMAT_KEY

    module = QLoRAModule(base, adapter, n_samples=16)  # 2 steps an epoch
    trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(state_dict_type=state_dict_type),
                        precision="bf16-true", max_epochs=epochs, limit_val_batches=0, num_sanity_val_steps=0,
                        **quiet_trainer_kwargs())
    trainer.fit(module, ckpt_path=resume_from)
    saved = {}
    if save_to is not None:
        trainer.save_checkpoint(save_to)
        meta = Path(save_to) / "meta.pt" if Path(save_to).is_dir() else Path(save_to)
        checkpoint = torch.load(meta, weights_only=True, mmap=True)
        saved = {"format": checkpoint.get(FORMAT_KEY, {}),
                 "keys": sorted(checkpoint.get("state_dict", {}))}
    return {"adapters": _adapters(module.model), "step": trainer.global_step, **saved}


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_qlora_checkpoints_hold_the_trainable_state_and_resume_exactly(
    start: tuple[str, str], tmp_path: Path, state_dict_type: str
) -> None:
    """The NF4 base is never saved (it comes from load_pretrained again): the checkpoint is marked trainable-only and
    holds the adapters. Saved at world size 2 after one epoch, resumed at 1 and 2 processes: the adapters after two
    epochs equal an uninterrupted run's (<= 1e-4)."""
    ckpt = str(tmp_path / ("ckpt" if state_dict_type == "sharded" else "ckpt.ckpt"))
    straight = run_distributed(_fit_epochs, 2, *start, 2, state_dict_type)[0]
    first = run_distributed(_fit_epochs, 2, *start, 1, state_dict_type, ckpt)[0]
    assert first["format"]["trainable_only"] is True
    if state_dict_type == "full":
        assert first["keys"] and all("lora_" in k for k in first["keys"])
    for resume_world in (1, 2):
        resumed = run_distributed(_fit_epochs, resume_world, *start, 2, state_dict_type, None, ckpt)[0]
        assert resumed["step"] == straight["step"] == 4
        worst = max((resumed["adapters"][k] - straight["adapters"][k]).abs().max().item() for k in straight["adapters"])
        assert worst <= 1e-4, f"resumed at {resume_world}: max abs diff {worst}"


def _export(base: str, adapter: str, out: str) -> dict:
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.lora import save_adapter, save_merged

    module = QLoRAModule(base, adapter)
    trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(), precision="bf16-true",
                        max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    save_adapter(module, f"{out}/adapter")
    save_merged(module, f"{out}/merged")
    return {"adapters": _adapters(module.model)}


def test_qlora_exports_a_peft_adapter_and_a_dequantized_merged_model(start: tuple[str, str], tmp_path: Path) -> None:
    """After bf16-true QLoRA training at world size 2: `save_adapter` writes the trained adapters in peft's format
    (fp32, equal to the trained ones); `save_merged` writes a bf16 Hugging Face model whose base weights are the NF4
    base dequantized, with the adapters merged: its logits are those of the hand-built QLoRA with the saved adapter
    (bf16 merge rounding: within 5e-2 on logits of size ~5)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    trained = run_distributed(_export, 2, *start, str(tmp_path))[0]["adapters"]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {v.dtype for v in saved.values()} == {torch.float32}
    for key, value in saved.items():
        ours = key.replace(".weight", ".default.weight")
        assert torch.equal(value, trained[ours]), key

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    reference = LlamaForCausalLM.from_pretrained(start[0], torch_dtype=torch.bfloat16)
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    # The base the merge started from is the dequantized NF4: the down projection (no adapter) is exactly that.
    down = reference.model.layers[0].mlp.down_proj.weight.get_original_weight()
    assert torch.equal(merged.model.layers[0].mlp.down_proj.weight, down)
    reference = PeftModel.from_pretrained(reference, tmp_path / "adapter")
    tokens = TokenDataset(2).data
    with torch.no_grad():
        got, want = merged(input_ids=tokens).logits.float(), reference(input_ids=tokens).logits.float()
    assert (got - want).abs().max() < 5e-2


# --------------------------------------------------------------------------- bad input
def _deferred_error(base: str, adapter: str, case: str) -> str:
    """A Trainer run whose QLoRA cannot be built: the message every rank raises."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lightning_fsdp2 import FSDP2Strategy, load_pretrained

    class Broken(QLoRAModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            config = tiny_llama_config() if case == "shape" else _config()
            model = LlamaForCausalLM(config)
            load_pretrained(model, self.base, quantize="nf4", strict=False)
            # "trainable": no peft, so the quantized weights would be trained
            self.model = model if case == "trainable" else get_peft_model(model, LoraConfig(**LORA))

    trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(), max_steps=1,
                        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    try:
        trainer.fit(Broken(base, adapter))
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("shape", r"ValueError: load_pretrained\(quantize='nf4'\) cannot quantize 14 of 14 weight\(s\): weights that do"
                  r" not split evenly into NF4 shards over 2 rank\(s\).*4 of shape \(64, 64\) \(fits at no size: its 4096"
                  r" elements are not a multiple of 16384; the smallest with its columns that fits here: \(512, 64\)\)"
                  r".*multiple of 16384 x 2.*load without quantize='nf4'"),
        ("trainable", r"ValueError: load_pretrained\(quantize='nf4'\) cannot quantize .* (is|are) trainable \(NF4 weights are"
                      r" frozen: wrap the model with peft's get_peft_model"),
    ],
)
def test_qlora_that_cannot_be_built_is_refused_on_every_rank(
    start: tuple[str, str], tmp_path: Path, case: str, expected: str
) -> None:
    """Weights NF4 cannot split into the world size's shards (the hidden-64 Llama), or that would be trained:
    one ValueError on every rank, before anything is allocated, naming the weights and the way out."""
    import re

    from tests.models import save_tiny_pretrained

    base = str(save_tiny_pretrained(tmp_path / "small")) if case == "shape" else start[0]
    for message in run_distributed(_deferred_error, 2, base, start[1], case):
        assert re.search(expected, message), message
        assert len(message) < 1500 and "skip=" not in message, message  # one short message, no way out that leaves nothing


@pytest.mark.parametrize("adapted", [False, True], ids=["plain", "peft-all-linear"])
def test_qlora_shape_error_names_the_way_out_that_works(adapted: bool) -> None:
    """A model of which some weights fit NF4's shards at world size 2 and some only at world size 1, plain and with
    peft's LoRA on every linear layer (the weights then live in `<layer>.base_layer`): the message names each failing
    shape once, where it would fit, the smallest shape that fits, and a `skip` that leaves out exactly those (checked
    here with the same matching) and keeps the rest quantized."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_fsdp2.quantize import check_nf4_targets, nf4_targets

    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).requires_grad_(False)
        if adapted:
            model = get_peft_model(model, LoraConfig(target_modules="all-linear"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    names = nf4_targets(model, list(shapes), [])
    with pytest.raises(ValueError) as raised:
        check_nf4_targets(model, names, shapes, world_size=2)
    message = str(raised.value)
    assert "cannot quantize 6 of 14 weight(s)" in message, message
    assert "4 of shape (64, 256) (fits at 1 rank(s); the smallest with its columns that fits here: (128, 256))" in message
    assert "2 of shape (256, 64) (fits at 1 rank(s); the smallest with its columns that fits here: (512, 64))" in message
    skip = ["down_proj", "gate_proj", "up_proj"]
    assert f"skip={skip!r}) (8 weight(s) would still be quantized)" in message, message
    assert message.count("NF4 quantizes blocks") == 1, message
    kept = nf4_targets(model, names, skip)
    assert len(kept) == 8 and not any("mlp" in n for n in kept)
    check_nf4_targets(model, kept, shapes, world_size=2)  # what the suggested skip leaves: no error
    # nf4_misfits gives that skip before anything is loaded (peft's base_layer named by its layer), none at 1 rank.
    from lightning_fsdp2.quantize import nf4_misfits

    assert nf4_misfits(model, 2) == skip and nf4_misfits(model, 1) == []


def test_the_smallest_shape_that_fits_fits() -> None:
    """The suggested shape fits NF4's shards, whatever the weight's size (also when it already has more rows than one
    rank's blocks), and has no fewer rows than the weight."""
    from lightning_fsdp2.quantize import _fits_nf4, _smallest_fit

    for shape, world in [((40000, 3), 2), ((100, 200), 1), ((64, 64), 2), ((128, 896), 8), ((4096, 4096), 3)]:
        fit = _smallest_fit(shape, world)
        assert _fits_nf4(fit, world) and fit[1] == shape[1] and fit[0] >= shape[0], (shape, world, fit)


def test_qlora_arguments_are_checked_when_load_pretrained_is_called(start: tuple[str, str]) -> None:
    """An unknown quantization, `skip` given as a string, and a dtype torchao's to_nf4 does not take (float64, on a
    model built for real: quantized at once) are refused with the choices."""
    from transformers import LlamaForCausalLM

    from lightning_fsdp2 import load_pretrained

    model = LlamaForCausalLM(_config())
    with pytest.raises(ValueError, match="the supported quantization is 'nf4'"):
        load_pretrained(model, start[0], quantize="int8")
    with pytest.raises(TypeError, match="takes a list of module names"):
        load_pretrained(model, start[0], quantize="nf4", skip="down_proj")
    with pytest.raises(ValueError, match=r"are torch.float64; torchao's to_nf4 takes float32, bfloat16 or float16"):
        load_pretrained(model.double(), start[0], quantize="nf4")


def test_without_torchao_the_error_names_the_extra(start: tuple[str, str]) -> None:
    """Where torchao is not installed (hidden from the import system here), quantize="nf4" says which extra to
    install, and loads without quantize run as before (they must not need torchao)."""
    import subprocess
    import sys

    code = (
        f"QLORA = {QLORA_SHAPE!r}\n"
        "import sys; sys.modules['torchao'] = None\n"
        "from transformers import LlamaForCausalLM\n"
        "from lightning_fsdp2 import load_pretrained\n"
        "from tests.models import tiny_llama_config\n"
        "from lightning_fsdp2.checkpoint.pretrained import DeferredLoads\n"
        "from lightning_fsdp2.init import meta_init_context\n"
        "deferred = DeferredLoads()\n"
        "with meta_init_context(), deferred.collecting():\n"
        "    model = LlamaForCausalLM(tiny_llama_config(**QLORA))\n"
        f"    load_pretrained(model, {start[0]!r}, strict=False)\n"
        "pending = deferred.take(model)\n"
        "pending.check_quantize(model, 2)\n"
        "from lightning_fsdp2.quantize import quantize_weights\n"
        "assert not pending.quantizes and quantize_weights(pending.take_nf4(model)) == set()\n"
        "print('plain load planned without torchao')\n"
        f"load_pretrained(LlamaForCausalLM(tiny_llama_config(**QLORA)), {start[0]!r}, quantize='nf4', strict=False)\n"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "plain load planned without torchao" in proc.stdout, proc.stderr[-2000:]
    assert "ImportError: load_pretrained(..., quantize='nf4') stores the base in torchao's NF4Tensor" in proc.stderr
    assert "pip install lightning-fsdp2[qlora]" in proc.stderr


def test_the_package_imports_no_torchao_until_asked() -> None:
    """Importing the package (both front-ends, the checkpoint helpers, lora) neither imports torchao nor prints
    anything: torchao's PyPI wheels print load failures of their CUDA kernels beside a CPU build of torch, so it is
    only imported when quantize="nf4" asks for it (transformers' own quantizers import it wherever it is installed,
    which the docs say)."""
    import subprocess
    import sys

    pytest.importorskip("torchao")  # where it is not installed, not importing it proves nothing
    code = ("import sys, lightning_fsdp2, lightning_fsdp2.fabric, lightning_fsdp2.checkpoint, lightning_fsdp2.lora\n"
            "print('torchao' in sys.modules)\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False", proc.stdout
    assert proc.stderr == "", proc.stderr[-2000:]


def _load_state_dict_into_nf4(base: str, adapter: str) -> str:
    from lightning_fsdp2 import FSDP2Strategy

    module = QLoRAModule(base, adapter)
    L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(), precision="32-true", max_steps=1,
              **quiet_trainer_kwargs()).fit(module)
    whole = {k: torch.zeros(v.shape) for k, v in module.model.state_dict().items()}
    try:
        module.model.load_state_dict(whole)
    except RuntimeError as err:
        return str(err)
    return "loaded"


def test_load_state_dict_into_nf4_weights_is_refused_on_every_rank(start: tuple[str, str]) -> None:
    for message in run_distributed(_load_state_dict_into_nf4, 2, *start):
        assert "is stored in NF4" in message and "q_proj.base_layer.weight" in message, message


def _set_adapters_through_dcp(base: str, adapter: str) -> dict:
    """DCP's own API on a QLoRA model: an adapters-only full state dict in, with ``strict=False``. DCP fills the keys
    it was not given with the model's own tensors (the NF4 base among them) and hands all of them to
    ``load_state_dict``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.quantize import is_nf4

    module = QLoRAModule(base, adapter)
    L.Trainer(accelerator="cpu", devices=world(), strategy=FSDP2Strategy(), precision="32-true", max_steps=1,
              **quiet_trainer_kwargs()).fit(module)
    local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in module.model.named_parameters()}
    before = {n: _nf4_parts(t) for n, t in local.items() if is_nf4(t)}
    adapters = {k: v for k, v in _adapters(module.model).items() if "lora_" in k}
    wanted = {k: torch.full(v.shape, 0.125 + i / 64) for i, (k, v) in enumerate(adapters.items())}
    options = StateDictOptions(full_state_dict=True, strict=False)
    result = set_model_state_dict(module.model, dict(wanted), options=options)  # (DCP adds keys to the dict)
    after = {n: _nf4_parts(p.to_local() if isinstance(p, DTensor) else p)
             for n, p in module.model.named_parameters() if n in before}
    got = {k: v for k, v in _adapters(module.model).items() if "lora_" in k}
    return {"wanted": wanted, "got": got, "unexpected": list(result.unexpected_keys),
            "nf4_kept": bool(before) and all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])}


def test_dcp_set_model_state_dict_of_adapters_loads_into_a_qlora_model(start: tuple[str, str]) -> None:
    """`set_model_state_dict(model, adapters, full_state_dict=True, strict=False)`: the adapters take the given
    values on every rank, the NF4 base (handed back by DCP as the model's own tensors) stays as it was."""
    for got in run_distributed(_set_adapters_through_dcp, 2, *start):
        assert got["nf4_kept"] and got["unexpected"] == []
        assert got["got"].keys() == got["wanted"].keys() and got["wanted"]
        for key, value in got["wanted"].items():
            assert torch.equal(got["got"][key], value), key
