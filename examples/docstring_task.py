"""A question-answering task built from data already on the machine: the standard library's own docstrings.

Each example asks what a documented function of a standard-library module does, and answers with the first sentence
of its docstring::

    In Python's `textwrap` module, what does `dedent` do?
    Remove any common leading whitespace from every line in `text`.

Validation holds out whole modules (:data:`HELD_OUT`): the model is scored on functions of modules it never saw in
training, so what it learns is to answer in the docstrings' terse style and to read a function's purpose from its
name, not to recall the training answers. Everything is deterministic: the modules are a fixed list, the functions
sorted by name, and the sentences are those of this Python's own standard library.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Pure-Python and built-in modules with documented functions, importable on every platform Python runs on.
MODULES = (
    "abc", "ast", "base64", "bisect", "bz2", "calendar", "codecs", "copy", "csv", "dataclasses", "decimal", "difflib",
    "dis", "email.utils", "enum", "filecmp", "fileinput", "fnmatch", "functools", "glob", "gzip", "hashlib", "heapq",
    "hmac", "html", "inspect", "ipaddress", "itertools", "json", "linecache", "locale", "logging", "lzma", "math",
    "mimetypes", "operator", "os", "os.path", "pickle", "pkgutil", "platform", "plistlib", "pprint", "quopri",
    "random", "re", "secrets", "shlex", "shutil", "statistics", "struct", "subprocess", "sysconfig", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types", "typing", "unicodedata",
    "urllib.parse", "urllib.request", "uuid", "weakref", "webbrowser", "xml.etree.ElementTree", "zlib",
)
HELD_OUT = ("fnmatch", "glob", "heapq", "secrets", "shutil", "statistics", "textwrap", "uuid")  # validation only


@dataclass(frozen=True)
class Example:
    module: str
    function: str
    answer: str

    @property
    def question(self) -> str:
        return f"In Python's `{self.module}` module, what does `{self.function}` do?"


def first_sentence(doc: str) -> str | None:
    """The first sentence of a docstring's first paragraph, on one line; ``None`` if it has none."""
    paragraph = " ".join(line.strip() for line in inspect.cleandoc(doc).split("\n\n")[0].splitlines())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match.group(1) if match else None


def module_examples(name: str) -> list[Example]:
    """One example per public function of module ``name`` (its own, or its C accelerator's: ``_heapq`` for
    ``heapq``) whose docstring opens with a sentence of 20 to 200 characters."""
    module = importlib.import_module(name)
    public = getattr(module, "__all__", None) or [k for k in vars(module) if not k.startswith("_")]
    found = []
    for attr in sorted(set(public)):
        fn = getattr(module, attr, None)
        if not (inspect.isfunction(fn) or inspect.isbuiltin(fn) or inspect.ismethod(fn)):
            continue  # classes, constants, submodules
        owner = getattr(fn, "__module__", None) or ""
        if owner not in (module.__name__, f"_{module.__name__}") and name != "os.path":
            continue  # imported from elsewhere (os.path is posixpath or ntpath)
        sentence = first_sentence(inspect.getdoc(fn) or "")
        if sentence and 20 <= len(sentence) <= 200:
            found.append(Example(name, attr, sentence))
    return found


def split(modules: tuple[str, ...] = MODULES, held_out: tuple[str, ...] = HELD_OUT) -> tuple[list[Example], list[Example]]:
    """``(train, validation)``: validation is every example of the ``held_out`` modules, training all the others.

    Read in a fresh interpreter that imports nothing but the standard library (``python -I``): libraries patch it
    on import (Lightning replaces ``warnings.formatwarning``, Ray ``inspect.isgenerator``), and every process of a
    run, whatever it imported, must build the same examples."""
    here = str(Path(__file__).resolve().parent)
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import docstring_task as t; print(json.dumps("
            f"[[e.module, e.function, e.answer] for m in {list(modules)!r} for e in t.module_examples(m)]))")
    found = json.loads(subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    examples = [Example(*row) for row in found]
    return [e for e in examples if e.module not in held_out], [e for e in examples if e.module in held_out]


# ------------------------------------------------------------------------------------------------ tokens
def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The question as the model's chat template asks it (its default system prompt included), ready for the
    answer; a plain ``Question: ... Answer:`` where the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = f"Question: {question}\nAnswer: "
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode(tokenizer: Any, example: Example) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)``: the prompt then the answer and the end-of-turn token; the loss counts only the answer
    and its end (labels -100 on the prompt), so the model learns to answer, not to ask."""
    prompt = prompt_ids(tokenizer, example.question)
    answer = tokenizer(example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


class Collate:
    """Pads a batch of :func:`encode` pairs on the right (labels with -100); a class, not a closure, so that the
    data loaders can be pickled by Lightning's spawn launcher."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, pairs: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
        import torch  # here, so that split()'s fresh interpreter imports only the standard library

        width = max(len(ids) for ids, _ in pairs)
        ids = torch.full((len(pairs), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(pairs), width), -100, dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for row, (i, l) in enumerate(pairs):
            ids[row, : len(i)], labels[row, : len(l)], mask[row, : len(i)] = torch.tensor(i), torch.tensor(l), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def left_padded(tokenizer: Any, questions: list[str]) -> dict[str, Any]:
    """The prompts of ``questions`` as one batch padded on the left, as ``generate()`` takes them."""
    import torch

    prompts = [prompt_ids(tokenizer, q) for q in questions]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return {"input_ids": ids, "attention_mask": mask}
