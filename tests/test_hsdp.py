"""HSDP: `FSDP2Strategy(device_mesh=(replicate, shard))` shards each parameter over groups of `shard` ranks and
replicates it over `replicate` groups. Compared with one process built without this package (training), with the
layout checked on every rank (so that a strategy ignoring the mesh fails), and resumed across layouts."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fsdp2 import FSDP2Strategy
from tests.helpers import run_distributed
from tests.models import (
    LlamaModule,
    assert_same_run,
    fit_resumable,
    fit_resumable_single_device,
    full_state,
    quiet_trainer_kwargs,
)
from tests.test_strategy import _assert_same_weights, _fit_reference, _start_state, _trainer_kwargs


def _layout(module: torch.nn.Module) -> dict:
    """The mesh and placements of the sharded parameters, and this rank's local rows of one weight."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if isinstance(p, DTensor)]
    q = module.model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer").weight
    return {
        "mesh": tuple(params[0].device_mesh.shape),
        "names": params[0].device_mesh.mesh_dim_names,
        "placements": sorted({str(p.placements) for p in params}),
        "rows": q.to_local().shape[0],
    }


def _fit_hsdp(start_state: dict, module_kwargs: dict, trainer_kwargs: dict, mesh: tuple[int, int]) -> dict:
    world = int(__import__("os").environ["WORLD_SIZE"])
    module = LlamaModule(start_state=start_state, **module_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=FSDP2Strategy(device_mesh=mesh),
                        **_trainer_kwargs(**trainer_kwargs))
    trainer.fit(module)
    return {"state": full_state(module), "layout": _layout(module)}


PARITY = {
    "plain": ({"batch_size": 2}, {}),
    "accumulate": ({"batch_size": 2}, {"accumulate_grad_batches": 2}),
    "clip-norm": ({"batch_size": 2, "lr": 5e-2}, {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}),
}


