"""Every Python snippet of README.md and docs/*.md runs as written, or says why not.

A ```python block runs unless the line right above it is ``<!-- not run: REASON -->`` (a method shown alone, a
call that needs a checkpoint or a GPU, an argument list with ``...``). Snippets of one page build on each other as a
reader's script would. All of a page's snippets run in order in one process, each up to its first top-level
statement that starts processes (``.fit(``, ``.launch()``, ...); a snippet that starts processes runs whole as its
own script, after the page's earlier snippets (up to what they start), at the world size it names (with
``--runslow``, as CI runs them).

Classes a page defines are defined (and trained where a page's snippet trains them: the quickstart's and Fabric's
loops); a page's ``configure_model`` shown alone is not run.

Stand-ins, for what a snippet leaves to the user (``_standins`` below, imported before each page):
- the paths ``"path/to/hf-model"``, ``"path/to/llama"`` and ``model_dir``: a tiny Llama saved by ``save_pretrained``,
  with a word-level tokenizer; ``"train.txt"`` (``text_file``): a text file of its words;
- ``model``: ``tests.models.LlamaModule`` (a LightningModule that builds its network in ``configure_model``),
  stopping after two steps;
- ``dataset``: token-id sequences of that model's vocabulary;
- ``accelerator="cuda"`` runs as ``"cpu"``, ``devices=8`` as ``devices=2`` where the snippet starts processes, and
  ``max_steps=1000`` as ``max_steps=2``.
docs/api.md is left out: its blocks are signatures generated from the code (tests/test_docs.py checks them).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "api.md")
_BLOCK = re.compile(r"(?P<mark><!-- not run:(?P<reason>[^>]*)-->\n)?(?P<indent>[ \t]*)```python\n(?P<code>.*?)(?P=indent)```",
                    re.S)
_LAUNCHES = {"fit", "launch", "validate", "test", "predict"}
_SUBSTITUTE = {'"path/to/hf-model"': "model_dir", '"path/to/llama"': "model_dir", '"train.txt"': "text_file",
               'accelerator="cuda"': 'accelerator="cpu"', "max_steps=1000": "max_steps=2"}
_IN_LAUNCHES = {"devices=8": "devices=2"}

_STANDINS = '''
"""What the docs' snippets leave to the user, at tiny sizes (tests/test_doc_snippets.py)."""
__all__ = ["dataset", "model", "model_dir", "text_file"]  # nothing else: a snippet's missing import must fail

import os
from pathlib import Path

import torch

from tests.models import LlamaModule, save_tiny_pretrained

_here = Path(os.environ["SNIPPET_STANDINS"])
model_dir = str(_here / "tiny-llama")
text_file = str(_here / "train.txt")
_words = [f"w{i}" for i in range(100)]
if not Path(text_file).exists():  # made once, by the test (the processes a snippet launches only read it)
    Path(text_file).write_text(" ".join(_words[(i * 7) % 100] for i in range(8 * 512 + 8)))
    save_tiny_pretrained(model_dir, max_position_embeddings=512)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + _words)}, unk_token="[UNK]"))
    _tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=_tok, unk_token="[UNK]").save_pretrained(model_dir)


class _TwoSteps(LlamaModule):
    """Stops the fit after two steps (a snippet's Trainer may set no limit: Lightning's default is 1000 epochs)."""

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.trainer.should_stop = self.trainer.global_step >= 2


