"""Writing checkpoints and exports safely: only what is ours is replaced, nothing partial is left behind, a full disk
is named, the full file is streamed (and is still what ``torch.save`` writes), sharded saves can run in the
background."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fsdp2 import CheckpointFileError
from lightning_fsdp2.checkpoint.stream import save_streamed
from lightning_fsdp2.convert import read_full_checkpoint
from tests.helpers import run_distributed
from tests.models import build_llama, fit_resumable, probe_logits, save_tiny_pretrained


def _foreign_directory(path: Path) -> dict[str, bytes]:
    """A directory of someone else's files; returns their contents, to check they are intact afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("my notes")
    torch.save({"state_dict": {"w": torch.ones(2)}}, path / "other-run.ckpt")
    return {p.name: p.read_bytes() for p in path.iterdir()}


def _contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


# =========================================================================== never replace what is not ours
def _save_over(pretrained: str, targets: list[str], fmt: str) -> list[str]:
    """Train briefly, then try to save to each target; return each outcome (the error message, or "saved")."""
    import lightning as L

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import ResumeModule, quiet_trainer_kwargs, world

    trainer = L.Trainer(
        accelerator="cpu", devices=world(), strategy=FSDP2Strategy(state_dict_type=fmt), max_steps=1,
        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    trainer.fit(ResumeModule(pretrained))
    outcomes = []
    for target in targets:
        try:
            trainer.save_checkpoint(target)
            outcomes.append("saved")
        except CheckpointFileError as err:
            outcomes.append(str(err))
    return outcomes


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_saving_over_a_foreign_directory_or_file_is_refused_and_ours_is_replaced(
    fmt: str, pretrained: Path, tmp_path: Path
) -> None:
    foreign_dir = tmp_path / "run_dir"
    kept = _foreign_directory(foreign_dir)
    text = tmp_path / "readme.ckpt"
    text.write_text("not a checkpoint")
    link = tmp_path / "link.ckpt"
    link.symlink_to(text)
    ours = tmp_path / "ours.ckpt"
    targets = [foreign_dir, text, link, ours, ours, tmp_path / "empty"]
    (tmp_path / "empty").mkdir()
    per_rank = run_distributed(_save_over, 2, str(pretrained), [str(t) for t in targets], fmt)
    assert per_rank[0] == per_rank[1], "every rank raises the same error"
    refused_dir, refused_text, refused_link, first, second, empty = per_rank[0]
    assert "Refusing to save to" in refused_dir and "notes.txt" in refused_dir, refused_dir
    assert "not a checkpoint" in refused_text and "symbolic link" in refused_link
    assert (first, second, empty) == ("saved", "saved", "saved"), "a previous checkpoint of ours is replaced"
    assert _contents(foreign_dir) == kept and text.read_text() == "not a checkpoint" and link.is_symlink()
    assert read_full_checkpoint(ours)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "link.ckpt", "ours.ckpt", "readme.ckpt", "run_dir"]