def _check_hsdp(results: list[dict], replicate: int, shard: int) -> None:
    for rank in results:
        assert rank["layout"]["mesh"] == (replicate, shard)
        assert rank["layout"]["names"] == ("replicate", "shard")
        assert rank["layout"]["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert rank["layout"]["rows"] == 64 // shard  # q_proj: 64 rows split over the shard group only


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PARITY))
def test_hsdp_2x2_matches_one_process(case: str) -> None:
    """World size 4 as 2 replicas x 2 shards, each rank its own quarter of every global batch: the weights of one
    process after 3 SGD steps (<= 1e-4), with accumulation (no reduction on the first micro-batch) and clipping (the
    norm over the shard groups, not counted again per replica)."""
    module_kwargs, trainer_kwargs = copy.deepcopy(PARITY[case])
    start = _start_state()
    reference = _fit_reference(start, module_kwargs, trainer_kwargs, world=4)
    results = run_distributed(_fit_hsdp, 4, start, module_kwargs, trainer_kwargs, (2, 2))
    _check_hsdp(results, 2, 2)
    for rank in results:
        _assert_same_weights(rank["state"], reference["state"])
    moved = max((reference["state"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3


def test_two_replicas_of_whole_parameters_match_one_process() -> None:
    """`device_mesh=(2, 1)` at world size 2: FSDP2 with shard groups of one rank (whole parameters, replicated, only
    the gradient all-reduce between ranks), the same weights as one process."""
    module_kwargs, trainer_kwargs = copy.deepcopy(PARITY["accumulate"])
    start = _start_state()
    reference = _fit_reference(start, module_kwargs, trainer_kwargs, world=2)
    results = run_distributed(_fit_hsdp, 2, start, module_kwargs, trainer_kwargs, (2, 1))
    _check_hsdp(results, 2, 1)
    for rank in results:
        _assert_same_weights(rank["state"], reference["state"])


def _fresh_shards(mesh: tuple[int, int]) -> dict:
    """Build on meta and materialize with the model's own (random) init and peft's random lora_A, no start state;
    return this rank's local shards before any step."""
    world = int(__import__("os").environ["WORLD_SIZE"])
    module = LlamaModule()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=FSDP2Strategy(device_mesh=mesh),
                        **_trainer_kwargs(max_steps=0))
    trainer.fit(module)
    return {n: p.to_local().detach().clone() for n, p in module.named_parameters()}


@pytest.mark.slow
def test_replicas_of_a_shard_are_initialized_alike_and_shards_differ() -> None:
    """Random initialization on a CPU mesh is seeded by the shard coordinate: ranks 0 and 2 (shard 0 of replicas 0
    and 1) hold the same values, ranks 0 and 1 (shards 0 and 1) different ones. Seeded per global rank, the replicas
    would start apart and stay apart (their gradients are averaged, not their weights)."""
    ranks = run_distributed(_fresh_shards, 4, (2, 2))
    names = [n for n in ranks[0] if "q_proj" in n and ("lora_A" in n or "base_layer" in n)]
    assert len(names) == 4  # two layers x (base weight, lora_A)
    for name in names:
        assert torch.equal(ranks[0][name], ranks[2][name]), name
        assert torch.equal(ranks[1][name], ranks[3][name]), name
        assert not torch.equal(ranks[0][name], ranks[1][name]), name


class RecordsSamples(LlamaModule):
    """Trains on samples that are their own index, recording which ones this rank's batches held."""

    def __init__(self) -> None:
        super().__init__(batch_size=2)
        self.seen: list[int] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen += batch[:, 0].tolist()
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.arange(16).repeat_interleave(16).view(16, 16)  # sample i: sixteen tokens `i`
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=True)


def _samples_seen(mesh: tuple[int, int]) -> list[int]:
    world = int(__import__("os").environ["WORLD_SIZE"])
    module = RecordsSamples()
    # Lightning's own distributed sampler (the default): the strategy tells it every rank is a data-parallel rank.
    L.Trainer(accelerator="cpu", devices=world, strategy=FSDP2Strategy(device_mesh=mesh), max_epochs=1,
              logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)
    return module.seen


@pytest.mark.slow
def test_every_rank_of_every_replica_reads_its_own_samples() -> None:
    """Under 2 x 2 HSDP, Lightning's distributed sampler gives each of the 4 ranks a quarter of the data: the two
    ranks of a shard group, and the replicas, read different samples, and together read every sample once."""
    seen = run_distributed(_samples_seen, 4, (2, 2))
    assert all(len(s) == 4 for s in seen), seen
    assert sorted(i for s in seen for i in s) == list(range(16)), seen


# --------------------------------------------------------------------------- resume across layouts
@pytest.fixture(scope="module")
def saved_hsdp(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints after one epoch at world size 4 as 2 x 2, in both formats."""
    root = tmp_path_factory.mktemp("saved-hsdp")
    paths = {"full": root / "full.ckpt", "sharded": root / "sharded.ckpt"}
    for fmt, path in paths.items():
        run_distributed(fit_resumable, 4, str(pretrained), 1, str(path), None,
                        {"state_dict_type": fmt, "device_mesh": (2, 2)})
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_an_hsdp_checkpoint_resumes_exactly_at_every_layout(fmt: str, pretrained: Path, saved_hsdp: dict,
                                                            straight: dict) -> None:
    """Saved by 2 x 2 HSDP after one epoch (the full file gathered from one replica); resumed for the second epoch by
    2 x 2 HSDP, FSDP over 4 and over 2, and one process: each equal to two epochs straight (FSDP at world size 2)."""
    for world, mesh in ((4, (2, 2)), (4, None), (2, None), (1, None)):
        resumed = run_distributed(fit_resumable, world, str(pretrained), 2, None, str(saved_hsdp[fmt]),
                                  {"device_mesh": mesh})[0]
        assert_same_run(resumed, straight, f"{fmt} HSDP checkpoint resumed at world size {world}, mesh {mesh}")
    if fmt == "full":  # what a single-device run writes and reads
        assert_same_run(fit_resumable_single_device(str(pretrained), 2, resume_from=str(saved_hsdp[fmt])), straight,
                        "full HSDP checkpoint resumed by Lightning's single-device strategy")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_an_fsdp_checkpoint_resumes_exactly_as_hsdp(fmt: str, pretrained: Path, saved: dict, straight: dict) -> None:
    """Saved by FSDP at world size 2 after one epoch, resumed by 2 x 2 HSDP: equal to two epochs straight."""
    resumed = run_distributed(fit_resumable, 4, str(pretrained), 2, None, str(saved[fmt]), {"device_mesh": (2, 2)})[0]
    assert_same_run(resumed, straight, f"{fmt} FSDP checkpoint resumed by 2 x 2 HSDP")


# --------------------------------------------------------------------------- exports
def _train_and_export_hsdp(pretrained: str, out: str, mesh: tuple[int, int] | None) -> dict:
    from lightning_fsdp2.lora import save_adapter, save_merged
    from tests.models import ResumeModule, probe_logits

    world = int(__import__("os").environ["WORLD_SIZE"])
    module = ResumeModule(pretrained, lora=True)
    module.lr = 3e-2
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=FSDP2Strategy(device_mesh=mesh), max_epochs=1,
                        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(module)
    save_adapter(module, Path(out) / "adapter")
    save_merged(module, Path(out) / "merged")
    return {"logits": probe_logits(module.model)}


@pytest.mark.slow
def test_hsdp_exports_a_peft_adapter_and_a_merged_model(pretrained: Path, tmp_path: Path) -> None:
    """After a LoRA epoch at 2 x 2, `save_adapter` and `save_merged` write the whole adapter and the whole merged
    model (one replica's shards gathered): peft and transformers in one process give the trained model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.models import probe_logits

    trained = run_distributed(_train_and_export_hsdp, 4, str(pretrained), str(tmp_path), (2, 2))
    expected = trained[0]["logits"]
    for rank in trained:
        assert torch.allclose(rank["logits"], expected)
    assert (probe_logits(AutoModelForCausalLM.from_pretrained(pretrained)) - expected).abs().max() > 1e-3
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), tmp_path / "adapter")
    assert torch.allclose(probe_logits(with_adapter), expected, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(probe_logits(merged), expected, atol=1e-4)


def _fit_with_a_ready_mesh(ranks: list[list[int]]) -> dict | str:
    """Under a launcher that started the process group (as torchrun's users may), pass a DeviceMesh built from it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo")
    mesh = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("replicate", "shard"))
    try:
        return _fit_hsdp(_start_state(), {"batch_size": 4}, {}, mesh)["layout"]
    except ValueError as err:
        return str(err)


def test_a_ready_device_mesh_is_used_and_one_out_of_rank_order_refused() -> None:
    """A 2-D DeviceMesh (2 replicas x 1) built by the user is the mesh the parameters are placed on; one whose ranks
    are out of order (rank 0 not first: the full gather from rank 0's shard group would not line up) is refused on
    every rank."""
    for rank in run_distributed(_fit_with_a_ready_mesh, 2, [[0], [1]]):
        assert rank["mesh"] == (2, 1) and rank["placements"] == ["(Replicate(), Shard(dim=0))"], rank
    errors = run_distributed(_fit_with_a_ready_mesh, 2, [[1], [0]])
    assert errors[0] == errors[1] and "mesh of ranks [[1], [0]]" in errors[0] and "in rank order" in errors[0]


# --------------------------------------------------------------------------- errors
def _fit_with_mesh(mesh: object) -> str:
    world = int(__import__("os").environ["WORLD_SIZE"])
    try:
        L.Trainer(accelerator="cpu", devices=world, strategy=FSDP2Strategy(device_mesh=mesh),
                  **_trainer_kwargs()).fit(LlamaModule())
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_mesh_that_does_not_cover_the_processes_is_refused_on_every_rank() -> None:
    errors = run_distributed(_fit_with_mesh, 2, (2, 2))
    assert errors[0] == errors[1]
    assert "device_mesh=(2, 2)): 2 x 2 = 4, but there are 2 processes" in errors[0]


def test_shard_groups_that_straddle_nodes_and_malformed_meshes_are_refused() -> None:
    from lightning_fsdp2.options import StrategyOptions

    def check(mesh: object, world: int, devices_per_node: int, reshard: bool | int = True) -> None:
        options = StrategyOptions.from_arguments(device_mesh=mesh, reshard_after_forward=reshard)
        options.check_layout(options.layout.resolve(world, devices_per_node, "cpu"))

    # 3 nodes x 2 devices as 2 replicas x 3 shards: the second shard group takes one device of node 1 and both of
    # node 2, so its all-gathers cross between nodes.
    with pytest.raises(ValueError, match=r"shard groups of 3 ranks straddle nodes of 2 devices"):
        check((2, 3), 6, devices_per_node=2)
    check((3, 2), 6, devices_per_node=2)  # one shard group per node
    check((1, 4), 4, devices_per_node=2)  # one shard group of two whole nodes
    for bad, kind in (((2,), ValueError), ((2, 0), ValueError), ((2.0, 2), TypeError), ((True, 2), TypeError)):
        # a tuple of ints that cannot be: a bad value; anything else: another type
        with pytest.raises(kind, match=r"pass a tuple \(replicate, shard\) of two positive ints"):
            StrategyOptions.from_arguments(device_mesh=bad)
    with pytest.raises(ValueError, match="the one string it takes is 'auto'"):
        StrategyOptions.from_arguments(device_mesh="2x2")
    with pytest.raises(ValueError, match=r"2 ranks have none \(no divisor of 2 other than 1 and itself\)"):
        check((2, 2), 4, devices_per_node=2, reshard=2)
    with pytest.raises(ValueError, match=r"a divisor of 4 other than 1 and 4"):
        check((1, 4), 4, devices_per_node=4, reshard=3)
