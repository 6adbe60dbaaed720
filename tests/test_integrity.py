"""Checkpoints prove their integrity: a flipped bit in a full or sharded checkpoint, an exported adapter or the
converter's Hugging Face files is named (file, tensor, rank) on every rank before anything is loaded; the options turn
the check off; files without checksums load as before."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fsdp2 import CheckpointFileError, FSDP2Strategy, load_pretrained
from lightning_fsdp2.checkpoint import integrity
from lightning_fsdp2.checkpoint.safe_dcp import read_dcp_metadata
from lightning_fsdp2.convert import main as convert_main
from lightning_fsdp2.convert import read_full_checkpoint
from tests.helpers import run_distributed
from tests.integration.test_resume import _resume_expecting_error
from tests.models import probe_logits, quiet_trainer_kwargs, tiny_llama_config
from tests.test_lora import FromAdapter


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x10
    file.write_bytes(bytes(data))


def _data_offset(file: Path, info: zipfile.ZipInfo) -> int:
    """Where a zip record's bytes start: after its local header (whose extra field torch pads for alignment)."""
    with open(file, "rb") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_length + extra_length


def _damaged_full(saved: dict, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the full checkpoint with one bit flipped in the middle of its largest tensor record."""
    copy = tmp_path / "flipped.ckpt"
    shutil.copy(saved["full"], copy)
    with zipfile.ZipFile(copy) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    _flip(copy, _data_offset(copy, info) + info.file_size // 2)
    return copy, info.filename


def _damaged_sharded(saved: dict, tmp_path: Path) -> tuple[Path, str, str]:
    """A copy of the sharded checkpoint with one bit flipped in the middle of its largest model tensor."""
    copy = tmp_path / "flipped-sharded.ckpt"
    shutil.copytree(saved["sharded"], copy)
    items = [(index.fqn, info) for index, info in read_dcp_metadata(copy).storage_data.items()
             if index.fqn.startswith("state_dict.")]
    fqn, info = max(items, key=lambda item: item[1].length)
    _flip(copy / info.relative_path, info.offset + info.length // 2)
    return copy, info.relative_path, fqn


def test_a_flipped_bit_in_a_full_checkpoint_is_named_on_every_rank(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    copy, record = _damaged_full(saved, tmp_path)
    messages = run_distributed(_resume_expecting_error, 2, str(pretrained), str(copy), {})
    assert messages[0] == messages[1], "every rank raises the same error"
    message = messages[0]
    assert message.startswith(f"CheckpointFileError: The checkpoint {copy} is damaged"), message
    assert f"record {record!r} (tensor 'state_dict." in message, message
    assert "(found by rank " in message and "Nothing was loaded" in message, message
    # Turned off, the same file loads (and trains on from the flipped value): the check is what caught it.
    assert run_distributed(_resume_expecting_error, 2, str(pretrained), str(copy), {}, {"verify_checkpoints": False}) == ["no error"] * 2
    # The converter and read_full_checkpoint check too, and can be told not to.
    with pytest.raises(CheckpointFileError, match="is damaged"):
        read_full_checkpoint(copy)
    assert "state_dict" in read_full_checkpoint(copy, verify=False)


def test_a_flipped_bit_in_a_shard_is_named_with_its_tensor(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    integrity.verify(saved["sharded"], together=False)  # the intact one passes
    copy, file, fqn = _damaged_sharded(saved, tmp_path)
    messages = run_distributed(_resume_expecting_error, 2, str(pretrained), str(copy), {}, {"state_dict_type": "sharded"})
    assert messages[0] == messages[1], "every rank raises the same error"
    assert f"CheckpointFileError: The checkpoint {copy} is damaged" in messages[0], messages[0]
    assert f"file {file!r}, tensor {fqn!r} (found by rank " in messages[0], messages[0]
    with pytest.raises(SystemExit):  # the converter refuses it, naming it; --no-verify converts it anyway
        convert_main([str(copy), str(tmp_path / "out.ckpt")])
    convert_main([str(copy), str(tmp_path / "out.ckpt"), "--no-verify"])
    assert (tmp_path / "out.ckpt").is_file()


def test_checkpoints_without_checksums_load_as_before(saved: dict, tmp_path: Path) -> None:
    """A torch.save file written without CRC-32s (compute_crc32 off) is read without a check, flipped bit and all;
    an intact full checkpoint passes it; a flipped bit in a sharded checkpoint's meta.pt is found too."""
    from torch.utils.serialization import config

    integrity.verify(saved["full"], together=False)
    config.save.compute_crc32 = False
    try:
        torch.save({"weight": torch.arange(1000.0)}, tmp_path / "theirs.pt")
    finally:
        config.save.compute_crc32 = True
    with zipfile.ZipFile(tmp_path / "theirs.pt") as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
    _flip(tmp_path / "theirs.pt", _data_offset(tmp_path / "theirs.pt", info) + info.file_size // 2)
    integrity.verify(tmp_path / "theirs.pt", together=False)  # nothing to compare against: as before
    copy = tmp_path / "meta-flipped.ckpt"
    shutil.copytree(saved["sharded"], copy)
    with zipfile.ZipFile(copy / "meta.pt") as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    _flip(copy / "meta.pt", _data_offset(copy / "meta.pt", info) + info.file_size // 2)
    with pytest.raises(CheckpointFileError, match=r"meta\.pt: record .*data\.pkl"):
        integrity.verify(copy, together=False)


@pytest.mark.parametrize("small", [100, 64 << 10], ids=["pieces-on-threads", "pieces-inline"])
def test_a_record_of_many_chunks_is_verified_piece_by_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            small: int) -> None:
    """Verification reads a record in pieces whose CRC-32s it combines: with pieces of 1000 bytes (a 40 KB tensor in
    41 pieces, the last a partial one), computed on threads or by the reading thread, the intact file passes and a bit
    flipped in the first, a middle or the last byte is named; a file cut short is named, not read past its end, and a
    length claimed far beyond the file's is named without reading or cutting it up; an empty tensor passes."""
    import re

    from safetensors.torch import save_file

    monkeypatch.setattr(integrity, "CHUNK", 1000)
    monkeypatch.setattr(integrity, "SMALL", small)
    torch.save({"w": torch.arange(10_000.0), "b": torch.ones(3)}, tmp_path / "intact.pt")
    integrity.verify(tmp_path / "intact.pt", together=False)
    with zipfile.ZipFile(tmp_path / "intact.pt") as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    assert info.file_size == 40_000
    for at in (0, info.file_size // 2, info.file_size - 1):
        copy = tmp_path / f"flipped-{at}.pt"
        shutil.copy(tmp_path / "intact.pt", copy)
        _flip(copy, _data_offset(copy, info) + at)
        with pytest.raises(CheckpointFileError, match=re.escape(f"record {info.filename!r} (tensor 'w')")):
            integrity.verify(copy, together=False)

    tensors = {"w": torch.arange(10_000.0)}
    save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "pt", **integrity.checksum_metadata(tensors)})
    integrity.verify_safetensors([tmp_path / "a.safetensors"], together=False, turn_off="")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "a.safetensors").read_bytes()[:-100])
    with pytest.raises(CheckpointFileError, match=re.escape("cut.safetensors: tensor 'w' (the file ends before it)")):
        integrity.verify_safetensors([tmp_path / "cut.safetensors"], together=False, turn_off="")
    # A damaged header claiming a petabyte: named at once (cutting it into pieces first took minutes and GBs).
    data = (tmp_path / "a.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = data[8:8 + size].decode().replace('"data_offsets":[0,40000]', '"data_offsets":[0,1000000000000000]')
    (tmp_path / "huge.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode() + data[8 + size:])
    with pytest.raises(CheckpointFileError, match=re.escape("huge.safetensors: tensor 'w' (the file ends before it)")):
        integrity.verify_safetensors([tmp_path / "huge.safetensors"], together=False, turn_off="")
    empty = {"e": torch.empty(0)}
    save_file(empty, tmp_path / "e.safetensors", metadata={"format": "pt", **integrity.checksum_metadata(empty)})
    integrity.verify_safetensors([tmp_path / "e.safetensors"], together=False, turn_off="")


def test_combined_crc32s_equal_zlibs_of_the_whole() -> None:
    """The chunks' CRC-32s combined (zlib's crc32_combine, which Python's zlib lacks) equal zlib's CRC-32 of the
    whole, for lengths from 0 up to a few chunks, including odd ones."""
    import random
    import zlib

    rng = random.Random(0)
    for length_a, length_b in [(0, 0), (0, 5), (5, 0), (1, 1), (3, 4096), (4096, 3)] + [
            (rng.randrange(70_000), rng.randrange(70_000)) for _ in range(30)]:
        a, b = rng.randbytes(length_a), rng.randbytes(length_b)
        assert integrity._combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (length_a, length_b)


# ------------------------------------------------------------------------------------------------ safetensors exports
def _flip_tensor(file: Path, name: str | None = None) -> str:
    """Flip one bit in the middle of tensor ``name`` (default: the largest) of a safetensors file; its name."""
    import json

    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    name = name or max(tensors, key=lambda k: tensors[k]["data_offsets"][1] - tensors[k]["data_offsets"][0])
    begin, end = tensors[name]["data_offsets"]
    _flip(file, 8 + size + (begin + end) // 2)
    return name


def _load_adapter_expecting_error(pretrained: str, adapter: str, verify: bool) -> str:
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), **quiet_trainer_kwargs())
    try:
        trainer.validate(FromAdapter(pretrained, adapter, verify), verbose=False)
    except CheckpointFileError as err:
        return f"CheckpointFileError: {err}"
    return "no error"


def test_a_flipped_bit_in_an_exported_adapter_is_named_on_every_rank(pretrained: Path, tmp_path: Path) -> None:
    """save_adapter records each tensor's CRC-32 in the safetensors header (peft still reads the file); a bit flipped
    in it afterwards fails load_adapter on both ranks of a sharded run, naming file and tensor, before anything is
    read; verify=False loads it; an adapter peft wrote itself (no checksums) loads as before."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_fsdp2.lora import save_adapter

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(pretrained),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    save_adapter(model, tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        assert integrity.CRC_KEY in f.metadata() and f.metadata()["format"] == "pt"
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), tmp_path / "adapter")
    assert torch.allclose(probe_logits(reloaded), probe_logits(model))
    model.save_pretrained(tmp_path / "peft-own")  # peft's own writer: no checksums
    _flip_tensor(tmp_path / "peft-own" / "adapter_model.safetensors")
    integrity.verify_safetensors([tmp_path / "peft-own" / "adapter_model.safetensors"], together=False, turn_off="")

    integrity.verify_safetensors([file], together=False, turn_off="")  # intact: passes
    flipped = _flip_tensor(file)
    messages = run_distributed(_load_adapter_expecting_error, 2, str(pretrained), str(tmp_path / "adapter"), True)
    assert messages[0] == messages[1], "every rank raises the same error"
    assert messages[0].startswith(f"CheckpointFileError: The weights file {file} is damaged"), messages[0]
    assert f"adapter_model.safetensors: tensor {flipped!r} (found by rank " in messages[0], messages[0]
    assert "verify=False" in messages[0], messages[0]
    assert run_distributed(_load_adapter_expecting_error, 2, str(pretrained), str(tmp_path / "adapter"), False) == [
        "no error"] * 2


def test_a_flipped_bit_in_the_converters_hf_output_is_named(saved: dict, tmp_path: Path) -> None:
    """The converter's Hugging Face files carry each tensor's CRC-32 (from_pretrained reads them as before);
    load_pretrained verifies them: a flipped bit is named; verify=False loads the damaged value."""
    from transformers import LlamaForCausalLM

    from lightning_fsdp2.convert import to_hf_safetensors

    out = to_hf_safetensors(saved["full"], tmp_path / "hf", config_from=None)
    (out / "config.json").write_text(tiny_llama_config().to_json_string())
    # Copied out: from_pretrained's tensors may stay mapped to the file, which is damaged below.
    intact = {k: v.clone() for k, v in LlamaForCausalLM.from_pretrained(out).state_dict().items()}
    loaded = LlamaForCausalLM(tiny_llama_config())
    load_pretrained(loaded, out)
    assert all(torch.equal(v, intact[k]) for k, v in loaded.state_dict().items())

    file = out / "model.safetensors"
    flipped = _flip_tensor(file)
    with pytest.raises(CheckpointFileError, match=rf"model\.safetensors: tensor {flipped!r} \(found by rank 0\).*"
                       r"Nothing was loaded.*verify=False"):
        load_pretrained(LlamaForCausalLM(tiny_llama_config()), out)
    anyway = LlamaForCausalLM(tiny_llama_config())
    load_pretrained(anyway, out, verify=False)
    assert not torch.equal(anyway.state_dict()[flipped], intact[flipped])

    # Split into several files, huggingface_hub writes the given metadata in the index, not the headers: verified
    # from there.
    split = to_hf_safetensors(saved["full"], tmp_path / "hf-split", max_shard_size="40KB")
    files = sorted(split.glob("*.safetensors"))
    assert len(files) > 2 and (split / "model.safetensors.index.json").is_file()
    (split / "config.json").write_text(tiny_llama_config().to_json_string())
    load_pretrained(LlamaForCausalLM(tiny_llama_config()), split)
    flipped = _flip_tensor(files[1])
    with pytest.raises(CheckpointFileError, match=rf"The weights in {split} is damaged.*{files[1].name}: tensor"
                       rf" {flipped!r} \(found by rank 0\)"):
        load_pretrained(LlamaForCausalLM(tiny_llama_config()), split)

    # A file written without metadata (add_checksums adds peft's files' checksums) keeps a format transformers reads.
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, tmp_path / "bare.safetensors")
    integrity.add_checksums(tmp_path / "bare.safetensors")
    with safe_open(str(tmp_path / "bare.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt" and integrity.CRC_KEY in f.metadata()


# ------------------------------------------------------------------------------------------------ the index, the names
def _copy_with_flip(src: Path, dst: Path, file: str, offset: int) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    _flip(dst / file if file else dst, offset)
    return dst


def test_a_flipped_byte_in_the_sharded_index_is_named_before_it_is_read(pretrained: Path, saved: dict,
                                                                        tmp_path: Path) -> None:
    """DCP's index (.metadata) is a raw pickle with no checksum: the strategy appends the CRC-32 of its bytes (torch's
    reader stops at the pickle's end). A byte flipped in its save id (which no load reads: with the check off the run
    resumes without a word) fails the resume on every rank naming .metadata; so does a damaged checksum. The intact
    checkpoint resumes."""
    from torch.distributed.checkpoint import FileSystemReader

    data = (saved["sharded"] / ".metadata").read_bytes()
    assert integrity.INDEX_CHECKSUM in data[-40:]
    FileSystemReader(saved["sharded"]).read_metadata()  # torch's own reader reads it as before
    at = data.index(read_dcp_metadata(saved["sharded"]).storage_meta.save_id.encode()) + 3
    copy = _copy_with_flip(saved["sharded"], tmp_path / "index-flipped.ckpt", ".metadata", at)
    runs = [run_distributed(_resume_expecting_error, 2, str(pretrained), str(path), {},
                            {"state_dict_type": "sharded", "verify_checkpoints": verify})
            for path, verify in ((copy, True), (copy, False), (saved["sharded"], True))]
    assert runs[0][0] == runs[0][1], "every rank raises the same error"
    assert f"CheckpointFileError: The checkpoint {copy} is damaged" in runs[0][0], runs[0][0]
    assert ".metadata: the checkpoint's index does not match the CRC-32 written with it (found by rank 0)" in runs[0][0]
    assert runs[1] == runs[2] == ["no error"] * 2  # the check was what caught it; the intact one resumes
    copy = _copy_with_flip(saved["sharded"], tmp_path / "checksum-flipped.ckpt", ".metadata", len(data) - 4)
    with pytest.raises(CheckpointFileError, match=r"\.metadata: the checkpoint's index ends in bytes that are neither"):
        integrity.verify(copy, together=False)


def test_a_flipped_byte_in_a_record_name_is_named(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    """torch's reader looks an archive's records up by the names in its zip directory, zipfile by those of their local
    headers: a byte flipped in either copy of a name ('byteorder': torch assumes the machine's without it) is named,
    file and tensor, in a shard (on every rank of a resume) and in a full checkpoint."""
    items = [(index.fqn, info) for index, info in read_dcp_metadata(saved["sharded"]).storage_data.items()
             if index.fqn.startswith("state_dict.")]
    fqn, info = max(items, key=lambda item: item[1].length)
    item = (saved["sharded"] / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    name = b"/byteorder"
    places = [i for i in range(len(item)) if item.startswith(name, i)]
    assert len(places) == 2  # its local header, then the directory at the archive's end
    for copy_of, at in zip(("local header", "zip directory"), places):
        copy = _copy_with_flip(saved["sharded"], tmp_path / copy_of.replace(" ", "-"), info.relative_path,
                               info.offset + at + len(name) - 1)
        with pytest.raises(CheckpointFileError, match=rf"file {info.relative_path!r}, tensor {fqn!r} \(record name"
                           r" 'archive/byteorde.' in the zip directory, 'archive/byteorde.' in its local header\)"):
            integrity.verify(copy, together=False)
    messages = run_distributed(_resume_expecting_error, 2, str(pretrained), str(copy), {},
                               {"state_dict_type": "sharded"})
    assert messages[0] == messages[1] and f"file {info.relative_path!r}, tensor {fqn!r} (record name" in messages[0]
    full = saved["full"].read_bytes()
    copy = _copy_with_flip(saved["full"], tmp_path / "name-flipped.ckpt", "", full.rindex(name) + len(name) - 1)
    with pytest.raises(CheckpointFileError, match=r"name-flipped\.ckpt: record name '.*/byteorde.' in the zip direc"):
        integrity.verify(copy, together=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_index_and_names_cost_a_few_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index's checksum is 32 bytes more in a small file (one read of it to verify); an index DCP wrote itself
    (torch's own writer: no checksum) passes, and both load. A record's name is checked in the one read of its local
    header that finds where its data starts (30 + the name's bytes): nothing else is read for it. A non-tensor item
    (a torch.save archive too) is verified like a tensor's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    state = {"state_dict": {f"w{i}": torch.randn(64) for i in range(8)},
             "optimizer_0": {"param_groups": [{"lr": 0.1}]}}
    for name, writer in (("a", FileSystemWriter), ("b", integrity.IndexChecksumWriter)):
        dcp.save(state, storage_writer=writer(tmp_path / name), no_dist=True)
        integrity.verify(tmp_path / name, together=False)
        loaded = {"state_dict": {k: torch.zeros(64) for k in state["state_dict"]},
                  "optimizer_0": {"param_groups": [{"lr": 0.0}]}}
        dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / name), no_dist=True)
        assert all(torch.equal(v, state["state_dict"][k]) for k, v in loaded["state_dict"].items())
        assert loaded["optimizer_0"] == state["optimizer_0"]
    sizes = [(tmp_path / name / ".metadata").stat().st_size for name in "ab"]
    assert sizes[1] - sizes[0] == len(integrity.INDEX_CHECKSUM) + 9
    info = next(i for x, i in read_dcp_metadata(tmp_path / "b").storage_data.items() if x.fqn.startswith("optimizer"))
    shard = tmp_path / "b" / info.relative_path
    (tmp_path / "item.pt").write_bytes(shard.read_bytes()[info.offset:info.offset + info.length])
    with zipfile.ZipFile(tmp_path / "item.pt") as archive:
        pickled = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    _flip(shard, info.offset + _data_offset(tmp_path / "item.pt", pickled) + pickled.file_size // 2)
    with pytest.raises(CheckpointFileError, match=r"item 'optimizer_0\.param_groups\.0\.lr' \(found by rank 0\)"):
        integrity.verify(tmp_path / "b", together=False)

    torch.save(state["state_dict"], tmp_path / "full.pt")
    reads: list[tuple[int, int]] = []
    read = integrity._Files.read
    monkeypatch.setattr(integrity._Files, "read", lambda self, path, offset, length: (
        reads.append((offset, length)) or read(self, path, offset, length)))
    integrity.verify(tmp_path / "full.pt", together=False)
    with zipfile.ZipFile(tmp_path / "full.pt") as archive:
        assert sorted(reads) == sorted((i.header_offset, 30 + len(i.filename)) for i in archive.infolist())
