"""What both strategies share (the Trainer's and Fabric's ``FSDP2Strategy``): the options, devices, ranks, the
process group, the layout and its device mesh, collectives, the model's init context and its ``parallelize`` call.

A mixin, placed before Lightning's ``ParallelStrategy`` in each strategy's bases: it needs only what both of
Lightning's ``ParallelStrategy`` classes have (``parallel_devices``, ``cluster_environment``, ``local_rank``,
``node_rank``, ``global_rank``, ``world_size``) plus ``num_nodes``. Each front-end keeps Lightning's plumbing only:
its hooks' names, its launcher, its checkpoint entry points.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp2.auto_layout import AutoLayout, LayoutChoice, agreed_budget
from lightning_fsdp2.checkpoint.pretrained import DeferredLoads
from lightning_fsdp2.init import meta_init_context
from lightning_fsdp2.layout import Layout
from lightning_fsdp2.lockstep import PeerWatch
from lightning_fsdp2.options import StrategyOptions
from lightning_fsdp2.parallel import ModulePrecision, Parallelized, earlier_set_up, parallelize, remember_set_up
from lightning_fsdp2.precision import convert_stock_precision


class FrontEndCore:
    """Options, processes, layout, collectives and the model's set-up of an FSDP2 strategy (either front-end)."""

    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    num_nodes: int
    _process_group_backend: str | None
    _device_mesh: DeviceMesh | None

    # The front-end's own precision plugin class and how its messages name things (set by each front-end).
    _precision_class: type
    _strategy_name: str
    _front_end: str

    def _set_options(self, options: StrategyOptions) -> None:
        """The options (checked by :meth:`StrategyOptions.from_arguments`); and what every strategy holds before it
        starts."""
        self._options = options
        self._process_group_backend = options.process_group.backend
        self._layout: Layout | None = None
        self._device_mesh = None
        self._auto_layout: AutoLayout | None = None  # device_mesh="auto": the request, until a model is set up
        self._layout_choice: LayoutChoice | None = None  # ... and what it chose
        self._deferred = DeferredLoads()  # load_pretrained calls made while the model is built, run after sharding
        # Each rank's phase, for a peer left waiting; the process group's own timeout comes back at each start.
        self._peer_watch = PeerWatch(options.peer_watch.timeout, options.process_group.timeout)
        # Processes per node, where the cluster environment reports the launch itself (Ray Train): taken at its word.
        self._reported_per_node: int | None = None

    @property
    def _sharded(self) -> bool:
        """Checkpoints are saved as a directory of every rank's shards."""
        return self._options.save.sharded

    def _trainable_only(self, *parallelized: Parallelized | None) -> bool:
        """Checkpoints hold the trainable parameters only: asked for, or a base stored in NF4 (QLoRA) among the set-up
        modules saved (frozen, and it comes from ``load_pretrained`` again on resume: never saved)."""
        return self._options.save.save_trainable_only or any(p is not None and p.quantized for p in parallelized)

    # ---------------------------------------------------------------- processes, layout, mesh
    @property
    def layout(self) -> Layout:
        """The processes' layout (named mesh dimensions and their sizes), resolved when the processes start (with
        ``device_mesh="auto"``: chosen when the first model is set up)."""
        if self._layout is None:
            raise self._not_yet("layout")
        return self._layout

    def _not_yet(self, what: str) -> RuntimeError:
        when = ("when the model is set up (device_mesh='auto' chooses the layout from the model's memory)"
                if self._auto_layout is not None else
                "after the processes have been set up (in `fit`, or by `fabric.launch()`)")
        return RuntimeError(f"The {what} exists only {when}.")

    @property
    def layout_choice(self) -> LayoutChoice | None:
        """With ``device_mesh="auto"``, once a model is set up: every candidate layout's estimated per-rank memory,
        the budget, and the layout chosen (``.chosen``; ``.table()`` shows them). ``None`` otherwise."""
        return self._layout_choice

    @property
    def device_mesh(self) -> DeviceMesh:
        """The processes' mesh, its dimensions named as the layout's (``strategy.layout``): ``("shard",)`` over all
        processes, ``("replicate", "shard")`` with HSDP, and ``"tensor"`` last with tensor parallelism (e.g.
        ``("shard", "tensor")`` for ``tensor_parallel_size=2``); FSDP2 shards over its data-parallel dimensions."""
        if self._device_mesh is None:
            raise self._not_yet("device mesh")
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        """This process's device: its own among the node's devices, or the one device it sees (a Ray Train worker,
        ``devices="auto"``: each sees only its own)."""
        assert self.parallel_devices is not None
        if self._reported_per_node is not None and len(self.parallel_devices) == 1:
            return self.parallel_devices[0]
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        if self._reported_per_node is not None:
            return self._reported_per_node
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    def _checkpoint_target(self, path: Any, sharded: bool) -> tuple[str, bool]:
        """Where this rank writes a checkpoint ``path``, and whether the save must end before it returns.

        Rank 0's path, as Lightning's strategies do (ranks may build a file name from an unsynced metric). A sharded
        save under a cluster environment that starts the processes itself (Ray Train) writes to each rank's own path,
        synchronously: Ray's ``RayTrainReportCallback`` gives every worker a temporary directory, reports it as soon
        as the save returns, deletes it, and Ray merges what the workers reported into one checkpoint."""
        if sharded and self._reported_per_node is not None:
            return str(path), True
        return self.broadcast(str(path)), False  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each data-parallel rank reads a different part of the data; the ranks of a tensor- or context-parallel
        group (which differ only on the ``"tensor"`` or ``"context"`` dimension) read the same."""
        if self._layout is None:  # asked before the processes started: every process is data-parallel
            world = self.world_size if self._reported_per_node is not None else self.num_nodes * self.num_processes  # type: ignore[attr-defined]
            return {"num_replicas": world, "rank": self.global_rank}  # type: ignore[attr-defined]
        return {"num_replicas": self._layout.data_parallel_size,
                "rank": self._layout.data_parallel_rank(self.global_rank)}  # type: ignore[attr-defined]

    @property
    def process_group_backend(self) -> str | None:
        """The backend of the default process group."""
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and ``rank_zero_only`` this process's global rank."""
        if self.cluster_environment is not None and self._reported_per_node is None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank = self.global_rank  # type: ignore[attr-defined]
        rank_zero_only.rank = fabric_rank_zero_only.rank = utils_rank_zero_only.rank = rank

    def _start_processes(self) -> None:
        """Check the launch, resolve and check the layout and the options that depend on it, start the process group
        and build the mesh; every rank, before any model work. The front-end's own ``setup_environment`` (the
        accelerator's device set-up) runs in between, as ``super()``."""
        assert self.parallel_devices is not None
        self._reported_per_node = reported_launch(self.cluster_environment, num_processes=len(self.parallel_devices),
                                                  num_nodes=self.num_nodes)
        if self._reported_per_node is None:
            validate_external_launch(
                self.cluster_environment,
                num_processes=self.num_processes,
                num_nodes=self.num_nodes,
                local_rank=self.local_rank,  # type: ignore[attr-defined]
                node_rank=self.node_rank,  # type: ignore[attr-defined]
            )
        super().setup_environment()  # type: ignore[misc]
        reset_seed()
        self.set_world_ranks()
        device = self.root_device
        # Sizes only, no collective yet: what cannot work raises on every rank alike.
        self._options.check_device(device)
        if not self._options.layout.auto:
            self._layout = self._options.layout.resolve(self.world_size, self.num_processes, device.type)  # type: ignore[attr-defined]
            self._options.check_layout(self._layout)
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(device)
        device_id = device if device.type != "cpu" else None
        timeout = self._options.process_group.timeout or default_pg_timeout
        # torchrun's agent hosts the store (`TORCHELASTIC_USE_AGENT_STORE=True`) and keeps it across the restarts of
        # `--max-restarts`: a restarted attempt would read the addresses the previous one published (gloo/NCCL then
        # connect to dead ports). Each attempt starts its group in a namespace of its own (`_attempt_store`).
        # Elsewhere (Lightning's launchers, SLURM and its requeues, torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        # rank 0 hosts a new store for each start: nothing stale to read.
        store = None
        torchrun = type(self.cluster_environment).__name__ == "TorchElasticEnvironment"  # type: ignore[attr-defined]
        if torchrun and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not _distributed_is_initialized():
            env, rank, world_size = self.cluster_environment, self.global_rank, self.world_size  # type: ignore[attr-defined]
            agent_store = torch.distributed.TCPStore(env.main_address, env.main_port, world_size, is_master=False,
                                                     timeout=timeout)
            store = _attempt_store(agent_store, rank, world_size, timeout)
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._options.process_group.timeout,  # type: ignore[attr-defined]
            device_id=device_id, **({"store": store} if store is not None else {}),
        )
        if self._layout is not None:
            self._device_mesh = self._layout.build_mesh(device.type)
        else:  # device_mesh="auto": chosen in `parallelize`, from the first model set up, against this budget
            options = self._options.layout
            self._auto_layout = AutoLayout(self.world_size, self.num_processes,  # type: ignore[attr-defined]
                                           agreed_budget(options.memory_budget, device, self.num_processes),
                                           options.batch_shape, device.type,
                                           budget_given=options.memory_budget is not None)
        self._peer_watch.start(lambda: self._device_mesh.get_all_groups() if self._device_mesh is not None else [])

    # ---------------------------------------------------------------- the model
    @contextmanager
    def _init_context(
        self, empty_init: bool | None, precision_context: AbstractContextManager
    ) -> Generator[None, None, None]:
        """Where the model is built (``configure_model``, ``fabric.init_module()``): parameters on ``meta`` unless
        ``meta_init=False`` (or ``empty_init=False``), ``load_pretrained`` deferred to after sharding, the storage
        dtype set by the precision plugin's ``precision_context``."""
        meta = self._options.init.meta_init if empty_init is None else empty_init
        with meta_init_context() if meta else nullcontext(), self._deferred.collecting(), precision_context:
            yield

    def _parallelize(
        self, module: nn.Module, precision: ModulePrecision, *, training: bool, module_is_root: bool = False
    ) -> Parallelized:
        """:func:`lightning_fsdp2.parallel.parallelize` with this strategy's layout, mesh, options and device, and
        the ``load_pretrained`` calls made while ``module`` was built."""
        request = self._layout if self._layout is not None else self._auto_layout
        assert request is not None, "the processes are set up first"
        options = self._options
        # What decides how the model is laid out (not the options about saving, waiting or the process group).
        shaping = ("tensor_parallel", "shard", "checkpointing", "compile", "prefetch", "offload_activations", "init",
                   "forward_check")
        settings = {"processes": self.world_size, "layout": request, "device": self.root_device.type,  # type: ignore[attr-defined]
                    "module_is_root": module_is_root, "precision": getattr(precision, "precision", None),
                    "adapter_dtype": getattr(precision, "adapter_dtype", None),
                    **{name: getattr(options, name) for name in shaping}}
        earlier = earlier_set_up(module, settings, training)
        if earlier is not None:
            # A model an earlier Trainer (or Fabric) set up, taken as it is: its layout and mesh become this run's.
            if self._deferred.take(module).loads:
                raise RuntimeError(
                    f"`load_pretrained` was called on {type(module).__name__} again, for a model an earlier run of"
                    " FSDP2Strategy set up and loaded: make `configure_model` return early when the model exists"
                    " (`if self.model is not None: return`), or load into the set-up model with"
                    " `model.load_state_dict(...)`."
                )
            self._layout, self._device_mesh = earlier.layout, earlier.mesh
            self._layout_choice = earlier.layout_choice
            precision.compute_as(options.shard.mixed_precision or precision.mixed_precision_policy, self.root_device)
            return earlier
        result = parallelize(
            module,
            self._device_mesh,
            layout=request,
            options=self._options,
            precision=precision,
            device=self.root_device,
            pretrained=self._deferred.take(module),
            training=training,
            module_is_root=module_is_root,
        )
        if result.layout_choice is not None:  # the first model set up with "auto": its layout is the strategy's
            self._layout, self._device_mesh, self._layout_choice = result.layout, result.mesh, result.layout_choice
            rank_zero_info(result.layout_choice.describe())
        remember_set_up(module, result, {**settings, "layout": result.layout}, training)
        return result

    # ---------------------------------------------------------------- collectives
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Wait for all processes."""
        if not _distributed_is_initialized():
            return
        with self._peer_watch.phase("barrier"):
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every process."""
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        with self._peer_watch.phase("broadcast"):
            torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    def _reduce(self, tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None) -> Tensor | Any:
        """Reduce a tensor over all processes; other values pass through."""
        if isinstance(tensor, Tensor):
            with self._peer_watch.phase("reduce"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register as ``"fsdp2"`` in the front-end's strategy registry."""
        if "fsdp2" not in strategy_registry:
            strategy_registry.register("fsdp2", cls, description="FSDP2 (fully_shard) from lightning-fsdp2")


def _attempt_store(store: torch.distributed.Store, rank: int, world_size: int,
                   timeout: timedelta) -> torch.distributed.Store:
    """``store`` seen through a key prefix that only this attempt's processes share, for a store that outlives them
    (torchrun's, across its restarts).

    The attempt cannot be named by ``TORCHELASTIC_RESTART_COUNT``: each node's agent counts its own restarts, and one
    restarted for another node's failure does not count it (pytorch/pytorch#135712, #108158); ranks in different
    namespaces would wait for each other until the timeout. So rank 0 draws the name and hands it to each rank in
    answer to a nonce that rank drew (under a key named by the nonce, so no rank reads an earlier attempt's answer;
    torchrun ends every process of an attempt before it starts the next). Rank 0 answers until every rank has
    counted itself in under the name."""
    prefix = "lightning_fsdp2/attempts/"
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()

    def wait_a_little(what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Rank {rank} waited {timeout} for {what} (the process group's timeout).")
        time.sleep(0.02)

    if rank == 0:
        name = nonce
        hello = [f"{prefix}hello/{r}" for r in range(1, world_size)]
        store.wait(hello, timeout)  # present: this attempt's nonces, or an earlier attempt's (answered until replaced)
        answered: set[str] = set()
        while store.add(f"{prefix}{name}/joined", 0) < world_size - 1:
            fresh = {n.decode() for n in store.multi_get(hello)} - answered
            if fresh:
                store.multi_set([f"{prefix}welcome/{n}" for n in fresh], [name] * len(fresh))
                answered |= fresh
            wait_a_little("the other ranks to start the process group")
    else:
        store.set(f"{prefix}hello/{rank}", nonce)
        name = store.get(f"{prefix}welcome/{nonce}").decode()  # waits (the store's timeout) for this nonce's answer
        store.add(f"{prefix}{name}/joined", 1)
    return torch.distributed.PrefixStore(f"{prefix}{name}/", store)


def precision_property(attribute: str, doc: str) -> property:
    """A front-end's precision-plugin property (Lightning names it ``precision_plugin`` in the Trainer's strategies,
    ``precision`` in Fabric's), kept in ``attribute``: always this front-end's ``FSDP2Precision``, Lightning's stock
    plugins converted on assignment."""

    def get(self: Any) -> Any:
        if not isinstance(getattr(self, attribute, None), self._precision_class):
            setattr(self, attribute, self._precision_class())
        return getattr(self, attribute)

    def put(self: Any, plugin: Any) -> None:
        setattr(self, attribute, convert_stock_precision(plugin, self._precision_class, self._strategy_name,
                                                         self._front_end))

    return property(get, put, doc=doc)


def _launch_fix(num_processes: int, num_nodes: int, torchrun: bool) -> str:
    """What to set instead of ``devices=num_processes, num_nodes=num_nodes``: from torchrun's own numbers
    (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``) under torchrun, else in general terms."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if torchrun and world and local and int(local) > 0 and int(world) % int(local) == 0:
        nodes = int(world) // int(local)
        return (f"Set `Trainer(devices={local}, num_nodes={nodes})` (or Fabric's) instead of devices={num_processes},"
                f" num_nodes={num_nodes}: torchrun started {local} process(es) per node (--nproc-per-node) on"
                f" {nodes} node(s) (--nnodes).")
    return (f"Set `devices` (now {num_processes}) to the processes per node and `num_nodes` (now {num_nodes}) to the"
            " nodes the launcher started (torchrun's --nproc-per-node and --nnodes; SLURM's --ntasks-per-node and"
            " --nodes).")


def reported_launch(env: Any, *, num_processes: int, num_nodes: int) -> int | None:
    """The processes per node, where a cluster environment that starts the processes itself reports the world size
    and the ranks on its own (Ray Train's ``RayLightningEnvironment``: it ignores ``set_world_size`` and answers from
    Ray's context); ``None`` where the launch is Lightning's, or the environment takes ``devices * num_nodes`` from
    the strategy (Lightning's own, torchrun's and SLURM's check that against what they started).

    Such an environment is taken at its word, with ``devices="auto"`` (each worker sees one device: ``devices=1``)
    or the devices per node it started; other ``devices``/``num_nodes`` are refused, saying what to set."""
    if env is None or not env.creates_processes_externally:
        return None
    try:
        env.validate_settings(num_devices=num_processes, num_nodes=num_nodes)
    except ValueError:
        return None  # torchrun's and SLURM's own check failed: validate_external_launch says what to set
    expected = num_processes * num_nodes
    env.set_world_size(expected)
    world = env.world_size()
    if world == expected:
        return None  # it holds what the strategy says (Lightning's), or it checked it (torchrun's, SLURM's)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or world // max(num_nodes, 1)
    nodes = world // per_node if per_node and world % per_node == 0 else None
    fits_devices = num_processes in (1, per_node)
    fits_nodes = num_nodes in (1, nodes)
    if not (fits_devices and fits_nodes):
        where = f"{nodes} node(s) x {per_node}" if nodes else f"{world}"
        raise ValueError(
            f"{type(env).__name__} started {world} processes ({where} per node), but `devices={num_processes}` and"
            f" `num_nodes={num_nodes}` in Lightning. Set `devices=\"auto\"` (each process uses the device it was"
            f" given) and leave `num_nodes` at 1, or set `devices={per_node}`"
            + (f" and `num_nodes={nodes}`." if nodes else ".")
        )
    return per_node


def validate_external_launch(env: Any, *, num_processes: int, num_nodes: int, local_rank: int, node_rank: int) -> None:
    """Processes started outside Lightning (torchrun, SLURM, any launcher) must be as many as ``devices *
    num_nodes``: Lightning's launchers check that, but with no launcher nobody does, and a mismatch trains silently on
    part of the data or fails in an index. Checked from each rank's own environment before any collective, so every
    rank raises together."""
    if env is None or not env.creates_processes_externally:
        return
    try:
        env.validate_settings(num_devices=num_processes, num_nodes=num_nodes)  # torchrun's and SLURM's own
    except ValueError as err:
        if "HINT" in str(err):  # SLURM's messages already say what to set
            raise
        torchrun = type(env).__name__ == "TorchElasticEnvironment"
        raise ValueError(f"{err} {_launch_fix(num_processes, num_nodes, torchrun)}") from err
    expected = num_processes * num_nodes
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != expected:
        raise ValueError(
            f"You set `devices={num_processes}` and `num_nodes={num_nodes}` in Lightning, but the product"
            f" ({num_processes} * {num_nodes}) does not match the world size ({world}) of the processes"
            f" your launcher started. {_launch_fix(num_processes, num_nodes, torchrun=False)}"
        )
    if not 0 <= local_rank < num_processes:
        raise ValueError(
            f"This process has LOCAL_RANK={local_rank}, but `devices={num_processes}` in Lightning: set"
            " `devices` to the number of processes the launcher starts per node."
        )
    # Right total, wrong split (2 nodes x 1 process launched, `devices=2, num_nodes=1`): only the processes
    # whose own numbers are out of range can tell; the others then wait for them until `timeout`.
    if not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"This process has NODE_RANK={node_rank}, but `num_nodes={num_nodes}` in Lightning: set"
            " `num_nodes` to the number of nodes and `devices` to the processes per node the launcher starts."
        )
    rank = os.environ.get("RANK")
    if rank is not None and int(rank) != node_rank * num_processes + local_rank:
        raise ValueError(
            f"This process has RANK={rank}, but `devices={num_processes}` and `num_nodes={num_nodes}`"
            f" in Lightning make it rank {node_rank * num_processes + local_rank} (NODE_RANK"
            f" {node_rank} x {num_processes} + LOCAL_RANK {local_rank}): set `devices` to the"
            " processes per node and `num_nodes` to the nodes the launcher starts."
        )
