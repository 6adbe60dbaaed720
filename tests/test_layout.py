"""The layout (named mesh dimensions) and the per-technique options: what every module asks instead of assuming
positions, and the front-ends' arguments forwarded in one place."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from lightning_fsdp2.layout import DATA_PARALLEL, Layout
from lightning_fsdp2.options import StrategyOptions
from tests.helpers import run_distributed


# =========================================================================== the layout, without processes
def test_a_layout_names_its_dimensions_and_answers_by_name() -> None:
    fsdp = Layout.resolve(None, 4, 4, "cpu")
    assert (fsdp.names, fsdp.sizes, fsdp.shard_size, fsdp.data_parallel_size) == (("shard",), (4,), 4, 4)
    hsdp = Layout.resolve((2, 3), 6, 3, "cpu")
    assert (hsdp.names, hsdp.size("replicate"), hsdp.shard_size, hsdp.size("tensor")) == (("replicate", "shard"), 2, 3, 1)
    # Row-major, as init_device_mesh lays ranks out: rank 4 is replica 1, shard 1.
    assert hsdp.coordinates(4) == {"replicate": 1, "shard": 1}
    assert [hsdp.data_parallel_rank(r) for r in range(6)] == list(range(6))


def test_the_sizes_by_name_lay_out_the_processes_as_the_positional_forms() -> None:
    """`device_mesh={"replicate": 2, "shard": 4, "tensor": 2}`: a dimension left out has one rank, "shard" left out
    takes the processes the others leave; the same Layout as the tuple, checked as strictly."""
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.layout import check_mesh_option

    def resolve(option, world=8, per_node=8, tensor=1):
        return Layout.resolve(check_mesh_option(option), world, per_node, "cpu", tensor)

    assert resolve({"replicate": 2, "shard": 2, "tensor": 2}) == resolve((2, 2, 2))
    assert resolve({"replicate": 2, "tensor": 2}) == resolve((2, 2, 2))  # shard: what is left
    assert resolve({"shard": 8}) == resolve(None) == resolve({})
    assert resolve({"replicate": 2}) == resolve((2, 4))
    assert resolve({"tensor": 2}) == resolve(None, tensor=2) == resolve({"shard": 4}, tensor=2)
    assert resolve({"tensor": 2}).names == ("shard", "tensor")
    with pytest.raises(ValueError, match=r"\['pipeline'\] name no dimension of the layout; the dimensions are"):
        FSDP2Strategy(device_mesh={"shard": 2, "pipeline": 2})
    with pytest.raises(ValueError, match="each size is a positive int"):
        FSDP2Strategy(device_mesh={"shard": 0})
    with pytest.raises(TypeError, match="each size is a positive int"):
        FSDP2Strategy(device_mesh={"shard": "2"})
    with pytest.raises(ValueError, match="give the tensor-parallel size once"):
        resolve({"tensor": 2}, tensor=4)
    with pytest.raises(ValueError, match="do not split into 3"):
        resolve({"replicate": 3})
    with pytest.raises(ValueError, match=r"device_mesh=\{'shard': 3\}\): 1 x 3 = 3, but there are 8 processes") as err:
        resolve({"shard": 3})  # named in the form given, and so is the advice
    assert 'Choose {"replicate": ..., "shard": ...}' in str(err.value) and "(replicate, shard)" not in str(err.value)
    assert resolve({"replicate": 1}) == resolve(None)  # a dimension of one rank is none


def test_ranks_that_differ_only_off_the_data_parallel_dimensions_read_the_same_batch() -> None:
    # A dimension that is not data-parallel (tensor parallelism's, next): its ranks share one batch.
    layout = Layout(("replicate", "shard", "tensor"), (2, 2, 2))
    assert "tensor" not in DATA_PARALLEL
    assert layout.data_parallel_size == 4
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_strategies_sampler_arguments_come_from_the_layout() -> None:
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy

    from lightning.fabric.plugins.environments import LightningEnvironment

    for front_end in (FSDP2Strategy, FabricStrategy):
        environment = LightningEnvironment()
        environment.set_global_rank(3)
        strategy = front_end(cluster_environment=environment)
        strategy._layout = Layout(("shard", "tensor"), (2, 2))  # what _start_processes resolves (no processes here)
        assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


# =========================================================================== tensors: from their own placements
def _slices_and_gathers_from_placements() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_fsdp2.checkpoint.shards import gather_tensor, local_slice, receive_bytes
    from lightning_fsdp2.layout import pieces_coordinate

    dist.init_process_group("gloo")
    # Dimension names of the user's choosing, and the dimension that splits rows *first*: nothing may assume
    # "the last dimension shards".
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "copies"))
    whole = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    out: dict = {}
    for name, placements in {
        "rows-first": (Shard(0), Replicate()),   # FSDP2's layout, replicated over the *last* dimension
        "hsdp": (Replicate(), Shard(0)),
        "two-splits": (Shard(0), Shard(1)),      # no FSDP2 layout: the general path
    }.items():
        tensor = distribute_tensor(whole, mesh, placements)
        index = local_slice(tensor)
        out[name] = {
            "slice_ok": bool(torch.equal(whole[index], tensor.to_local())),
            "gathered": gather_tensor(tensor),
            "coordinate": pieces_coordinate([tensor]),
            "receive_bytes": receive_bytes(tensor),
        }
    dist.destroy_process_group()
    return out


def test_slices_gathers_and_seeds_follow_each_tensors_placements() -> None:
    ranks = run_distributed(_slices_and_gathers_from_placements, 4)
    whole = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    for rank, result in enumerate(ranks):
        for name, found in result.items():
            assert found["slice_ok"], (rank, name)
            if rank == 0:
                assert torch.equal(found["gathered"], whole), name
            else:
                assert found["gathered"] is None, (rank, name)
    # Which piece a rank holds: replicas share a coordinate (and so an init seed), different pieces differ.
    assert [r["rows-first"]["coordinate"] for r in ranks] == [0, 0, 1, 1]
    assert [r["hsdp"]["coordinate"] for r in ranks] == [0, 1, 0, 1]
    assert [r["two-splits"]["coordinate"] for r in ranks] == [0, 1, 2, 3]
    # The point-to-point path (a padded receive of 2 x 4 rows) for FSDP2's layouts; the general one otherwise.
    assert ranks[0]["rows-first"]["receive_bytes"] == ranks[0]["hsdp"]["receive_bytes"] == 8 * 6 * 4
    assert ranks[0]["two-splits"]["receive_bytes"] == 0


# =========================================================================== where FSDP2 keeps each group
class LastDimStored(Layout):
    """A layout that keeps every parameter split along its last dimension (FSDP2's default is its first): what a
    dimension that stores some groups otherwise (expert parallelism's experts) asks of the rest of the package."""

    def storage(self, mesh, group, module, expert_mesh=None):
        from torch.distributed.tensor import Shard

        return replace(super().storage(mesh, group, module, expert_mesh), placement=lambda p: Shard(p.ndim - 1))


def _fit_stored_by_last_dim(pretrained: str, epochs: int, save_to: str | None, resume_from: str | None) -> dict:
    """tests.models.fit_resumable with the layout replaced by :class:`LastDimStored` once the processes started,
    saving sharded checkpoints."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import ResumeModule, full_state, quiet_trainer_kwargs, world

    class StoresByLastDim(FSDP2Strategy):
        def setup_environment(self) -> None:
            super().setup_environment()
            self._layout = LastDimStored(self._layout.names, self._layout.sizes)

    model = ResumeModule(pretrained)
    trainer = L.Trainer(accelerator="cpu", devices=world(), strategy=StoresByLastDim(state_dict_type="sharded"), max_epochs=epochs,
                        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs())
    trainer.fit(model, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {"state": full_state(model), "step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "split_dims": {n: pl[0].dim for n, pl in placements.items()},
            "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}


def test_groups_kept_where_the_layout_says_train_save_and_resume_as_the_default(pretrained, saved: dict,
                                                                                  straight: dict, tmp_path) -> None:
    """Layout.storage decides, group by group, where FSDP2 keeps the parameters (here: split along their last
    dimension). Loaded from a pretrained checkpoint, trained, saved and resumed, a run kept so is the default's: its
    sharded checkpoint resumes at the default layout and the default's resumes in it, each equal to two epochs
    straight."""
    from tests.models import assert_same_run, fit_resumable

    mine = tmp_path / "last-dim.ckpt"
    first = run_distributed(_fit_stored_by_last_dim, 2, str(pretrained), 1, str(mine), None)
    for rank in first:  # the option reached FSDP2: every parameter split along its last dimension
        assert rank["split_dims"] and all(d == len(rank["shapes"][n]) - 1 for n, d in rank["split_dims"].items())
    resumed = run_distributed(_fit_stored_by_last_dim, 2, str(pretrained), 2, None, str(mine))[0]
    assert_same_run(resumed, straight, "kept by last dimension, resumed kept so")
    resumed = run_distributed(fit_resumable, 2, str(pretrained), 2, None, str(mine), {})[0]
    assert_same_run(resumed, straight, "kept by last dimension, resumed by the default layout")
    resumed = run_distributed(_fit_stored_by_last_dim, 2, str(pretrained), 2, None, str(saved["sharded"]))[0]
    assert_same_run(resumed, straight, "the default layout's checkpoint resumed kept by last dimension")


# =========================================================================== options: one object per technique
def test_both_front_ends_forward_the_same_option_arguments_with_the_same_defaults() -> None:
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy

    options = StrategyOptions.arguments()
    trainer = inspect.signature(FSDP2Strategy.__init__).parameters
    fabric = inspect.signature(FabricStrategy.__init__).parameters
    assert set(options) <= set(trainer), sorted(set(options) - set(trainer))
    assert set(options) - set(fabric) == {"async_save"}  # Fabric has no background saves
    for name, param in options.items():
        for front_end, params in (("Trainer", trainer), ("Fabric", fabric)):
            if name in params:
                assert params[name].default == param.default, (front_end, name)
    assert StrategyOptions.from_arguments() == StrategyOptions()


def test_each_option_reaches_its_technique() -> None:
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy

    given = {"device_mesh": (1, 2), "reshard_after_forward": False, "activation_checkpointing_policy": {torch.nn.Linear},
             "activation_checkpointing_every": 2, "compile": {"dynamic": False}, "forward_prefetch": 2,
             "backward_prefetch": 2, "reshard_last_block": False, "unmatched_forward_timeout": 5.0, "meta_init": False,
             "process_group_backend": "gloo", "state_dict_type": "sharded", "save_trainable_only": True,
             "tensor_parallel_size": 2, "tensor_parallel_plan": {"layers.*.up": "colwise"}}
    for strategy in (FSDP2Strategy(**given), FabricStrategy(**given)):
        o = strategy._options
        assert (o.layout.device_mesh, o.shard.reshard_after_forward, o.checkpointing.policy, o.checkpointing.every,
                o.compile.kwargs, o.prefetch.forward, o.prefetch.backward, o.prefetch.reshard_last_block,
                o.forward_check.timeout, o.init.meta_init, o.process_group.backend, o.save.state_dict_type,
                o.save.save_trainable_only, o.layout.tensor_parallel_size,
                o.tensor_parallel.plan) == tuple(given.values())
    with pytest.raises(TypeError, match="unexpected option"):
        StrategyOptions.from_arguments(start_method="spawn")


AUTO = {"device_mesh": "auto"}


@pytest.mark.parametrize(("kwargs", "kind"), [
    # another type than the option takes: TypeError
    ({"device_mesh": 2.0}, TypeError), ({"device_mesh": [2.0, 2]}, TypeError), ({"device_mesh": {"shard": "2"}}, TypeError),
    ({**AUTO, "memory_budget": 1.5e9}, TypeError), ({**AUTO, "batch_shape": "4x16"}, TypeError),
    ({**AUTO, "batch_shape": (4, "16")}, TypeError), ({"tensor_parallel_size": "2"}, TypeError),
    ({"tensor_parallel_plan": ["up"]}, TypeError), ({"reshard_after_forward": "yes"}, TypeError),
    ({"cpu_offload": "yes"}, TypeError), ({"mixed_precision": "bf16"}, TypeError),
    ({"activation_checkpointing_every": "2"}, TypeError), ({"forward_prefetch": "1"}, TypeError),
    ({"reshard_last_block": "no"}, TypeError), ({"offload_activations": 1}, TypeError), ({"compile": "yes"}, TypeError),
    ({"unmatched_forward_timeout": "5"}, TypeError), ({"peer_timeout": "5"}, TypeError), ({"meta_init": "no"}, TypeError),
    ({"process_group_backend": 3}, TypeError), ({"timeout": 5}, TypeError), ({"state_dict_type": 1}, TypeError),
    ({"save_trainable_only": 1}, TypeError), ({"state_dict_type": "sharded", "async_save": 1}, TypeError),
    ({"verify_checkpoints": "yes"}, TypeError), ({"router_aux_loss": True}, TypeError),
    ({"expert_parallel_size": "2"}, TypeError), ({"context_parallel_size": 2.0}, TypeError),
    # the type it takes, a value it cannot be: ValueError
    ({"device_mesh": (2, 0)}, ValueError), ({"device_mesh": (2,)}, ValueError), ({"device_mesh": "Auto"}, ValueError),
    ({"device_mesh": {"shard": 0}}, ValueError), ({"device_mesh": {"pipeline": 2}}, ValueError),
    ({**AUTO, "memory_budget": "lots"}, ValueError), ({**AUTO, "memory_budget": -1}, ValueError),
    ({**AUTO, "batch_shape": (4,)}, ValueError), ({**AUTO, "batch_shape": (0, 16)}, ValueError),
    ({"tensor_parallel_size": 0}, ValueError), ({"tensor_parallel_plan": {}}, ValueError),
    ({"activation_checkpointing_every": 0}, ValueError), ({"forward_prefetch": -1}, ValueError),
    ({"unmatched_forward_timeout": -1}, ValueError), ({"peer_timeout": 0}, ValueError),
    ({"state_dict_type": "shard"}, ValueError), ({"router_aux_loss": "global"}, ValueError),
    ({"expert_parallel_size": 0}, ValueError), ({"context_parallel_size": 0}, ValueError),
], ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__)
def test_an_argument_of_another_type_raises_type_error_and_a_bad_value_value_error(kwargs: dict, kind: type) -> None:
    """One rule for every option, on both front-ends, at construction, naming the argument."""
    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy

    named = [k for k in kwargs if k != "device_mesh" or len(kwargs) == 1][-1]
    for front_end in (FSDP2Strategy, FabricStrategy):
        if front_end is FabricStrategy and "async_save" in kwargs:
            continue  # Fabric has no background saves
        with pytest.raises(kind, match=named):
            front_end(**kwargs)
