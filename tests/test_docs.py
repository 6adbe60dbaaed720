"""The documentation stays true to the code: the generated API reference is current, relative links and anchors
in README.md and docs/*.md resolve, and every ``FSDP2Strategy`` option has its section in docs/strategy-options.md.
Fast: nothing here starts processes."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Lightning's own strategy arguments, documented together rather than one heading each.
LIGHTNING_STANDARD = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


def _load_gen_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_docs_gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_lists_what_users_import_and_nothing_else() -> None:
    """docs/api.md documents the package's `__all__` and each public module's (fabric, lora, averaging, checkpoint,
    convert, quantize), each name importable; every name the docs, README and examples import from the package is
    among them (the same object), and no internal module has a section."""
    import importlib

    gen = _load_gen_api()
    documented = {id(getattr(module, name)) for module, names in gen.sections() for name in names}
    for module_name in ["lightning_fsdp2", *(f"lightning_fsdp2.{m}" for m in gen.PUBLIC_MODULES)]:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)  # importable
            if gen._is_documentable(obj):
                assert id(obj) in documented, f"{module_name}.{name} is not documented"
    imported = set()
    for path in [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "examples").glob("*.py")]:
        if path.name == "api.md":
            continue
        text = path.read_text()
        found = re.findall(r"from (lightning_fsdp2(?:\.\w+)*) import \(([^)]*)\)", text)
        found += re.findall(r"(?m)from (lightning_fsdp2(?:\.\w+)*) import ([\w, ]+?)\s*(?:#.*)?$", text)
        for module_name, names in found:
            for name in (n.strip() for n in names.replace("\n", ",").split(",")):
                if name and not name.startswith("_"):
                    imported.add((module_name, name, path.name))
    assert imported, "found no imports to check"
    for module_name, name, page in sorted(imported):
        obj = getattr(importlib.import_module(module_name), name)
        if gen._is_documentable(obj) and not isinstance(obj, type(importlib)):
            assert id(obj) in documented, f"{page} imports {module_name}.{name}, which docs/api.md does not document"
    text = (DOCS / "api.md").read_text()
    for internal in ("lightning_fsdp2.parallel", "lightning_fsdp2.layout", "lightning_fsdp2.options",
                     "lightning_fsdp2.peft_support", "lightning_fsdp2.wrap"):
        assert f"## `{internal}`" not in text, internal


def test_every_type_a_signature_in_the_api_reference_names_is_explained_there() -> None:
    """A reader meets `ModulePolicy` or `Estimate` in a signature of docs/api.md and finds it on the page: each name
    the package defines that a signature uses (a base class's members are listed with the class) has a heading; and a
    strategy's properties from its internal base (`layout`, `device_mesh`) are listed with the strategy."""
    import importlib
    import pkgutil

    import lightning_fsdp2

    text = (DOCS / "api.md").read_text()
    headings = set(re.findall(r"(?m)^### (\w+)$", text))
    blocks = re.findall(r"(?s)```python\n(.*?)```", text)
    bases = {b.strip() for block in blocks for group in re.findall(r"^class \w+\(([^)]*)\)", block, re.M)
             for b in group.split(",")}
    ours = set()  # the classes and module-level names the package defines (not those it imports)
    for info in pkgutil.walk_packages(lightning_fsdp2.__path__, "lightning_fsdp2."):
        module = importlib.import_module(info.name)
        ours |= {n for n, o in vars(module).items() if inspect.isclass(o) and o.__module__ == info.name}
        ours |= {t.id for node in ast.parse(inspect.getsource(module)).body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    named = {n for block in blocks for n in re.findall(r"\b[A-Z]\w+\b", block)} & ours
    assert "ModulePolicy" in named and "Estimate" in named
    assert not named - headings - bases, f"named in signatures but not explained: {sorted(named - headings - bases)}"
    strategy = text.split("### FSDP2Strategy", 1)[1].split("\n### ", 1)[0]
    for inherited in ("`layout`", "`device_mesh`", "`layout_choice`", "`distributed_sampler_kwargs`"):
        assert inherited in strategy, inherited


def test_the_strategy_options_page_shows_every_argument_with_its_default() -> None:
    """strategy-options.md's "All arguments" block names every option of `FSDP2Strategy` (all but Lightning's own
    plumbing: accelerator, devices, environment, checkpoint IO, precision plugin) with the default the signature has,
    and nothing else: it cannot drift from the code."""
    import ast
    import inspect
    from datetime import timedelta

    from lightning_fsdp2 import FSDP2Strategy

    plumbing = {"self", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    signature = {n: p.default for n, p in inspect.signature(FSDP2Strategy.__init__).parameters.items()
                 if n not in plumbing}
    text = (DOCS / "strategy-options.md").read_text()
    block = re.search(r"```python\n(.*?strategy = FSDP2Strategy\(.*?)```", text, re.S).group(1)
    call = next(node for node in ast.walk(ast.parse(block))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FSDP2Strategy")
    shown = {kw.arg: eval(compile(ast.Expression(kw.value), "<doc>", "eval"), {"timedelta": timedelta})
             for kw in call.keywords}
    assert shown.keys() == signature.keys(), (sorted(set(signature) - set(shown)), sorted(set(shown) - set(signature)))
    assert shown == signature


def test_every_option_is_declared_once_and_documented_where_users_look() -> None:
    """Each option is declared once, by its technique in `options.py`: the keywords of its `from_arguments` (both
    front-ends' signatures are checked against them in tests/test_layout.py) and their descriptions (its
    `ARGUMENTS`), from which both front-ends' docstrings (what docs/api.md shows) are written; each has its section
    on strategy-options.md. An option added in one place only fails here."""
    import inspect

    from lightning_fsdp2 import FSDP2Strategy
    from lightning_fsdp2.fabric import FSDP2Strategy as FabricStrategy
    from lightning_fsdp2.options import _PARTS, StrategyOptions

    for part in _PARTS.values():
        taken = list(inspect.signature(part.from_arguments).parameters)
        assert list(part.ARGUMENTS) == taken, (part.__name__, taken, list(part.ARGUMENTS))
    names = list(StrategyOptions.arguments())
    assert list(StrategyOptions.documented()) == names
    trainer_doc, fabric_doc = inspect.getdoc(FSDP2Strategy), inspect.getdoc(FabricStrategy)
    for name, text in StrategyOptions.documented().items():
        start = " ".join(text.split()[:6])
        assert f"{name}: {start}" in " ".join(trainer_doc.split()), name
        if name != "async_save":
            assert f"{name}: {start}" in " ".join(fabric_doc.split()), name
    page = (DOCS / "strategy-options.md").read_text()
    assert [n for n in names if not re.search(rf"^##+ `{n}`", page, re.M)] == []


def test_api_reference_is_current() -> None:
    expected = _load_gen_api().render()
    path = DOCS / "api.md"
    assert path.exists(), "docs/api.md is missing: run `python docs/gen_api.py` to generate it."
    current = path.read_text(encoding="utf-8")
    assert current == expected, "docs/api.md is out of date with the docstrings: run `python docs/gen_api.py`."


# ------------------------------------------------------------------------------------------------ links
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text], one level of nested brackets allowed; ! for images
    r"\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"  # (target "optional title")
)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, code spans blanked out."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                if not line.strip()[len(match.group(1)) :].strip():
                    fence = None
            continue
        lines.append((number, line))
    return lines


def _strip_code_spans(text: str) -> str:
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, stripped, only alphanumerics, spaces, hyphens and underscores
    kept, spaces turned into hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _heading_text(raw: str) -> str:
    """The heading as GitHub renders it for the slug: links become their text, images vanish."""
    raw = re.sub(r"!\[[^\]]*\]\([^)]*\)", "", raw)
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers: heading slugs (with GitHub's ``-1``, ``-2`` for repeats) and HTML ids."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line in _prose_lines(text):
        match = _HEADING.match(line)
        if match:
            base = slug(_heading_text(match.group(2)))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found.update(_HTML_ANCHOR.findall(text))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every Markdown link (and image) outside code."""
    found = []
    prose = _prose_lines(path.read_text(encoding="utf-8"))
    for number, line in prose:
        for match in _LINK.finditer(_strip_code_spans(line)):
            found.append((number, match.group(1).strip("<>")))
    return found


def _is_external(target: str) -> bool:
    return re.match(r"^(https?:|mailto:|ftp:|//)", target, re.IGNORECASE) is not None


def test_relative_links_resolve() -> None:
    from urllib.parse import unquote

    failures: list[str] = []
    anchor_cache: dict[Path, set[str]] = {}
    for source in _markdown_files():
        if not source.exists():
            continue
        where = source.relative_to(ROOT)
        for number, target in links(source):
            if _is_external(target):
                continue
            file_part, _, anchor = target.partition("#")
            if file_part:
                base = ROOT if file_part.startswith("/") else source.parent
                resolved = (base / unquote(file_part).lstrip("/")).resolve()
                if not resolved.exists():
                    failures.append(f"{where}:{number}: ({target}): {file_part} does not exist")
                    continue
            else:
                resolved = source.resolve()
            if anchor and resolved.suffix.lower() == ".md" and resolved.is_file():
                if resolved not in anchor_cache:
                    anchor_cache[resolved] = anchors(resolved)
                if unquote(anchor).lower() not in anchor_cache[resolved]:
                    target_name = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
                    failures.append(
                        f"{where}:{number}: ({target}): no heading in {target_name} has the anchor #{anchor}"
                    )
    assert not failures, f"{len(failures)} broken link(s):\n" + "\n".join(failures)


# ------------------------------------------------------------------------------------------------ strategy options
def test_every_public_strategy_option_is_documented() -> None:
    from lightning_fsdp2 import FSDP2Strategy

    options = [name for name in inspect.signature(FSDP2Strategy.__init__).parameters if name != "self"]
    options = [name for name in options if name not in LIGHTNING_STANDARD]
    assert options, "FSDP2Strategy.__init__ has no options of its own?"
    text = (DOCS / "strategy-options.md").read_text(encoding="utf-8")
    headings = {
        match.group(1)
        for _, line in _prose_lines(text)
        if (match := re.match(r"^##[ \t]+`([^`]+)`[ \t]*$", line))
    }
    missing = [name for name in options if name not in headings]
    assert not missing, "docs/strategy-options.md has no '## `name`' section for: " + ", ".join(missing)


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("`lightning_fsdp2.lora`", "lightning_fsdp2lora"),
        ("  Strategy options ", "strategy-options"),
        ("What `meta_init=False` does!", "what-meta_initfalse-does"),
        ("A -- B", "a----b"),
    ],
)
def test_slug(heading: str, expected: str) -> None:
    assert slug(heading) == expected


# ------------------------------------------------------------------------------------------------ support matrix
def support_matrix() -> str:
    """The architectures x peft methods table of docs/support.md, from what tests/test_peft_matrix.py runs."""
    from tests import test_peft_matrix as matrix

    notes = sorted(set(matrix.NOT_IN_PEFT.values()))
    head = "| architecture | " + " | ".join(f"`{m}`" for m in matrix.METHODS) + " |"
    rows = [head, "|" + "---|" * (len(matrix.METHODS) + 1)]
    for arch in matrix.ARCHITECTURES:
        cells = []
        for method in matrix.METHODS:
            if (arch, method) in matrix.NOT_IN_PEFT:
                cells.append(f"—{notes.index(matrix.NOT_IN_PEFT[arch, method]) + 1}")
            else:
                cells.append("eval" if method in matrix.UNTRAINABLE else "yes")
        rows.append(f"| {arch} | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [f"—{i}: {note}." for i, note in enumerate(notes, start=1)]
    return "\n".join(rows)


def test_support_matrix_is_what_the_tests_run() -> None:
    text = (DOCS / "support.md").read_text(encoding="utf-8")
    start, end = "<!-- matrix: generated from tests/test_peft_matrix.py -->\n", "\n<!-- matrix end -->"
    assert start in text and end in text, "docs/support.md lost its matrix markers"
    current = text.split(start, 1)[1].split(end, 1)[0]
    assert current == support_matrix(), (
        "docs/support.md's matrix differs from tests/test_peft_matrix.py; paste tests.test_docs.support_matrix()"
    )


# ------------------------------------------------------------------------------------------------ error messages
_TESTED_BY = re.compile(r'^<!-- tested by (tests/[\w/]+\.py)::(\w+): "([^"]+)" -->$')


def test_every_error_in_troubleshooting_is_triggered_by_a_named_test() -> None:
    """Each entry of troubleshooting.md (but "Not errors, but surprising") names, right under its heading, the test
    that triggers the error and a fragment of its message; the fragment is in the entry and in that test's code
    (decorators included), so the quoted message is the one a test produces."""
    import ast

    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    errors = text.split("\n## Not errors, but surprising")[0]
    sections = re.split(r"(?m)^(?=### )", errors)[1:]
    assert len(sections) > 40
    for section in sections:
        heading, mark = section.splitlines()[:2]
        if mark.startswith("<!-- not an error message"):
            continue
        found = _TESTED_BY.match(mark)
        assert found, f"{heading}: no `<!-- tested by tests/FILE.py::TEST: \"fragment\" -->` under it"
        path, name, fragment = found.groups()
        assert fragment in section.replace(mark, ""), f"{heading}: {fragment!r} is not in the entry"
        source = (ROOT / path).read_text(encoding="utf-8")
        functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
        assert name in functions, f"{heading}: {path} has no test {name}"
        node = functions[name]
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        code = "\n".join(source.splitlines()[start - 1 : node.end_lineno])
        assert fragment in code, f"{heading}: {path}::{name} does not check {fragment!r}"


# ------------------------------------------------------------------------------------------------ version floors
# What the code needs of each dependency, and where: a floor below these is a promise the code cannot keep.
_NEEDS = {
    "lightning": ("2.6", "lightning.pytorch.callbacks.WeightAveraging (lightning_fsdp2/averaging.py)"),
    "transformers": ("5.24", "transformers.core_model_loading as 5.24 has it (lightning_fsdp2/checkpoint/sources.py)"),
    "peft": ("0.21", "peft's layer internals, tested with 0.21 only"),
    "torch": ("2.6", "torch.distributed.fsdp.fully_shard, public from 2.6"),
}


def test_version_floors_are_true() -> None:
    """pyproject.toml's floors are at least what the code needs (_NEEDS), the pinned versions meet them, and the
    README's "Supported versions" states the same floors."""
    from importlib.metadata import version

    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = {}
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name, _, floor = requirement.partition(">=")
        declared[name.strip()] = floor.strip()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name, (needed, why) in _NEEDS.items():
        assert Version(declared[name]) >= Version(needed), f"{name}>={declared[name]}, but the code needs {why}"
        assert Version(version(name)) >= Version(declared[name]), f"installed {name} is older than its floor"
        assert f"`{name}>={declared[name]}`" in readme, f"README's Supported versions does not say {name}>={declared[name]}"