def test_only_checkpoints_of_ours_are_replaceable(saved: dict, tmp_path: Path) -> None:
    import shutil

    from lightning_fsdp2.checkpoint.files import check_replaceable
    from lightning_fsdp2.checkpoint.files import remove

    torch.save({"state_dict": {}}, tmp_path / "a.ckpt")
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "scripted.pt")
    (tmp_path / "notes.txt").write_text("mine")
    shutil.copytree(saved["sharded"], tmp_path / "sharded.ckpt")
    shutil.copytree(saved["sharded"], tmp_path / "sharded-plus.ckpt")
    (tmp_path / "sharded-plus.ckpt" / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link.ckpt").symlink_to(tmp_path / "a.ckpt")  # as ModelCheckpoint(save_last="link") makes
    (tmp_path / "dangling.ckpt").symlink_to(tmp_path / "gone.ckpt")
    (tmp_path / "link-to-notes").symlink_to(tmp_path / "notes.txt")
    expected = {"a.ckpt": "full", "sharded.ckpt": "sharded", "empty": "empty", "link.ckpt": "link",
                "dangling.ckpt": "link", "new.ckpt": "absent"}
    for name, kind in expected.items():
        assert check_replaceable(tmp_path / name) == kind, name
    for name in ("scripted.pt", "notes.txt", "sharded-plus.ckpt", "link-to-notes"):
        with pytest.raises(CheckpointFileError, match="Refusing to save to"):
            check_replaceable(tmp_path / name)
    with pytest.warns(UserWarning, match="Not removing"):
        remove(tmp_path / "sharded-plus.ckpt")
    assert (tmp_path / "sharded-plus.ckpt" / "notes.txt").exists()
    remove(tmp_path / "link.ckpt")
    assert not (tmp_path / "link.ckpt").is_symlink() and (tmp_path / "a.ckpt").exists(), "the link, not its target"


def _save_through_a_link(pretrained: str, link: str) -> list[str]:
    return _save_over(pretrained, [link], "sharded")


def test_a_save_replaces_a_link_never_its_target(pretrained: Path, tmp_path: Path) -> None:
    target = tmp_path / "epoch=0.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "global_step": 7}, target)
    link = tmp_path / "last.ckpt"
    link.symlink_to(target)
    assert run_distributed(_save_through_a_link, 2, str(pretrained), str(link))[0] == ["saved"]
    assert not link.is_symlink() and link.is_dir() and read_full_checkpoint(link)["global_step"] == 1
    assert torch.load(target, weights_only=True)["global_step"] == 7


def test_a_full_checkpoint_replaces_a_sharded_one_and_back(pretrained: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "last.ckpt")
    assert run_distributed(_save_over, 2, str(pretrained), [path], "sharded")[0] == ["saved"]
    assert run_distributed(_save_over, 2, str(pretrained), [path], "full")[0] == ["saved"]
    assert Path(path).is_file()
    assert run_distributed(_save_over, 2, str(pretrained), [path], "sharded")[0] == ["saved"]
    assert Path(path).is_dir() and read_full_checkpoint(path)["global_step"] == 1


def test_converter_refuses_to_replace_a_foreign_directory_and_adds_hf_files_beside_others(
    saved: dict, tmp_path: Path
) -> None:
    from lightning_fsdp2.convert import to_hf_safetensors

    export = tmp_path / "hf-export"
    kept = _foreign_directory(export)
    cli = [sys.executable, "-m", "lightning_fsdp2.convert", str(saved["sharded"]), str(export)]
    result = subprocess.run(cli, capture_output=True, text=True)
    assert result.returncode == 1 and "Refusing to save to" in result.stderr and "notes.txt" in result.stderr
    assert "Traceback" not in result.stderr
    assert _contents(export) == kept

    # --to hf writes its files into the directory; stale shards of an earlier export go, other files stay.
    (export / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (export / "model.safetensors.index.json").write_text("{}")
    to_hf_safetensors(saved["full"], export)
    names = {p.name for p in export.iterdir()}
    assert names == {"notes.txt", "other-run.ckpt", "model.safetensors"}, names
    assert all(_contents(export)[k] == v for k, v in kept.items())
    assert not list(tmp_path.glob(".hf-export.tmp-*"))


def test_lora_exports_write_their_files_and_leave_the_others(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from lightning_fsdp2.lora import save_adapter, save_merged
    from tests.models import tiny_llama_config

    torch.manual_seed(0)
    model = build_llama(lora=True)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)  # non-zero adapters, so the merge changes the logits
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    kept = {d: _foreign_directory(d) for d in (adapter_dir, merged_dir)}
    (adapter_dir / "README.md").write_text("# My adapter\n\nnotes that must survive\n")
    (merged_dir / "model-00001-of-00003.safetensors").write_bytes(b"stale shard of an earlier export")
    (merged_dir / "pytorch_model.bin").write_bytes(b"another format: left alone")
    save_adapter(model, adapter_dir)
    save_merged(model, merged_dir)

    for directory, files in kept.items():
        assert all(_contents(directory)[k] == v for k, v in files.items()), directory
    assert "notes that must survive" in (adapter_dir / "README.md").read_text()
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in adapter_dir.iterdir()}
    assert not (merged_dir / "model-00001-of-00003.safetensors").exists(), "a stale shard of the same format goes"
    assert (merged_dir / "pytorch_model.bin").read_bytes() == b"another format: left alone"
    expected = probe_logits(model)
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())  # the same base weights: build_llama builds it first
    assert torch.allclose(probe_logits(PeftModel.from_pretrained(base, adapter_dir)), expected, atol=1e-5)
    assert torch.allclose(probe_logits(LlamaForCausalLM.from_pretrained(merged_dir)), expected, atol=1e-4)

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointFileError, match="a-file.*not a directory"):
        save_adapter(model, tmp_path / "a-file")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# =========================================================================== nothing partial left behind
