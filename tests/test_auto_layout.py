"""`FSDP2Strategy(device_mesh="auto")`: the layout chosen from the memory the run needs.

The pure parts (candidates, the estimate's arithmetic, the model's measurement on meta) are checked without
processes, the activation estimate against the same model's real forward on CPU; the choice is checked in real runs
at world size 2 (the layout and `reshard_after_forward` it chose, read from the sharded parameters on every rank, and
the weights against one process built without this package), with checkpoints saved in the chosen layout resumed in
another, and with Fabric. How close the estimate comes to the measured peak is measured by
`benchmarks/auto_layout.py` (docs/performance.md), not here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fsdp2 import FSDP2Strategy, estimate_layouts
from lightning_fsdp2.auto_layout import (
    GroupSize,
    ModelSize,
    TensorSize,
    candidates,
    check_memory_budget,
    choose,
    estimate,
    measure_model,
    saved_activations,
)
from lightning_fsdp2.wrap import block_names, root_names
from tests.helpers import run_distributed
from tests.models import LlamaModule, assert_same_run, build_llama, fit_resumable, full_state, quiet_trainer_kwargs
from tests.test_strategy import _assert_same_weights, _fit_reference, _start_state, _trainer_kwargs


def _budget(estimate) -> int:
    """The smallest budget ``estimate`` fits (its total within 85% of it)."""
    return math.ceil(estimate.total / 0.85)


def _meta_module(**kwargs) -> LlamaModule:
    module = LlamaModule(**kwargs)
    with torch.device("meta"):
        module.configure_model()
    return module


# --------------------------------------------------------------------------- pure
def test_candidates_go_from_replicas_to_full_sharding() -> None:
    """Fastest first: whole replicas (no all-gather), then each shard size from the smallest, keeping the gathered
    parameters to backward before freeing them; shard groups that straddle nodes unevenly are left out."""
    assert candidates(4, 4) == [(4, 1, True, 1), (2, 2, False, 1), (2, 2, True, 1), (1, 4, False, 1),
                                (1, 4, True, 1)]
    assert candidates(2, 2) == [(2, 1, True, 1), (1, 2, False, 1), (1, 2, True, 1)]
    # 12 processes, 4 per node: groups of 3 or 6 straddle nodes (refused by the layout check), 12 is every rank.
    assert [s for _, s, k, _ in candidates(12, 4) if k] == [1, 2, 4, 12]
    # Then, for a model that context parallelism can split, full sharding with sequences split over groups inside a
    # node, the smallest first (8 ranks cannot be a context group on nodes of 4).
    assert candidates(8, 4, (2, 4, 8))[-2:] == [(1, 4, True, 2), (1, 2, True, 4)]


def test_the_estimate_adds_up_each_component() -> None:
    """Two blocks of 10 x 4 fp32 weights (one trainable 3 x 4 each) and a root of 7 x 2: each rank's rows of every
    tensor (ceil(rows / shard)), the trainable ones' gradients and Adam's two moments, the roots gathered with two
    blocks (or every block without resharding) and one group's unsharded gradients."""
    def tensors(trainable_rows: int) -> tuple[TensorSize, ...]:
        return (TensorSize(10, 40, 4, 4, False), TensorSize(trainable_rows, trainable_rows * 4, 4, 4, True))

    model = ModelSize((GroupSize("b0", tensors(3), False), GroupSize("b1", tensors(3), False),
                       GroupSize("b2", tensors(3), False), GroupSize("", (TensorSize(7, 14, 4, 2, False),), True)),
                      activations=1000)
    e = estimate(model, 1, 4, True)
    assert e.parameters == 3 * (3 * 4 * 4 + 1 * 4 * 4) + 2 * 2 * 4  # ceil(10/4)=3 rows, ceil(3/4)=1, ceil(7/4)=2
    assert e.gradients == 3 * (1 * 4 * 4)
    assert e.optimizer == 2 * e.gradients
    block = (40 + 12) * 4
    assert e.gathered == 14 * 2 + 2 * block + 12 * 4
    assert estimate(model, 1, 4, False).gathered == 14 * 2 + 3 * block + 12 * 4
    assert e.activations == 1000
    moving = e.gradients + e.gathered + 1000  # allocated and freed every step (the optimizer's state is kept)
    assert e.allocator == int(0.1 * moving) and estimate(model, 1, 4, True, device_type="cpu").allocator == moving
    assert e.total == e.parameters + e.optimizer + moving + e.allocator
    assert e.fits(math.ceil(e.total / 0.85)) and not e.fits(math.ceil(e.total / 0.85) - 1)
    # On CPU, blocks freed after forward leave at least every block's gathered bytes in glibc's heap.
    frozen = ModelSize(tuple(GroupSize(f"b{i}", (TensorSize(10, 40, 4, 4, False),), False) for i in range(5)),
                       activations=0)
    assert estimate(frozen, 1, 4, True, device_type="cpu").allocator == 5 * 160  # not 2 x 160, what moves
    assert estimate(frozen, 1, 4, True).allocator == int(0.1 * 2 * 160)  # CUDA's caching allocator reuses them
    unknown = replace_activations(model, None)
    held_back = estimate(unknown, 1, 4, True, budget=4000)
    assert held_back.activations == 1000  # a quarter of the budget held back, no allocator share on it
    assert held_back.allocator == int(0.1 * (moving - 1000))


