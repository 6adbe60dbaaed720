"""Tensor parallelism composed with FSDP2: `FSDP2Strategy(tensor_parallel_size=N)` (or `device_mesh=(replicate,
shard, tensor)`) splits the layers of the model's own plan (or the user's) over groups of N ranks, then shards over
the rest. Compared with one process built without this package, with the placements checked on every rank (so a
strategy that ignored the tensor dimension fails)."""

from __future__ import annotations

import copy
import os

import lightning as L
import pytest
import torch

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import (
    LlamaModule,
    TokenDataset,
    assert_same_run,
    fit_resumable,
    fit_resumable_single_device,
    full_state,
    quiet_trainer_kwargs,
)
from tests.test_strategy import _assert_same_weights, _start_state


class TensorParallelModule(LlamaModule):
    """LlamaModule trained with SGD (momentum 0.9), reading the data-parallel split the strategy reports: ranks of
    one tensor group read the same batch."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)


def _trainer_kwargs(**extra) -> dict:
    kwargs = dict(max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    kwargs.update(extra)
    return kwargs


def _placements(module: torch.nn.Module) -> dict:
    """Each parameter's mesh dimension names and placements, and this rank's local shape."""
    from torch.distributed.tensor import DTensor

    return {n.removeprefix("_forward_module."):  # Fabric's wrapper
            (p.device_mesh.mesh_dim_names, tuple(repr(x) for x in p.placements), tuple(p.to_local().shape))
            for n, p in module.named_parameters() if isinstance(p, DTensor)}


def _fit_tp(start_state: dict, module_kwargs: dict, trainer_kwargs: dict, strategy_kwargs: dict) -> dict:
    world = int(os.environ["WORLD_SIZE"])
    module = TensorParallelModule(start_state=start_state, **module_kwargs)
    strategy = FSDP2Strategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, **_trainer_kwargs(**trainer_kwargs))
    trainer.fit(module)
    return {"state": full_state(module), "placements": _placements(module), "losses": module.losses,
            "sampler": strategy.distributed_sampler_kwargs}


def _fit_reference(start_state: dict, module_kwargs: dict, trainer_kwargs: dict, data_parallel: int) -> dict:
    kwargs = dict(module_kwargs)
    kwargs["batch_size"] = kwargs.get("batch_size", 4) * data_parallel  # one process sees the global batch
    module = TensorParallelModule(start_state=start_state, **kwargs)
    module.configure_model()
    trainer = L.Trainer(accelerator="cpu", devices=1, **_trainer_kwargs(**trainer_kwargs))
    trainer.fit(module)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "losses": module.losses}


Q = "model.base_model.model.model.layers.0.self_attn.q_proj"
O = "model.base_model.model.model.layers.0.self_attn.o_proj.weight"


def _check_split(rank: dict, tensor: int) -> None:
    """The plan's layers are split over the tensor dimension (q_proj by rows, o_proj by columns, LoRA's B with its
    colwise base, A whole), the rest not."""
    placements = rank["placements"]
    names, split, local = placements[f"{Q}.base_layer.weight"]
    assert "tensor" in names and split[names.index("tensor")] == "Shard(dim=0)", placements[f"{Q}.base_layer.weight"]
    names, split, _ = placements[O]
    assert split[names.index("tensor")] == "Shard(dim=1)"
    names, split, _ = placements[f"{Q}.lora_B.default.weight"]
    assert split[names.index("tensor")] == "Shard(dim=0)"
    names, _, _ = placements[f"{Q}.lora_A.default.weight"]
    assert "tensor" not in names
    norm = placements["model.base_model.model.model.norm.weight"]
    assert "tensor" not in norm[0]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "plain"])
def test_tensor_parallel_2_matches_one_process(lora: bool) -> None:
    """World size 2 as one tensor group of 2 (no data parallelism left: both ranks compute the whole batch): the
    weights of one process after 3 SGD steps with momentum (<= 1e-4)."""
    module_kwargs = {"lora": lora, "lr": 5e-2}
    start = _start_state(lora=lora)
    reference = _fit_reference(start, module_kwargs, {}, data_parallel=1)
    results = run_distributed(_fit_tp, 2, start, module_kwargs, {}, {"tensor_parallel_size": 2})
    for rank in results:
        assert rank["sampler"] == {"num_replicas": 1, "rank": 0}
        if lora:
            _check_split(rank, 2)
        _assert_same_weights(rank["state"], reference["state"])
    moved = max((reference["state"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3


# =========================================================================== architectures (Fabric, load_pretrained)
GLOBAL_BATCH = 8


def _lora(arch: str, dropout: float = 0.0):
    from peft import LoraConfig

    targets = ["qkv_proj", "o_proj"] if arch == "phi3" else ["q_proj", "v_proj", "o_proj", "down_proj"]
    if arch in ("qwen3_moe", "mixtral"):  # attention only: peft would adapt the fused experts' down_proj too
        targets = ["q_proj", "v_proj", "o_proj"]
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False)


def _pretrained(arch: str, directory: str, lora: bool) -> tuple[str, str | None]:
    """The architecture's tiny model saved by `save_pretrained`, and a LoRA adapter with non-zero A and B."""
    from peft import get_peft_model

    from tests.models import tiny_model

    torch.manual_seed(0)
    model, _ = tiny_model(arch)
    base = os.path.join(directory, f"{arch}-base")
    model.save_pretrained(base)
    if not lora:
        return base, None
    adapter = os.path.join(directory, f"{arch}-adapter")
    torch.manual_seed(1)
    get_peft_model(model, _lora(arch)).save_pretrained(adapter)
    return base, adapter