def test_a_successful_save_removes_leftovers_of_interrupted_saves_of_that_path(pretrained: Path, tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    leftovers = [tmp_path / ".last.ckpt.tmp-deadbeef", tmp_path / ".last.ckpt.old-cafecafe"]
    leftovers[0].write_bytes(b"half a file")
    leftovers[1].mkdir()
    (leftovers[1] / "meta.pt").write_bytes(b"x")
    other = tmp_path / ".other.ckpt.tmp-12345678"
    other.write_bytes(b"another path's")
    assert run_distributed(_save_over, 2, str(pretrained), [str(path)], "sharded")[0] == ["saved"]
    assert not any(p.exists() for p in leftovers) and other.exists()


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MB tmpfs (Linux, root): a disk that really fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _save_until_the_disk_is_full(pretrained: str, path: str, fmt: str) -> dict:
    """Save a checkpoint, fill the disk up to a little less than another one needs, save again, free it, save."""
    import lightning as L
    import torch.distributed as dist

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import ResumeModule, quiet_trainer_kwargs

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(state_dict_type=fmt), max_steps=1,
        limit_val_batches=0, num_sanity_val_steps=0, **quiet_trainer_kwargs(),
    )
    trainer.fit(ResumeModule(pretrained))
    trainer.save_checkpoint(path)
    ballast = Path(path).parent / "ballast"
    if dist.get_rank() == 0:
        import shutil

        free = shutil.disk_usage(ballast.parent).free
        ballast.write_bytes(b"\0" * max(free - 64 * 1024, 0))
    dist.barrier()
    try:
        trainer.save_checkpoint(path)
        error = "no error"
    except CheckpointFileError as err:
        error = str(err)
    leftovers = sorted(p.name for p in Path(path).parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)
    dist.barrier()
    if dist.get_rank() == 0:
        ballast.unlink()
    dist.barrier()
    trainer.save_checkpoint(path)
    return {"error": error, "leftovers": leftovers}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_full_disk_is_named_on_every_rank_and_leaves_the_previous_checkpoint(
    fmt: str, pretrained: Path, small_disk: Path
) -> None:
    path = small_disk / "last.ckpt"
    results = run_distributed(_save_until_the_disk_is_full, 2, str(pretrained), str(path), fmt)
    for rank, result in enumerate(results):
        assert "No space left on device" in result["error"] and str(path) in result["error"], (rank, result["error"])
        assert result["leftovers"] == [], "the failed save removed its partial output"
    assert results[0]["error"] == results[1]["error"]
    assert read_full_checkpoint(path)["global_step"] == 1, "the save after freeing space worked"


def test_a_sharded_checkpoint_without_meta_is_called_incomplete(saved: dict, tmp_path: Path) -> None:
    import shutil

    from lightning_fsdp2.checkpoint.formats import read_sharded_meta

    broken = tmp_path / "broken.ckpt"
    shutil.copytree(saved["sharded"], broken)
    (broken / "meta.pt").unlink()
    with pytest.raises(CheckpointFileError, match=r"broken\.ckpt is incomplete.*meta\.pt"):
        read_sharded_meta(broken)


# =========================================================================== the streamed full file
def test_streamed_file_is_what_torch_save_writes(tmp_path: Path) -> None:
    """Without sharding the streamer writes the structure as torch.save would: same values, dtypes, shared storages,
    views, 0-d and empty tensors; readable with weights_only and mmap."""
    base = torch.arange(12.0).reshape(3, 4)
    obj = {
        "state_dict": {
            "w": base, "w_view": base[1:], "bf16": torch.ones(3, dtype=torch.bfloat16), "empty": torch.empty(0, 5),
            "fp8": torch.ones(4).to(torch.float8_e4m3fn), "u16": torch.tensor([1, 2, 60000], dtype=torch.uint16),
        },
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": base.t()}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "epoch": 2, "callbacks": {"x": {"best": torch.tensor(1.5)}}, "hyper_parameters": {"name": "run", "tuple": (1, 2)},
    }
    save_streamed(obj, tmp_path / "ours.ckpt")
    torch.save(obj, tmp_path / "torch.ckpt")
    ours = torch.load(tmp_path / "ours.ckpt", weights_only=True, mmap=True)
    theirs = torch.load(tmp_path / "torch.ckpt", weights_only=True)
    assert ours.keys() == theirs.keys() and ours["hyper_parameters"] == theirs["hyper_parameters"]
    flat = lambda d: torch.utils._pytree.tree_flatten(d)[0]  # noqa: E731
    for a, b in zip(flat(ours), flat(theirs)):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        else:
            assert a == b
    sd = ours["state_dict"]
    assert sd["w_view"].untyped_storage().data_ptr() == sd["w"].untyped_storage().data_ptr(), "views share storage"
    assert not list(tmp_path.glob(".*tmp*"))