model = _TwoSteps()
dataset = [torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(i)) for i in range(16)]
'''


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    code: str
    reason: str | None  # why it is not run, or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def launches(self) -> bool:
        return self.before_launch != self.code

    @property
    def before_launch(self) -> str:
        """The snippet up to its first top-level statement (not a def or class) that calls .fit(...), .launch(),
        ...: what a later snippet of the page can build on without starting processes."""
        lines = self.code.splitlines(keepends=True)
        for node in ast.parse(self.code).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _LAUNCHES:
                    return "".join(lines[: node.lineno - 1])
        return self.code


def snippets(page: Path) -> list[Snippet]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _BLOCK.finditer(text):
        code = textwrap.dedent(match["code"])
        line = text[: match.start("indent")].count("\n") + 1
        reason = match["reason"].strip() if match["mark"] else None
        for old, new in _SUBSTITUTE.items():
            code = code.replace(old, new)
        found.append(Snippet(page, line, code, reason))
    return found


ALL = [s for page in PAGES for s in snippets(page)]
LAUNCHING = [s for s in ALL if s.reason is None and s.launches]



def _script(snippet: Snippet | None, page: Path) -> str:
    """The page's earlier snippets up to what starts processes (all the page's snippets so, for None), then
    ``snippet`` whole; each introduced by a comment naming its place, so a traceback says which one failed."""
    parts = ["from _standins import *  # noqa: F403"]
    for other in snippets(page):
        if other == snippet:
            break
        if other.reason is None:
            parts.append(f"# ---- {other.where}\n{other.before_launch}")
    if snippet is not None:
        parts.append(f"# ---- {snippet.where}\n{snippet.code}")
    script = "\n".join(parts) + "\n"
    if snippet is not None:  # it starts processes: as many as this machine runs
        for old, new in _IN_LAUNCHES.items():
            script = script.replace(old, new)
    return script


@pytest.fixture(scope="module")
def standins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-ins' module, and the tiny model and text it makes, in a directory of their own."""
    where = tmp_path_factory.mktemp("standins")
    (where / "_standins.py").write_text(_STANDINS, encoding="utf-8")
    _run("import _standins\n", where, where / "make_standins.py")
    return where


def _run(code: str, standins: Path, script: Path, timeout: int = 300) -> None:
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, SNIPPET_STANDINS=str(standins),
               PYTHONPATH=os.pathsep.join([str(standins), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=script.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{script.name} failed:\n{code}\n--- stderr:\n{proc.stderr[-4000:]}"


def test_every_snippet_runs_or_says_why_not() -> None:
    """Each block is Python (parses) and a block that is not run gives its reason."""
    assert len(ALL) > 40
    for page in PAGES:  # no Python block is missed by the pattern (another fence spelling, text after `python`)
        fences = re.findall(r"(?m)^[ \t]*```(py\S*)", page.read_text(encoding="utf-8"))
        assert len(fences) == len(snippets(page)), (page, fences)
    for snippet in ALL:
        if snippet.reason is not None:
            assert snippet.reason, f"{snippet.where}: `<!-- not run: -->` needs a reason"
        else:
            ast.parse(snippet.code)  # a SyntaxError names the snippet through pytest's report


@pytest.mark.parametrize("page", [p for p in PAGES if any(s.reason is None for s in snippets(p))], ids=lambda p: p.name)
def test_snippets_up_to_what_starts_processes_run(
    page: Path, standins: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's snippets in order, each up to its first statement that starts processes: in this process (they
    start nothing), in a namespace of their own, in a directory of their own; a traceback names the snippet."""
    monkeypatch.setenv("SNIPPET_STANDINS", str(standins))
    monkeypatch.syspath_prepend(str(standins))
    monkeypatch.chdir(tmp_path)
    import _standins  # noqa: F401  (the module the scripts import too)

    namespace: dict = {"__name__": f"snippets_of_{page.stem}"}
    exec("from _standins import *", namespace)  # noqa: S102 - our own stand-ins
    for snippet in snippets(page):
        if snippet.reason is None:
            exec(compile(snippet.before_launch, snippet.where, "exec"), namespace)  # noqa: S102 - the docs' code


# About 20 s each (two processes that import torch, Lightning and transformers, then train): with --runslow (CI's
# `.ci/run`), to keep `make test` within its time; what comes before their launch runs in every `make test` above.
@pytest.mark.slow
@pytest.mark.parametrize("snippet", LAUNCHING, ids=lambda s: s.where)
def test_snippets_that_start_processes_run(snippet: Snippet, standins: Path, tmp_path: Path) -> None:
    """A snippet that trains (or launches Fabric), as its own script after the page's earlier definitions."""
    _run(_script(snippet, snippet.page), standins, tmp_path / f"{snippet.page.stem}_{snippet.line}.py")