def replace_activations(model: ModelSize, activations: int | None) -> ModelSize:
    return ModelSize(model.groups, activations, model.activations_note)


def test_measuring_a_meta_model_finds_its_groups_dtypes_and_trainable_set() -> None:
    """The tiny Llama + LoRA on meta: every parameter counted once, in the group fully_shard will put it in (the
    decoder layers, then the root); trainable = the LoRA halves; bf16-true storage and bf16-mixed gathering read from
    the dtypes."""
    module = _meta_module()
    blocks, roots = block_names(module), root_names(module)
    size = measure_model(module, blocks, roots)
    assert [g.name for g in size.groups] == ["model.base_model.model.model.layers.0",
                                            "model.base_model.model.model.layers.1", "model"]
    assert size.parameters == sum(p.numel() for p in module.parameters())
    assert size.trainable == sum(p.numel() for p in module.parameters() if p.requires_grad) > 0
    assert all(t.stored == 4 and t.gathered == 4 for g in size.groups for t in g.tensors)
    mixed = measure_model(module, blocks, roots, gathered_dtype=torch.bfloat16)
    assert all(t.stored == 4 and t.gathered == 2 for g in mixed.groups for t in g.tensors)
    low = measure_model(module.to(torch.bfloat16), blocks, roots)
    assert all(t.stored == 2 for g in low.groups for t in g.tensors)


def _saved_bytes_of_a_real_forward(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """The reference: the distinct non-parameter storages autograd saves in a real forward on CPU (the kernels a CPU
    run dispatches to) that are still alive when it ends, plus the logits."""
    from torch.multiprocessing.reductions import StorageWeakRef

    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    saved: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, use_cache=True)
    alive = sum(n for ref, n in saved.values() if not ref.expired())
    return alive + 2 * 4 * out.logits.numel()  # the loss's backward: two float32 tensors of the logits' size


@pytest.mark.parametrize("lora", [True, False])
def test_the_activation_estimate_on_meta_equals_a_real_forward(lora: bool) -> None:
    """One forward on meta saves exactly what the same model's real forward on CPU saves (LoRA: the frozen base's
    inputs are not saved; full fine-tuning: they are, so more)."""
    torch.manual_seed(0)
    real = build_llama(lora)
    with torch.device("meta"):
        meta = build_llama(lora)
    estimated, how = saved_activations(meta, (3, 16))
    assert "3 x 16" in how
    ids = torch.randint(0, 128, (3, 16))
    assert estimated == _saved_bytes_of_a_real_forward(real.train(), ids)


class _LiveTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak of the bytes of every tensor storage ops create that is still alive, parameters left out."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        super().__init__()
        self.ref = StorageWeakRef
        self.params = {StorageWeakRef(p.untyped_storage()) for p in [*model.parameters(), *model.buffers()]}
        self.live: dict = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = self.ref(t.untyped_storage())
                if ref not in self.params:
                    self.live.setdefault(ref, t.untyped_storage().nbytes())
        self.live = {ref: n for ref, n in self.live.items() if not ref.expired()}
        self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.mark.parametrize("lora", [True, False])
def test_the_activation_estimate_covers_a_real_step_peak(lora: bool) -> None:
    """The peak of the tensors a real forward and backward on CPU hold (parameters aside) is the activation estimate,
    within 5%: it comes in the loss's backward, before the gradients (which the estimate counts apart) exist."""
    torch.manual_seed(0)
    real = build_llama(lora, vocab_size=2048).train()
    with torch.device("meta"):
        meta = build_llama(lora, vocab_size=2048)
    estimated, _ = saved_activations(meta, (4, 32))
    ids = torch.randint(0, 2048, (4, 32))
    tracker = _LiveTensors(real)
    with tracker:
        real(input_ids=ids, labels=ids).loss.backward()
    assert estimated == pytest.approx(tracker.peak, rel=0.05)