def _stream_uneven(path: str) -> dict:
    """World size 3: rows split 2/2/1 and 1/1/0; the streamed full file holds the whole tensors, rank 0 alone writes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=init_device_mesh("cpu", (3,)))
    save_streamed({"state_dict": model.state_dict(), "epoch": 1}, path)
    dist.destroy_process_group()
    return expected


def test_streamed_file_gathers_uneven_shards(tmp_path: Path) -> None:
    expected = run_distributed(_stream_uneven, 3, str(tmp_path / "full.ckpt"))[0]
    loaded = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert loaded["epoch"] == 1 and loaded["state_dict"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded["state_dict"][key], value), key
        assert loaded["state_dict"][key].untyped_storage().nbytes() == value.numel() * 4, "no padding rows saved"


# =========================================================================== asynchronous sharded saves
def _async_save_is_a_snapshot(pretrained: str, path: str) -> dict:
    """At the end of the first epoch, start an async save and change every weight while it is written: the
    directory holds the values from the moment of the save."""
    import lightning as L

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import ResumeModule, full_state, quiet_trainer_kwargs

    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    seen: dict = {}
    # DCP's writer waits (at most 60 s) until the weights have changed: a save_checkpoint that returned only after
    # writing (not in the background) would find the write already done, and the test says so.
    release, wrote = threading.Event(), threading.Event()
    write_data = FileSystemWriter.write_data

    def gated(self, *args, **kwargs):
        release.wait(timeout=60)
        wrote.set()
        return write_data(self, *args, **kwargs)

    FileSystemWriter.write_data = gated  # this child process only

    class SaveThenChange(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            seen["at_save"] = full_state(pl_module)
            trainer.save_checkpoint(path)
            seen["was_pending"] = not wrote.is_set()  # returned while the background write had not started writing
            with torch.no_grad():
                for param in pl_module.parameters():
                    param.add_(1.0)
            release.set()

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(state_dict_type="sharded", async_save=True),
        max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[SaveThenChange()],
        **quiet_trainer_kwargs(),
    )
    trainer.fit(ResumeModule(pretrained))  # ends by waiting for the save
    return seen


def test_async_save_writes_the_state_at_the_moment_of_the_save(pretrained: Path, tmp_path: Path) -> None:
    result = run_distributed(_async_save_is_a_snapshot, 2, str(pretrained), str(tmp_path / "async.ckpt"))[0]
    assert result["was_pending"], "save_checkpoint returned with the write still in the background"
    saved = read_full_checkpoint(tmp_path / "async.ckpt")["state_dict"]
    assert saved.keys() == result["at_save"].keys()
    for key, value in result["at_save"].items():
        assert torch.equal(saved[key], value), key


def test_async_save_needs_sharded_checkpoints() -> None:
    from lightning_fsdp2 import FSDP2Strategy

    with pytest.raises(ValueError, match="state_dict_type='sharded'"):
        FSDP2Strategy(async_save=True)


def _rank0_fails_halfway(path: str) -> dict:
    """Rank 0 cannot take the second tensor (as if out of memory): it keeps receiving the rest, every rank raises,
    nothing is left behind and the live weights are untouched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_fsdp2.checkpoint import stream

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    real_add, calls = stream._Writer.add, [0]

    def add_or_fail(self, whole):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("no memory for this tensor")
        return real_add(self, whole)

    stream._Writer.add = add_or_fail
    try:
        save_streamed({"state_dict": model.state_dict()}, path)
        message = "no error"
    except (CheckpointFileError, MemoryError) as err:
        message = f"{type(err).__name__}: {err}"
    unchanged = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    dist.destroy_process_group()
    return {"message": message, "unchanged": unchanged}


def test_a_rank0_failure_while_streaming_is_raised_everywhere_without_a_hang(tmp_path: Path) -> None:
    results = run_distributed(_rank0_fails_halfway, 2, str(tmp_path / "full.ckpt"), timeout=120)
    assert results[0]["message"] == "MemoryError: no memory for this tensor"
    assert results[1]["message"].startswith("CheckpointFileError: Rank 0 failed to write the checkpoint")
    assert all(r["unchanged"] for r in results)
    assert list(tmp_path.iterdir()) == []