def _batches(steps: int, replicas: int, rank: int) -> list[torch.Tensor]:
    """Each step's global batch of the unshuffled data, this data-parallel rank's contiguous part of it."""
    data, per = TokenDataset(32).data, GLOBAL_BATCH // replicas
    return [data[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH][rank * per:(rank + 1) * per] for s in range(steps)]


def _train_loop(fabric, model, steps: int, replicas: int, rank: int, clip: float | None = None) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    if fabric is not None:
        optimizer = fabric.setup_optimizers(optimizer)
    losses = []
    for batch in _batches(steps, replicas, rank):
        loss = model(input_ids=batch, labels=batch).loss
        fabric.backward(loss) if fabric is not None else loss.backward()
        if clip is not None:
            if fabric is not None:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _fabric_reference(arch: str, base: str, adapter: str | None, steps: int, clip: float | None = None) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    losses = _train_loop(None, model, steps, 1, 0, clip)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def _fabric_model(arch: str, base: str, adapter: str | None, strategy: dict):
    """Fabric with our strategy, and the architecture's model built under init_module, loaded by load_pretrained (and
    lora.load_adapter), set up."""
    from peft import get_peft_model

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy
    from lightning_fsdp2.lora import load_adapter
    from tests.models import tiny_model

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=FabricStrategy(**strategy))
    fabric.launch()
    with fabric.init_module():
        model = tiny_model(arch)[0]
        load_pretrained(model, base)
        if adapter is not None:
            model = get_peft_model(model, _lora(arch))
            load_adapter(model, adapter)
    return fabric, fabric.setup_module(model)


def _fabric_tp(arch: str, base: str, adapter: str | None, steps: int, strategy: dict,
               clip: float | None = None) -> dict:
    fabric, model = _fabric_model(arch, base, adapter, strategy)
    split = fabric.strategy.distributed_sampler_kwargs
    losses = _train_loop(fabric, model, steps, split["num_replicas"], split["rank"], clip)
    return {"state": full_state(model), "losses": losses, "placements": _placements(model), "model": model}


def _fabric_tp_result(*args) -> dict:
    result = _fabric_tp(*args)
    result.pop("model")
    return result


def _assert_matches(got: dict, want: dict, what: str) -> None:
    assert got["state"].keys() == want["state"].keys(), what
    worst = max((got["state"][k].float() - want["state"][k].float()).abs().max().item() for k in want["state"])
    assert worst <= 1e-4, f"{what}: max abs diff {worst}"


def _split_on_tensor(placements: dict) -> list[str]:
    return [n for n, (names, split, _) in placements.items()
            if "tensor" in names and split[names.index("tensor")].startswith(("Shard", "_StridedShard"))]


ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "qwen3-full"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architectures_with_lora_under_tensor_parallelism_match_one_process(arch: str, tmp_path) -> None:
    """Fabric, world size 2 as one tensor group: each architecture's own plan (Qwen3's per-head norms with their
    gradients all-reduced, Gemma's tied embedding and head split alike, Phi-3's fused projections gathered), loaded
    by load_pretrained and lora.load_adapter (each rank its slices), 3 SGD steps: the adapters and the losses of one
    process (<= 1e-4), with the plan's layers split on every rank. Phi-3 without LoRA: its plan gathers the fused
    projections' outputs ('colwise_gather_output'), behind which peft does not split adapters (refused, below)."""
    lora = arch not in ("phi3", "qwen3-full")
    arch = arch.removesuffix("-full")  # Qwen3 fully fine-tuned: its q_norm/k_norm trained too
    base, adapter = _pretrained(arch, str(tmp_path), lora=lora)
    want = _fabric_reference(arch, base, adapter, steps=3)
    for rank in run_distributed(_fabric_tp_result, 2, arch, base, adapter, 3, {"tensor_parallel_size": 2}):
        split = _split_on_tensor(rank["placements"])
        assert any("embed_tokens" in n for n in split) and any(".mlp." in n for n in split), split
        assert not lora or any("lora_" in n for n in split), split
        _assert_matches(rank, want, arch)
        assert rank["losses"] == pytest.approx(want["losses"], abs=1e-4)


# =========================================================================== checkpoints across layouts
def _saved_after_one_epoch(pretrained, root, world: int) -> dict:
    """Checkpoints after one epoch at TP 2 (with FSDP over the rest of ``world``), in both formats."""
    paths = {"full": root / "full.ckpt", "sharded": root / "sharded.ckpt"}
    for fmt, path in paths.items():
        run_distributed(fit_resumable, world, str(pretrained), 1, str(path), None,
                        {"state_dict_type": fmt, "tensor_parallel_size": 2})
    return paths