def test_checkpointed_blocks_keep_only_their_inputs() -> None:
    """With both decoder layers checkpointed, the estimate drops by all but one layer's saved activations (the one
    recomputed in backward) and adds the layers' inputs."""
    with torch.device("meta"):
        model = build_llama(False)
    layers = [f"model.layers.{i}" for i in range(2)]
    full, _ = saved_activations(model, (2, 16))
    checkpointed, how = saved_activations(model, (2, 16), layers)
    assert "2 checkpointed" in how
    assert checkpointed < full


def test_a_model_without_a_causal_lm_forward_holds_back_a_margin() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    activations, how = saved_activations(model, (2, 16))
    assert activations is None and "25% of the budget" in how and "Sequential" in how


def test_choose_takes_the_fastest_layout_that_fits_and_says_when_none_does() -> None:
    module = _meta_module(lora=False, num_hidden_layers=3)
    report = estimate_layouts(module, 2, batch_shape=(4, 16))
    replicas, keep, shard, context = report.candidates
    assert (replicas.mesh, keep.mesh, shard.mesh) == ((2, 1), (1, 2), (1, 2))
    assert (keep.reshard_after_forward, shard.reshard_after_forward) == (False, True)
    assert shard.total < keep.total < replicas.total  # full fine-tuning: sharding saves gradients and Adam's state
    # Last, the sequences split over both ranks (a Llama's 4 heads divide by 2): half the activations, the same shards.
    assert context.option() == {"replicate": 1, "shard": 1, "context": 2}
    assert context.activations == -(-shard.activations // 2) and context.parameters == shard.parameters
    assert report.chosen is None and report.budget is None
    assert estimate_layouts(module, 2, batch_shape=(4, 16), memory_budget=_budget(replicas)).chosen.mesh == (2, 1)
    chosen = estimate_layouts(module, 2, batch_shape=(4, 16), memory_budget=_budget(replicas) - 1).chosen
    assert chosen.mesh == (1, 2) and chosen.fits(_budget(replicas) - 1)
    chosen = estimate_layouts(module, 2, batch_shape=(4, 16), memory_budget=_budget(shard) - 1).chosen
    from lightning_fsdp2.auto_layout import layout_of

    assert chosen.context == 2 and layout_of(chosen).names == ("shard", "context")
    with pytest.raises(ValueError, match="no layout fits the budget") as err:
        estimate_layouts(module, 2, batch_shape=(4, 16), memory_budget=_budget(context) - 1)
    assert "precision='bf16-true'" in str(err.value) and "| (1, 1) x context 2 | True |" in str(err.value)
    assert "train fewer parameters (LoRA)" in str(err.value)  # full fine-tuning, fp32, no checkpointing
    assert "recompute activations" in str(err.value)


def test_a_refusal_names_only_what_the_run_does_not_do_yet_largest_component_first() -> None:
    """A bf16 LoRA run with checkpointing is not told to use bf16, LoRA or checkpointing; the breakdown is ordered by
    size and counts the allocator's share."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    module = _meta_module(lora=True, num_hidden_layers=3)
    with pytest.raises(ValueError, match="no layout fits the budget") as err:
        estimate_layouts(module, 2, batch_shape=(4, 16), memory_budget=1000, precision="bf16-true",
                         activation_checkpointing_policy={LlamaDecoderLayer})
    said = str(err.value)
    advice = said.split("To fit: ")[1].split("\n")[0]
    assert "bf16-true" not in advice and "LoRA" not in advice and "recompute" not in advice, advice
    assert "quantize the frozen base" in advice and "run more processes" in advice, advice
    breakdown = said.split("needs about ")[1].split(". To fit")[0]
    assert "the allocator's share" in breakdown, breakdown
    # QLoRA already: not told to quantize (NF4 leaves the embeddings, norms and head whole); without batch_shape
    # only an estimate of the activations helps them (a fixed share of the budget otherwise).
    from lightning_fsdp2.auto_layout import choose, measure_model
    from lightning_fsdp2.wrap import block_names, root_names

    model = module.model
    blocks = block_names(model, None)
    nf4 = [n for n, p in model.named_parameters() if n.endswith("proj.weight") and "lora_" not in n]
    size = measure_model(model, blocks, root_names(model), nf4=nf4)
    with pytest.raises(ValueError, match="no layout fits") as err:
        choose(size, 2, 2, 1000)
    advice = str(err.value).split("To fit: ")[1].split("\n")[0]
    assert "quantize" not in advice and "give batch_shape=" in advice and "recompute" not in advice, advice
    figures = re.findall(r"([\d.]+) (B|KiB|MiB|GiB)(?=, | \(|$)", breakdown.split(": ", 1)[1])
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    sizes = [float(n) * scale[u] for n, u in figures]
    assert len(sizes) == 6, breakdown
    assert sizes == sorted(sizes, reverse=True), breakdown


def test_estimate_layouts_leaves_the_model_alone_and_wants_it_on_meta() -> None:
    module = _meta_module()
    before = {n: p.dtype for n, p in module.named_parameters()}
    estimate_layouts(module, 2, precision="bf16-true")
    assert {n: p.dtype for n, p in module.named_parameters()} == before
    with pytest.raises(ValueError, match="built on meta"):
        estimate_layouts(build_llama(), 2)


def test_memory_budget_takes_bytes_and_units() -> None:
    assert check_memory_budget(1000) == 1000
    assert check_memory_budget("20GiB") == 20 * 2**30
    assert check_memory_budget("1.5 GB") == 1_500_000_000
    assert check_memory_budget("512mib") == 512 * 2**20
    for bad in ("lots", -1, 0, "0GB"):  # bad values: ValueError, as every option's
        with pytest.raises(ValueError, match="memory_budget"):
            check_memory_budget(bad)
    for bad in (True, 1.5e9, [1]):  # another type: TypeError
        with pytest.raises(TypeError, match="memory_budget"):
            check_memory_budget(bad)
    with pytest.raises(ValueError, match="memory_budget"):
        FSDP2Strategy(device_mesh="auto", memory_budget="lots")
    with pytest.raises(ValueError, match="peer_timeout"):  # the same rule for every option
        FSDP2Strategy(peer_timeout=-1)
    with pytest.raises(TypeError, match="peer_timeout"):
        FSDP2Strategy(peer_timeout="5")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"memory_budget": "1GiB"}, "read by device_mesh='auto'"),
    ({"batch_shape": (2, 16)}, "read by device_mesh='auto'"),
    ({"device_mesh": "auto", "tensor_parallel_size": 2}, "data-parallel layouts"),
    ({"device_mesh": "auto", "reshard_after_forward": False}, "chooses the layout and reshard_after_forward"),
    ({"device_mesh": "auto", "batch_shape": (2,)}, "two positive ints"),
    ({"device_mesh": "manual"}, "device_mesh='manual'"),
])
def test_auto_options_are_checked_at_construction(kwargs: dict, fragment: str) -> None:
    with pytest.raises((TypeError, ValueError), match=fragment.replace("(", r"\(").replace(")", r"\)")):
        FSDP2Strategy(**kwargs)


# --------------------------------------------------------------------------- real runs
def _reshards_after_forward(layer: torch.nn.Module) -> bool | None:
    """Whether ``layer``'s FSDP group frees its gathered parameters after forward (``None``: not a group)."""
    if not hasattr(layer, "_get_fsdp_state"):
        return None
    return layer._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None


def _fit_auto(start_state: dict, module_kwargs: dict, strategy_kwargs: dict) -> dict:
    """Train with "auto"; report the q projection's weight as this rank holds it, and whether the frozen base is
    FSDP2's (a DTensor) or plain."""
    from torch.distributed.tensor import DTensor

    world = int(__import__("os").environ["WORLD_SIZE"])
    module = LlamaModule(start_state=start_state, **module_kwargs)
    strategy = FSDP2Strategy(device_mesh="auto", **strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, **_trainer_kwargs())
    trainer.fit(module)
    lora = module_kwargs.get("lora", True)
    layer = module.model.get_submodule(("base_model.model." if lora else "") + "model.layers.0")
    q = layer.self_attn.q_proj
    trained = q.lora_A["default"].weight if lora else q.weight
    frozen = [p for p in module.parameters() if not p.requires_grad]
    return {"state": full_state(module), "mesh": tuple(trained.device_mesh.shape), "rows": trained.to_local().shape[0],
            "frozen_plain": bool(frozen) and not any(isinstance(p, DTensor) for p in frozen),
            "reshard": _reshards_after_forward(layer), "chosen": strategy.layout_choice.chosen.mesh,
            "option": strategy.layout_choice.chosen.option(),
            "module_mesh": tuple(module.device_mesh.shape)}


def test_auto_replicates_what_fits_and_shards_what_does_not() -> None:
    """World size 2, a tiny Llama (three layers) fully fine-tuned: with a budget a whole replica fits in, every rank
    holds whole parameters ((2, 1), the gradients all-reduced); one byte less, it is sharded over both ranks and kept
    gathered from forward to backward; less still, freed after forward. Each trains to the weights of one process."""
    # Full fine-tuning (gradients and Adam's state in every layout) of three layers (two held gathered are not all).
    config = {"num_hidden_layers": 3, "lora": False}
    module_kwargs = {"batch_size": 2, **config}
    start = _start_state(**config)
    reference = _fit_reference(start, module_kwargs, {}, world=2)
    report = estimate_layouts(_meta_module(**module_kwargs), 2, batch_shape=(2, 16), device_type="cpu")
    replicas, keep, shard, context = report.candidates
    assert context.total < shard.total < keep.total < replicas.total
    for budget, mesh, rows, reshard in ((_budget(replicas), (2, 1), 64, True), (_budget(replicas) - 1, (2,), 32, False),
                                        (_budget(keep) - 1, (2,), 32, True)):
        results = run_distributed(_fit_auto, 2, start, module_kwargs,
                                  {"memory_budget": budget, "batch_shape": (2, 16)})
        for rank in results:
            assert (rank["mesh"], rank["rows"], rank["reshard"]) == (mesh, rows, reshard), budget
            assert rank["chosen"] == (mesh if len(mesh) == 2 else (1, 2))
            assert rank["module_mesh"] == mesh  # LightningModule.device_mesh is the chosen one
            _assert_same_weights(rank["state"], reference["state"])
    # Less than full sharding needs, but its activations halved: each sequence split over both ranks (context
    # parallelism), which read one batch: one process's weights on that batch.
    # (lr 1e-3: Adam turns the rounding differences of near-zero gradients, summed over the tokens in another order,
    # into steps of up to lr.)
    module_kwargs = {**module_kwargs, "lr": 1e-3}
    reference = _fit_reference(start, module_kwargs, {}, world=1)
    for rank in run_distributed(_fit_auto, 2, start, module_kwargs,
                                {"memory_budget": _budget(shard) - 1, "batch_shape": (2, 16)}):
        assert (rank["mesh"], rank["rows"], rank["reshard"]) == ((2,), 32, True)  # FSDP2 over shard x context
        assert rank["option"] == {"replicate": 1, "shard": 1, "context": 2} and rank["module_mesh"] == (1, 2)
        _assert_same_weights(rank["state"], reference["state"])


def test_whole_replicas_leave_a_frozen_base_to_plain_tensors() -> None:
    """LoRA with a budget a whole replica fits in: the adapters are FSDP2's, replicated over (2, 1) and their gradients
    all-reduced once per step (the root the only group, no decoder layer a group), while the frozen base stays plain
    tensors FSDP2 never gathers, as DDP holds a model: the weights of one process."""
    start = _start_state()
    reference = _fit_reference(start, {"batch_size": 2}, {}, world=2)
    report = estimate_layouts(_meta_module(batch_size=2), 2, batch_shape=(2, 16), device_type="cpu")
    assert report.candidates[0].frozen_plain and report.candidates[0].mesh == (2, 1)
    for rank in run_distributed(_fit_auto, 2, start, {"batch_size": 2},
                                {"memory_budget": _budget(report.candidates[0]), "batch_shape": (2, 16)}):
        assert (rank["mesh"], rank["rows"], rank["frozen_plain"], rank["reshard"]) == ((2, 1), 4, True, None)
        _assert_same_weights(rank["state"], reference["state"])


def _refused(budget: str) -> str:
    world = int(__import__("os").environ["WORLD_SIZE"])
    module = LlamaModule()
    trainer = L.Trainer(accelerator="cpu", devices=world,
                        strategy=FSDP2Strategy(device_mesh="auto", memory_budget=budget), **_trainer_kwargs())
    try:
        trainer.fit(module)
    except ValueError as err:
        allocated = [n for n, p in module.named_parameters() if not p.is_meta]
        return f"{err} | allocated: {allocated}"
    return "trained"


def test_a_budget_no_layout_fits_is_refused_on_every_rank_before_allocation() -> None:
    for message in run_distributed(_refused, 2, "10KB"):
        assert "no layout fits the budget of 9.77 KiB per rank (memory_budget), of which an estimate may use 85%:" \
               " 8.3 KiB." in message  # 10KB: bytes in units by size, and which figure the budget is
        assert "25% of the budget held back" in message  # no batch_shape: the margin
        assert message.endswith("allocated: []")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpoint_saved_in_the_chosen_layout_resumes_in_any_other(fmt: str, lora: bool, pretrained: Path,
                                                                     straight: dict, tmp_path: Path) -> None:
    """Trained one epoch with "auto" choosing whole replicas (2, 1) (with LoRA: the frozen base plain tensors), saved;
    resumed by full sharding over 2, by "auto" again and by one process: each equal to two epochs straight."""
    module = {"lora": True} if lora else None
    auto = {"device_mesh": "auto", "memory_budget": "8GiB"}
    if lora:  # peft's random lora_A is drawn per shard: the straight run is "auto"'s own
        straight = run_distributed(fit_resumable, 2, str(pretrained), 2, None, None, auto, module)[0]
    path = tmp_path / "auto.ckpt"
    run_distributed(fit_resumable, 2, str(pretrained), 1, str(path), None, {"state_dict_type": fmt, **auto}, module)
    for world, strategy in ((2, {}), (2, {"device_mesh": "auto"}), (1, {})):
        resumed = run_distributed(fit_resumable, world, str(pretrained), 2, None, str(path), strategy, module)[0]
        assert_same_run(resumed, straight, f"{fmt} checkpoint of 'auto' (LoRA: {lora}) resumed at world size {world},"
                                           f" {strategy}")


def _fabric_auto(budget: int) -> dict:
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricFSDP2Strategy

    strategy = FabricFSDP2Strategy(device_mesh="auto", memory_budget=budget)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module():
        model = build_llama(False, num_hidden_layers=3)
    model = fabric.setup_module(model)
    q = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    return {"mesh": tuple(q.device_mesh.shape), "chosen": strategy.layout_choice.chosen.mesh,
            "layout": strategy.layout.sizes}


def test_fabric_chooses_too() -> None:
    """Fabric's strategy takes "auto" alike (a fully fine-tuned model): the model given to `setup_module` is the root,
    the choice is kept."""
    with torch.device("meta"):
        model = build_llama(False, num_hidden_layers=3)
    replicas, keep, _ = estimate_layouts(model, 2, device_type="cpu").candidates
    # No batch_shape: a quarter of the budget is held back for activations, and the rest must be within 85% of it.
    whole, sharded = math.ceil(replicas.total / 0.6) + 1, math.ceil(keep.total / 0.6) + 1
    assert sharded < whole
    for rank in run_distributed(_fabric_auto, 2, whole):
        assert rank == {"mesh": (2, 1), "chosen": (2, 1), "layout": (2, 1)}
    for rank in run_distributed(_fabric_auto, 2, sharded):
        assert rank["mesh"] == (2,) and rank["chosen"] == (1, 2)


@pytest.mark.parametrize(("kwargs", "kind", "fragment"), [
    ({"device_type": "gpu"}, ValueError, "'cuda' or 'cpu'"),
    ({"devices_per_node": 3}, ValueError, "the processes are whole nodes"),
    ({"optimizer_states": -1}, ValueError, "optimizer_states=-1"),
    ({"batch_shape": (0, 16)}, ValueError, "two positive ints"),
    ({"batch_shape": "2x16"}, TypeError, "two positive ints"),
    ({"world_size": 2.0}, TypeError, "world_size=2.0"),
], ids=["device-type", "devices-per-node", "optimizer-states", "batch-shape", "batch-shape-type", "world-size"])
def test_estimate_layouts_refuses_what_the_strategy_would(kwargs: dict, kind: type, fragment: str) -> None:
    """Its own arguments checked as the strategy's options are (another type TypeError, a bad value ValueError),
    instead of a table for a layout that cannot exist."""
    arguments = {"world_size": 2, **kwargs}
    with pytest.raises(kind, match=re.escape(fragment)):
        estimate_layouts(_meta_module(), arguments.pop("world_size"), **arguments)


def test_a_tensor_size_given_twice_is_refused_at_construction() -> None:
    for mesh in ({"tensor": 2}, (1, 2, 2)):
        with pytest.raises(ValueError, match="give the tensor-parallel size once"):
            FSDP2Strategy(device_mesh=mesh, tensor_parallel_size=4)
    FSDP2Strategy(device_mesh={"tensor": 2}, tensor_parallel_size=2)  # the same size twice is fine