# =========================================================================== a directory per rank
def _save_per_rank(pretrained: str, base: str, async_save: bool, reports_its_world: bool) -> dict:
    """During the epoch, save to one path, then twice to a path of each rank's own (as Ray Train's report callback
    does, which reads the directory as soon as the save returns), then to a per-rank path that is someone else's
    directory on rank 1. ``reports_its_world``: under a cluster environment like Ray's (it started the processes and
    reports their world itself; here the test helper started them), else a plain launch."""
    import lightning as L
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_fsdp2 import FSDP2Strategy
    from tests.models import ResumeModule, quiet_trainer_kwargs

    class ReportsItsOwnWorld(LightningEnvironment):  # what Ray's RayLightningEnvironment does, from the environment
        creates_processes_externally = True

        def world_size(self) -> int:
            return int(os.environ["WORLD_SIZE"])

        def global_rank(self) -> int:
            return int(os.environ["RANK"])

        def set_world_size(self, size: int) -> None:
            pass

        def set_global_rank(self, rank: int) -> None:
            pass

    seen: dict = {}

    class SaveAround(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            rank = trainer.global_rank
            trainer.save_checkpoint(f"{base}/one.ckpt")
            own = Path(f"{base}/rank{rank}/own.ckpt")
            for attempt in ("first", "again"):
                trainer.save_checkpoint(own)
                seen[attempt] = sorted(p.name for p in own.iterdir()) if own.is_dir() else None  # at once, as Ray
            foreign = Path(f"{base}/rank{rank}/theirs")
            if rank == 1:
                _foreign_directory(foreign)
            try:
                trainer.save_checkpoint(foreign)
                seen["foreign"] = "saved"
            except CheckpointFileError as err:
                seen["foreign"] = str(err)

    trainer = L.Trainer(
        accelerator="cpu", devices=1 if reports_its_world else 2,
        plugins=[ReportsItsOwnWorld()] if reports_its_world else [],
        strategy=FSDP2Strategy(state_dict_type="sharded", async_save=async_save), max_epochs=1,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[SaveAround()], **quiet_trainer_kwargs(),
    )
    trainer.fit(ResumeModule(pretrained))
    return seen


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_under_an_environment_like_rays_each_rank_writes_its_shards_to_its_own_path(
    async_save: bool, pretrained: Path, tmp_path: Path
) -> None:
    """Each rank writes its own shards where it was told (rank 0 the index and meta.pt too), complete when the save
    returns (with async_save too: Ray's callback reports and deletes the directory at once), replacing its own part
    of an earlier save; merged, the directories are the checkpoint one path gets. A rank's directory alone is named
    incomplete. A foreign directory on one rank is refused on every rank, and nothing is left on the others."""
    import shutil

    seen = run_distributed(_save_per_rank, 2, str(pretrained), str(tmp_path), async_save, True)
    assert {".metadata", "meta.pt"} < set(seen[0]["first"]) and seen[0]["first"] == seen[0]["again"]
    assert all(n.startswith("__0_") for n in set(seen[0]["first"]) - {".metadata", "meta.pt"})
    assert seen[1]["first"] and all(n.startswith("__1_") for n in seen[1]["first"]) and seen[1]["again"] == \
        seen[1]["first"], seen[1]
    assert seen[0]["foreign"] == seen[1]["foreign"] and "Refusing to save to" in seen[0]["foreign"], seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.ckpt", "rank0", "rank1"]  # no temporary left
    assert [p.name for p in (tmp_path / "rank0").iterdir()] == ["own.ckpt"]  # nor rank 0's half of the refused save
    own = [tmp_path / f"rank{r}" / "own.ckpt" for r in range(2)]
    with pytest.raises(CheckpointFileError, match="__1_0.distcp"):
        read_full_checkpoint(own[0])
    for file in own[1].iterdir():  # what Ray Train does with the directories its workers report
        shutil.copy(file, own[0] / file.name)
    merged, one = read_full_checkpoint(own[0]), read_full_checkpoint(tmp_path / "one.ckpt")
    assert merged["global_step"] == one["global_step"] > 0
    assert merged["state_dict"].keys() == one["state_dict"].keys()
    for key, value in one["state_dict"].items():
        assert torch.equal(merged["state_dict"][key], value), key


def test_elsewhere_every_rank_writes_to_rank_0s_path(pretrained: Path, tmp_path: Path) -> None:
    """As Lightning's strategies do (ranks may build a file name from a metric logged without sync_dist): one whole
    checkpoint at rank 0's path, nothing at the others'."""
    run_distributed(_save_per_rank, 2, str(pretrained), str(tmp_path), False, False)
    assert not (tmp_path / "rank1" / "own.ckpt").exists()
    assert read_full_checkpoint(tmp_path / "rank0" / "own.ckpt")["global_step"] > 0