@pytest.fixture(scope="module")
def saved_tp(pretrained, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints after one epoch at world size 2 as one tensor group of 2."""
    return _saved_after_one_epoch(pretrained, tmp_path_factory.mktemp("saved-tp"), 2)


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_tensor_parallel_checkpoint_resumes_exactly_at_other_layouts(fmt: str, pretrained, saved_tp: dict,
                                                                       saved: dict, straight: dict) -> None:
    """Saved by TP 2 after one epoch (AdamW, a per-step LR schedule); resumed for the second epoch by TP 2, by FSDP
    over 2 and by one process; and FSDP's own checkpoint resumed by TP 2: each equal to two epochs straight (FSDP at
    world size 2)."""
    for world, strategy in ((2, {"tensor_parallel_size": 2}), (2, {}), (1, {})):
        resumed = run_distributed(fit_resumable, world, str(pretrained), 2, None, str(saved_tp[fmt]), strategy)[0]
        assert_same_run(resumed, straight, f"{fmt} TP checkpoint resumed at world size {world} with {strategy}")
    resumed = run_distributed(fit_resumable, 2, str(pretrained), 2, None, str(saved[fmt]),
                              {"tensor_parallel_size": 2})[0]
    assert_same_run(resumed, straight, f"{fmt} FSDP checkpoint resumed by TP 2")


def test_a_full_tensor_parallel_checkpoint_is_what_one_device_writes(pretrained, saved_tp: dict, tmp_path) -> None:
    """The full file a TP run writes has the keys, shapes and optimizer layout of a single-device run's, and a
    single-device run resumes from it."""
    single = tmp_path / "single.ckpt"
    fit_resumable_single_device(str(pretrained), 1, save_to=str(single))
    ours = torch.load(saved_tp["full"], weights_only=True, map_location="cpu")
    theirs = torch.load(single, weights_only=True, map_location="cpu")
    assert {k: v.shape for k, v in ours["state_dict"].items()} == {k: v.shape for k, v in theirs["state_dict"].items()}
    ours_opt, theirs_opt = ours["optimizer_states"][0], theirs["optimizer_states"][0]
    assert {i: {k: v.shape for k, v in s.items()} for i, s in ours_opt["state"].items()} == \
        {i: {k: v.shape for k, v in s.items()} for i, s in theirs_opt["state"].items()}
    for key, value in theirs["state_dict"].items():  # one epoch of the same run: the same weights
        assert (ours["state_dict"][key] - value).abs().max() <= 1e-4, key


# =========================================================================== any model, with a plan of the user's
class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class PlainLM(torch.nn.Module):
    """A plain PyTorch language model (no Hugging Face class, so no plan of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 64)
        self.layers = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(64, 128)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        from transformers.modeling_outputs import CausalLMOutput

        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def _torch_styles() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}


def _callable_plan(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.layers:
        parallelize_module(block, mesh, _torch_styles_relative())


def _torch_styles_relative() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


PLANS = {
    "style-names": lambda: {"layers.*.up": "colwise", "layers.*.down": "rowwise"},
    "torch-styles": _torch_styles,
    "callable": lambda: _callable_plan,
}


def _plain_tp(plan_name: str, state: dict, steps: int) -> dict:
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy

    strategy = FabricStrategy(tensor_parallel_size=2, tensor_parallel_plan=PLANS[plan_name](),
                              auto_wrap_policy={Block})
    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy)
    fabric.launch()
    with fabric.init_module():
        model = PlainLM()
    model = fabric.setup_module(model)
    model.load_state_dict(state)  # whole tensors into the split shards (code written for one device)
    split = fabric.strategy.distributed_sampler_kwargs
    losses = _train_loop(fabric, model, steps, split["num_replicas"], split["rank"], clip=0.5)
    return {"state": full_state(model), "losses": losses, "placements": _placements(model)}


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_plain_pytorch_model_with_a_user_plan_matches_one_process(plan: str) -> None:
    """A model without a plan of its own, given one as style names, as torch ParallelStyles, or as a callable:
    up colwise, down rowwise, each split on every rank; with gradient clipping over the norm of every gradient (the
    split and the whole ones, on their two meshes), 3 SGD steps equal one process's (<= 1e-4)."""
    torch.manual_seed(0)
    reference = PlainLM()
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    want = {"losses": _train_loop(None, reference, 3, 1, 0, clip=0.5),
            "state": {k: v.detach().clone() for k, v in reference.state_dict().items()}}
    for rank in run_distributed(_plain_tp, 2, plan, state, 3):
        split = _split_on_tensor(rank["placements"])
        assert sorted(split) == sorted(f"layers.{i}.{m}.{p}" for i in range(2) for m in ("up", "down")
                                       for p in ("weight", "bias") if (m, p) != ("down", "bias")), split
        _assert_matches(rank, want, plan)
        assert rank["losses"] == pytest.approx(want["losses"], abs=1e-4)


# =========================================================================== the Trainer's options with TP
def _checkpointed_layers() -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {"activation_checkpointing_policy": {LlamaDecoderLayer}}


TRAINER_CASES = {
    "accumulate": ({}, {"accumulate_grad_batches": 2}, {}),
    "clip-norm": ({"lr": 5e-2}, {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}, {}),
    "activation-checkpointing": ({}, {}, "checkpointed"),
    "no-reshard": ({}, {}, {"reshard_after_forward": False}),
    "no-meta-init": ({}, {}, {"meta_init": False}),
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_trainer_options_with_tensor_parallelism_match_one_process(case: str) -> None:
    """TP 2 at world size 2 with LoRA, each with accumulation (no reduction on the first micro-batch), clipping (the
    norm over both meshes, each element once), whole-block activation checkpointing (applied after the split), no
    resharding, and a model built for real (meta_init=False: rank 0's values broadcast, then each rank keeps its
    piece): the weights of one process after 3 steps (<= 1e-4)."""
    module_kwargs, trainer_kwargs, strategy = copy.deepcopy(TRAINER_CASES[case])
    strategy = _checkpointed_layers() if strategy == "checkpointed" else strategy
    start = _start_state()
    reference = _fit_reference(start, module_kwargs, trainer_kwargs, data_parallel=1)
    results = run_distributed(_fit_tp, 2, start, module_kwargs, trainer_kwargs, {"tensor_parallel_size": 2, **strategy})
    for rank in results:
        _check_split(rank, 2)
        _assert_same_weights(rank["state"], reference["state"])
    if case == "clip-norm":  # clipping is not ignored: without it one process ends elsewhere
        other = _fit_reference(start, module_kwargs, {}, data_parallel=1)
        assert max((other["state"][k] - reference["state"][k]).abs().max().item() for k in start) > 1e-3


# =========================================================================== initialization and random state
class DropoutModule(TensorParallelModule):
    """LoRA with dropout on q/v."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def configure_model(self) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        from tests.models import tiny_llama_config

        if self.model is None:
            config = LoraConfig(r=4, lora_alpha=8, lora_dropout=self.dropout, target_modules=["q_proj", "v_proj"])
            self.model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), config)


def _fresh(strategy: dict, dropout: float = 0.0, seed_per_rank: bool = False) -> dict:
    """No start state: the model's own init and peft's (random lora_A), then (with dropout) 3 steps. Returns this
    rank's local pieces."""
    world = int(os.environ["WORLD_SIZE"])
    if seed_per_rank:  # processes that were never seeded alike (no seed_everything)
        torch.manual_seed(1000 + int(os.environ["RANK"]))
    module = DropoutModule(dropout) if dropout else TensorParallelModule()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=FSDP2Strategy(**strategy),
                        **_trainer_kwargs(max_steps=3 if dropout else 0))
    trainer.fit(module)
    return {n.removeprefix("model.base_model.model."): p.to_local().detach().clone()
            for n, p in module.named_parameters()}


def test_fresh_initialization_is_whole_on_a_tensor_group_and_distinct_across_its_pieces() -> None:
    """Built on meta and initialized by the model's and peft's rules on each rank: what the plan leaves whole (norms,
    LoRA's A behind a colwise layer) is the same on both ranks of the tensor group; the two halves of a split weight
    differ (no copies of one half)."""
    ranks = run_distributed(_fresh, 2, {"tensor_parallel_size": 2})
    whole = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    split = "model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(ranks[0][whole], ranks[1][whole])
    assert ranks[0][whole].abs().sum() > 0
    assert not torch.equal(ranks[0][split], ranks[1][split])
    assert ranks[0][split].shape == (32, 64)


def test_dropout_drops_alike_on_a_tensor_group() -> None:
    """LoRA dropout 0.3 with processes seeded differently: the tensor group's ranks share rank 0's random state, so
    they drop the same elements of the input they share, and the whole lora_A they train stays the same on both
    after 3 steps (with different masks each would receive another gradient)."""
    ranks = run_distributed(_fresh, 2, {"tensor_parallel_size": 2}, 0.3, True)
    for name in ranks[0]:
        if "lora_A" in name and "q_proj" in name:
            assert torch.equal(ranks[0][name], ranks[1][name]), name


# =========================================================================== data: ranks of a tensor group share
class RecordsBatches(TensorParallelModule):
    """Records the first token of each sample its batches held, read through Lightning's own sampler."""

    def __init__(self) -> None:
        super().__init__(batch_size=2)
        self.seen: list[int] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch[:, 0].tolist())
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        return DataLoader(TokenDataset(16), batch_size=self.batch_size, shuffle=True)


def _lightning_sampler(strategy: dict) -> list[int]:
    module = RecordsBatches()
    kwargs = _trainer_kwargs(max_steps=2)
    kwargs["use_distributed_sampler"] = True  # Lightning's DistributedSampler, from the strategy's arguments
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=FSDP2Strategy(**strategy),
                        **kwargs)
    trainer.fit(module)
    return module.seen


def test_lightnings_own_sampler_gives_a_tensor_group_one_batch() -> None:
    """With use_distributed_sampler=True, Lightning builds its sampler from the strategy's data-parallel split: the
    two ranks of a tensor group read the same samples (without it they would read disjoint halves)."""
    ranks = run_distributed(_lightning_sampler, 2, {"tensor_parallel_size": 2})
    assert ranks[0] == ranks[1] and len(ranks[0]) == 4


# =========================================================================== refusals, on every rank
def _refusal(case: str, pretrained: str) -> str:
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy
    from peft import LoraConfig, get_peft_model

    from tests.models import tiny_llama_config, tiny_model

    strategy: dict = {"tensor_parallel_size": 2}
    if case == "compile+checkpointing":
        strategy.update(compile=True, activation_checkpointing_policy={Block})
    if case == "selective-checkpointing":
        strategy.update(activation_checkpointing_policy={Block}, activation_checkpointing_save="matmuls")
    if case == "tied":
        strategy["tensor_parallel_plan"] = {"lm_head": "colwise_gather_output"}
    if case == "unmatched":
        strategy["tensor_parallel_plan"] = {"model.layers.*.self_attn.q_proj": "colwise",
                                            "model.layers.*.mlp.nothing": "colwise"}
    if case == "unmatched-peft":  # names as in the plain model: under peft's wrapper they start otherwise
        strategy["tensor_parallel_plan"] = {"model.layers.*.mlp.up_proj": "colwise"}
    try:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(**strategy))
        fabric.launch()
        with fabric.init_module():
            if case == "no-plan":
                model = tiny_model("gpt2")[0]
            elif case == "moe":
                model = tiny_model("mixtral")[0]
            elif case == "tied":
                model = tiny_model("gemma")[0]
            elif case == "uneven":
                from transformers import LlamaForCausalLM

                model = LlamaForCausalLM(tiny_llama_config(intermediate_size=129))
            elif case == "heads":
                from transformers import LlamaForCausalLM

                model = LlamaForCausalLM(tiny_llama_config(num_attention_heads=4, num_key_value_heads=1))
            else:
                from transformers import LlamaForCausalLM

                model = LlamaForCausalLM(tiny_llama_config())
            if case == "unmatched-peft":
                model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
            if case == "dora":
                model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
            if case == "modules-to-save":
                model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
            if case == "qlora":
                from lightning_fsdp2 import load_pretrained

                load_pretrained(model, pretrained, quantize="nf4")
        fabric.setup_module(model)
    except (ValueError, RuntimeError, TypeError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(("case", "message"), [
    ("no-plan", "GPT2LMHeadModel has no tensor-parallel plan"),
    ("heads", "4 attention heads and 1 key/value heads"),
    ("uneven", "do not split evenly over 2 ranks: ['model.layers.0.mlp.gate_proj.weight (129, 64) on dim 0'"),
    ("moe", "MixtralForCausalLM splits layers in packed pieces (transformers' 'packed_colwise'/'packed_rowwise'"),
    ("dora", "DoRA on a layer the tensor-parallel plan splits ('colwise')"),
    ("tied", "tied between ['GemmaTextScaledWordEmbedding.weight', 'Linear.weight'] is split differently for each"),
    ("modules-to-save", "lm_head: peft's ModulesToSaveWrapper on a layer the tensor-parallel plan splits"),
    ("unmatched", "['model.layers.*.mlp.nothing'] match no module of the LlamaForCausalLM the strategy sets up."),
    ("unmatched-peft", "Its modules that end like them: for 'model.layers.*.mlp.up_proj':"
                       " 'base_model.model.model.layers.*.mlp.up_proj'."),
    ("compile+checkpointing", "activation_checkpointing_policy=...) together do not run with tensor parallelism"),
    ("selective-checkpointing", "activation_checkpointing_save=...) does not run with tensor parallelism"),
    ("qlora", "(QLoRA) does not run with tensor parallelism"),
])
def test_what_does_not_run_with_tensor_parallelism_is_refused_by_name_on_every_rank(case: str, message: str,
                                                                                   pretrained) -> None:
    """Each refused before anything is allocated, with the same message on both ranks."""
    messages = run_distributed(_refusal, 2, case, str(pretrained))
    assert messages[0] == messages[1]
    assert message in messages[0], messages[0]


def test_layouts_and_plans_that_cannot_work_are_refused_at_construction_or_resolution() -> None:
    from lightning_fsdp2.layout import Layout

    with pytest.raises(ValueError, match="do not split into tensor-parallel groups of 3"):
        Layout.resolve(None, 4, 4, "cpu", 3)
    with pytest.raises(ValueError, match="straddle nodes of 2 devices"):
        Layout.resolve(None, 8, 2, "cpu", 4)
    with pytest.raises(ValueError, match="give the tensor-parallel size once"):
        Layout.resolve((1, 2, 2), 4, 4, "cpu", 4)
    with pytest.raises(ValueError, match=r"2 x 2 x 2 = 8, but there are 4 processes"):
        Layout.resolve((2, 2), 4, 4, "cpu", 2)
    assert Layout.resolve((2, 1, 2), 4, 2, "cpu").names == ("replicate", "shard", "tensor")
    assert Layout.resolve(None, 4, 4, "cpu", 2).sizes == (2, 2)
    assert Layout.resolve((2, 2, 1), 4, 4, "cpu").names == ("replicate", "shard")  # no tensor dimension of 1
    with pytest.raises(ValueError, match="unknown or unsupported style name"):
        FSDP2Strategy(tensor_parallel_size=2, tensor_parallel_plan={"layers.*.up": "colwize"})
    with pytest.raises(ValueError, match="unknown or unsupported style name.*sequence_parallel"):
        FSDP2Strategy(tensor_parallel_size=2, tensor_parallel_plan={"layers.*.norm": "sequence_parallel"})
    with pytest.raises(ValueError, match="the plan is empty"):
        FSDP2Strategy(tensor_parallel_size=2, tensor_parallel_plan={})
    with pytest.raises(TypeError, match="tensor_parallel_plan"):
        FSDP2Strategy(tensor_parallel_size=2, tensor_parallel_plan=["up"])
    with pytest.raises(ValueError, match="tensor_parallel_size"):  # a bad value; another type: TypeError
        FSDP2Strategy(tensor_parallel_size=0)
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        FSDP2Strategy(tensor_parallel_size="2")
    with pytest.raises(ValueError, match="no tensor dimension"):
        from lightning_fsdp2.options import StrategyOptions

        options = StrategyOptions.from_arguments(tensor_parallel_plan={"up": "colwise"})
        options.check_layout(Layout.resolve(None, 2, 2, "cpu"))
    tensor = Layout.resolve(None, 2, 2, "cuda", 2)
    with pytest.raises(ValueError, match=r"FSDP2Strategy\(cpu_offload=...\) does not run with tensor parallelism"):
        StrategyOptions.from_arguments(cpu_offload=True).check_layout(tensor)
    StrategyOptions.from_arguments(compile=True).check_layout(tensor)  # each alone runs
    StrategyOptions.from_arguments(activation_checkpointing_policy={Block}).check_layout(tensor)


# =========================================================================== world size 4: TP x FSDP, HSDP x TP
MESHES = {
    "tp2-fsdp2": {"tensor_parallel_size": 2},
    "tp2-fsdp2-full": {"tensor_parallel_size": 2},  # no LoRA: every base weight trained (and its gradient clipped)
    "replicate2-tp2": {"device_mesh": (2, 1, 2)},
    "shard2-tp2-tuple": {"device_mesh": (1, 2, 2)},
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_tensor_parallel_with_data_parallel_ranks_matches_one_process(mesh: str) -> None:
    """World size 4 as two tensor groups of 2 over FSDP's shards (and as HSDP replicas): each data-parallel rank its
    half of every global batch, clipping over both meshes; the weights of one process after 3 steps (<= 1e-4), the
    plan's layers split on the tensor dimension and the rest sharded over the data-parallel one."""
    lora = not mesh.endswith("-full")
    module_kwargs = {"lr": 5e-2, "lora": lora}
    trainer_kwargs = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    start = _start_state(lora=lora)
    reference = _fit_reference(start, module_kwargs, trainer_kwargs, data_parallel=2)
    results = run_distributed(_fit_tp, 4, start, module_kwargs, trainer_kwargs, MESHES[mesh])
    q = f"{Q}.base_layer.weight" if lora else "model.model.layers.0.self_attn.q_proj.weight"
    for i, rank in enumerate(results):
        if lora:
            _check_split(rank, 2)
        assert rank["sampler"] == {"num_replicas": 2, "rank": i // 2}
        names, _, local = rank["placements"][q]
        # q_proj's 64 rows: split in 2 by the tensor dimension, then over the shard group (of 2, or 1 for HSDP)
        assert "tensor" in names and local == ((16 if "shard2" in mesh or "fsdp2" in mesh else 32), 64), (mesh, local)
        _assert_same_weights(rank["state"], reference["state"])


def _fresh_pieces() -> dict:
    return _fresh({"tensor_parallel_size": 2})


@pytest.mark.slow
def test_fresh_initialization_at_tp2_fsdp2_draws_each_piece_once() -> None:
    """Ranks (shard, tensor) = (0,0), (0,1), (1,0), (1,1): a split weight's four pieces all differ; a whole weight
    (lora_A behind q_proj, sharded over FSDP only) is equal on the two ranks of each tensor group and differs
    between the shard groups' halves."""
    ranks = run_distributed(_fresh_pieces, 4)
    split = "model.layers.0.mlp.up_proj.weight"
    pieces = [ranks[r][split] for r in range(4)]
    assert all(not torch.equal(pieces[a], pieces[b]) for a in range(4) for b in range(a + 1, 4))
    whole = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert torch.equal(ranks[0][whole], ranks[1][whole]) and torch.equal(ranks[2][whole], ranks[3][whole])
    assert not torch.equal(ranks[0][whole], ranks[2][whole])


@pytest.fixture(scope="module")
def saved_tp_fsdp(pretrained, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints after one epoch at world size 4 as TP 2 x FSDP 2."""
    return _saved_after_one_epoch(pretrained, tmp_path_factory.mktemp("saved-tp-fsdp"), 4)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_tp2_fsdp2_checkpoint_resumes_exactly_at_every_layout(fmt: str, pretrained, saved_tp_fsdp: dict,
                                                                straight: dict) -> None:
    """Saved by TP 2 x FSDP 2 after one epoch; resumed by TP 2 x FSDP 2, FSDP over 4, HSDP x TP (2, 1, 2), TP 2 and
    one process: each equal to two epochs straight (FSDP at world size 2)."""
    for world, strategy in ((4, {"tensor_parallel_size": 2}), (4, {}), (4, {"device_mesh": (2, 1, 2)}),
                            (2, {"tensor_parallel_size": 2}), (1, {})):
        resumed = run_distributed(fit_resumable, world, str(pretrained), 2, None, str(saved_tp_fsdp[fmt]), strategy)[0]
        assert_same_run(resumed, straight, f"{fmt} TP x FSDP checkpoint resumed at world size {world} with {strategy}")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_an_hsdp_x_tp_checkpoint_resumes_exactly_at_other_layouts(fmt: str, pretrained, straight: dict,
                                                                 tmp_path) -> None:
    """Saved by HSDP x TP (2, 1, 2: two replicas of one tensor group each) after one epoch; resumed by TP 2 x FSDP 2,
    FSDP over 4 and one process: each equal to two epochs straight (the other direction is the test above)."""
    path = tmp_path / f"{fmt}.ckpt"
    run_distributed(fit_resumable, 4, str(pretrained), 1, str(path), None,
                    {"state_dict_type": fmt, "device_mesh": (2, 1, 2)})
    for world, strategy in ((4, {"tensor_parallel_size": 2}), (4, {}), (1, {})):
        resumed = run_distributed(fit_resumable, world, str(pretrained), 2, None, str(path), strategy)[0]
        assert_same_run(resumed, straight, f"{fmt} HSDP x TP checkpoint resumed at world size {world} with {strategy}")


# =========================================================================== adapters out, generate
def _exports(base: str, adapter: str, out: str, strategy: dict) -> dict:
    from lightning_fsdp2.lora import save_adapter, save_merged

    result = _fabric_tp("llama", base, adapter, 2, strategy)
    model = result.pop("model")
    save_adapter(model, os.path.join(out, "adapter"))
    save_merged(model, os.path.join(out, "merged"))
    prompt = TokenDataset(2).data[:, :6]
    with torch.no_grad():
        result["generated"] = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False)
    result.pop("state")
    return result


def test_adapters_merged_models_and_generate_under_tensor_parallelism_are_one_processs(tmp_path) -> None:
    """After 2 steps at TP 2: save_adapter writes the adapter peft writes for one process, save_merged the merged
    model one process's merge_and_unload writes, and greedy generate() (KV cache of each rank's heads) gives the same
    tokens on every rank as one process."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = _pretrained("llama", str(tmp_path), lora=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter, is_trainable=True)
    _train_loop(None, model, 2, 1, 0)
    model.save_pretrained(tmp_path / "want-adapter")
    prompt = TokenDataset(2).data[:, :6]
    with torch.no_grad():
        generated = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False)
    model.merge_and_unload().save_pretrained(tmp_path / "want-merged")
    ranks = run_distributed(_exports, 2, base, adapter, str(tmp_path / "ours"), {"tensor_parallel_size": 2})
    for rank in ranks:
        assert torch.equal(rank["generated"], generated)
    assert_exports_match(tmp_path)


def assert_exports_match(tmp_path) -> None:
    """The adapter and merged model written under `tmp_path/ours` equal one process's `tmp_path/want-*` (<= 1e-4)."""
    from safetensors.torch import load_file

    for what, file in (("adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        ours, want = load_file(tmp_path / "ours" / what / file), load_file(tmp_path / f"want-{what}" / file)
        assert ours.keys() == want.keys(), what
        worst = max((ours[k] - want[k]).abs().max().item() for k in want)
        assert worst <= 1e-4, f"{what}: {worst}"


# =========================================================================== more of what composes with TP
def test_the_converter_turns_a_tensor_parallel_sharded_checkpoint_into_the_full_one(saved_tp: dict, tmp_path) -> None:
    """`sharded_to_full` of a TP 2 sharded checkpoint (DCP with both placements) gives the weights and optimizer
    state of the full file the same run wrote."""
    from lightning_fsdp2.convert import read_full_checkpoint, sharded_to_full

    converted = read_full_checkpoint(sharded_to_full(saved_tp["sharded"], tmp_path / "converted.ckpt"))
    full = read_full_checkpoint(saved_tp["full"])
    assert converted["state_dict"].keys() == full["state_dict"].keys()
    for key, value in full["state_dict"].items():
        assert torch.equal(converted["state_dict"][key], value), key
    moments = full["optimizer_states"][0]["state"]
    for index, state in converted["optimizer_states"][0]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, moments[index][name]), (index, name)


def _save_options(pretrained: str, root: str) -> dict:
    """LoRA at TP 2: a trainable-only checkpoint and an async sharded one, each resumed at TP 2."""
    out = {"straight": fit_resumable(pretrained, 2, strategy={"tensor_parallel_size": 2}, module={"lora": True})}
    for name, options in {"trainable": {"save_trainable_only": True},
                          "async": {"state_dict_type": "sharded", "async_save": True}}.items():
        path = os.path.join(root, f"{name}.ckpt")
        fit_resumable(pretrained, 1, save_to=path, strategy={"tensor_parallel_size": 2, **options},
                      module={"lora": True})
        out[name] = fit_resumable(pretrained, 2, resume_from=path, strategy={"tensor_parallel_size": 2},
                                  module={"lora": True})
    return out


def test_trainable_only_and_async_saves_under_tensor_parallelism_resume_exactly(pretrained, tmp_path) -> None:
    """save_trainable_only (the LoRA adapters, split and whole, and their optimizer state; the base from
    load_pretrained again) and async_save, at TP 2: each resumed run equals the uninterrupted one."""
    results = run_distributed(_save_options, 2, str(pretrained), str(tmp_path))[0]
    for name in ("trainable", "async"):
        assert_same_run(results[name], results["straight"], name)
    saved = torch.load(tmp_path / "trainable.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    assert saved and all("lora_" in k for k in saved)


def _accumulate_fabric(base: str, adapter: str | None, arch: str = "llama") -> dict:
    """Fabric at TP 2: two micro-batches per step, the first under no_backward_sync."""
    fabric, model = _fabric_model(arch, base, adapter, {"tensor_parallel_size": 2})
    optimizer = fabric.setup_optimizers(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9))
    synced = []
    for batch in _batches(3, 1, 0):
        for i, half in enumerate(batch.chunk(2)):
            with fabric.no_backward_sync(model, enabled=i == 0):
                fabric.backward(model(input_ids=half, labels=half).loss / 2)
            if i == 0:
                synced.append(any(p.grad is not None for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
    return {"state": full_state(model), "synced": synced}


@pytest.mark.parametrize(("arch", "lora"), [("llama", True), ("qwen3", False)], ids=["llama-lora", "qwen3-full"])
def test_fabric_accumulation_with_no_backward_sync_under_tensor_parallelism(arch: str, lora: bool, tmp_path) -> None:
    """Fabric at TP 2 accumulating two half-batches per step (the first under no_backward_sync): no reduction on the
    first micro-batch, and the weights of one process's 3 whole-batch steps (<= 1e-4). Qwen3 fully fine-tuned: its
    per-head q_norm/k_norm, whole on each rank, get each micro-batch's gradient summed over the tensor group once
    (all-reduced after it accumulates, the first micro-batch's would be summed twice)."""
    base, adapter = _pretrained(arch, str(tmp_path), lora=lora)
    want = _fabric_reference(arch, base, adapter, steps=3)
    for rank in run_distributed(_accumulate_fabric, 2, base, adapter, arch):
        assert not any(rank["synced"])
        _assert_matches(rank, want, f"{arch} accumulation")


class CountsGraphs(TensorParallelModule):
    """Records dynamo's count of compiled graphs after each step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.graphs: list[int] = []

    def on_train_batch_end(self, *args) -> None:
        from torch._dynamo.utils import counters

        self.graphs.append(counters["stats"]["unique_graphs"])


def _fit_compiled(start_state: dict, strategy: dict) -> dict:
    from torch._dynamo.utils import counters

    counters.clear()
    module = CountsGraphs(start_state=start_state, lr=5e-2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(**strategy), **_trainer_kwargs())
    trainer.fit(module)
    return {"state": full_state(module), "graphs": module.graphs, "placements": _placements(module),
            "graph_breaks": sum(counters["graph_break"].values()), "inductor": sum(counters["inductor"].values())}


@pytest.mark.slow
def test_compiled_blocks_under_tensor_parallelism_match_one_process() -> None:
    """compile=True at TP 2 (each block compiled after the split: dynamo traces transformers' TP forwards and the
    DTensor ops): inductor graphs made in the first step only, and the weights of one eager process after 3 steps
    (<= 1e-4). (With whole-block checkpointing as well it is refused: below.)"""
    strategy = {"tensor_parallel_size": 2, "compile": True}
    start = _start_state()
    reference = _fit_reference(start, {"lr": 5e-2}, {}, data_parallel=1)
    for rank in run_distributed(_fit_compiled, 2, start, strategy, timeout=900):
        _check_split(rank, 2)
        assert rank["graphs"][0] >= 1 and rank["graphs"] == [rank["graphs"][0]] * 3, rank["graphs"]
        assert rank["inductor"] > 0, rank
        _assert_same_weights(rank["state"], reference["state"])


def _fit_ready_mesh(start_state: dict) -> dict:
    """Under a launcher that started the process group, a 3-D DeviceMesh of the user's, with names of its own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    return _fit_tp(start_state, {"lr": 5e-2}, {}, {"device_mesh": mesh})


def test_a_ready_3d_device_mesh_with_names_of_its_own_is_used() -> None:
    """A ready (replicate, shard, tensor) mesh named ("dp_replicate", "dp_shard", "tp"): the plan's layers are split
    on its "tp" dimension, FSDP2 shards over the other two, and the weights are one process's."""
    start = _start_state()
    reference = _fit_reference(start, {"lr": 5e-2}, {}, data_parallel=1)
    for rank in run_distributed(_fit_ready_mesh, 2, start):
        names, split, _ = rank["placements"][f"{Q}.base_layer.weight"]
        assert names == ("dp_replicate", "dp_shard", "tp") and split[2] == "Shard(dim=0)", (names, split)
        _assert_same_weights(rank["state"], reference["state"])
