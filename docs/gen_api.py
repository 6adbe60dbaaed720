"""Write ``docs/api.md``, the API reference, from the package's docstrings and signatures.

Usage::

    python docs/gen_api.py           # (re)write docs/api.md
    python docs/gen_api.py --check   # exit 1 if docs/api.md is not what this script would write

Standard library only (plus importing ``lightning_fsdp2``). The output depends only on the code, so the same code
always gives a byte-identical file; ``tests/test_docs.py`` checks that the committed file is current.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"
PACKAGE = "lightning_fsdp2"
MAX_WIDTH = 100  # a signature longer than this is written one parameter per line

# Document the code in this working tree, even when another copy of the package is installed.
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

# Docstring sections whose indented entries become a Markdown list, one item per entry.
SECTIONS = ("Args", "Arguments", "Parameters", "Raises", "Returns", "Yields", "Attributes")


# ---------------------------------------------------------------------------------------------- what is documented
def _is_documentable(obj: Any) -> bool:
    return inspect.isfunction(obj) or inspect.isclass(obj)


def _defined_public(module: ModuleType) -> list[str]:
    """Public functions and classes defined in ``module`` itself (not imported into it), in definition order."""
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_") and _is_documentable(obj) and obj.__module__ == module.__name__
    ]


PUBLIC_MODULES = ("fabric", "lora", "averaging", "checkpoint", "convert", "quantize")
"""The modules users import from besides the package itself: each lists its public names in ``__all__``. The other
modules are the package's inside (how it works is in docs/how-it-works.md), not documented here."""


def sections() -> list[tuple[ModuleType, list[str]]]:
    """The modules to document, each with the names of its entries, in the order of the reference: the package's
    ``__all__``, then each public module's."""
    top = importlib.import_module(PACKAGE)
    plan: list[tuple[ModuleType, list[str]]] = [(top, [n for n in top.__all__ if _is_documentable(getattr(top, n))])]
    for suffix in PUBLIC_MODULES:
        module = importlib.import_module(f"{PACKAGE}.{suffix}")
        plan.append((module, [n for n in module.__all__ if _is_documentable(getattr(module, n))]))

    # Each object once, under the first module that lists it.
    seen: set[int] = set()
    result = []
    for module, names in plan:
        kept = []
        for name in names:
            obj = getattr(module, name)
            if id(obj) not in seen:
                seen.add(id(obj))
                kept.append(name)
        result.append((module, kept))
    return result


# ---------------------------------------------------------------------------------------------- signatures
class _Raw(str):
    """Text that ``inspect`` should print as it is (annotations are strings under postponed evaluation)."""

    def __repr__(self) -> str:
        return str(self)


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)


def _default(value: Any) -> str:
    if inspect.isfunction(value) or inspect.isclass(value):
        return value.__qualname__
    if isinstance(value, (set, frozenset)) and value:  # a set's order changes with the hash seed: sort it
        items = ", ".join(sorted(_default(item) for item in value))
        return f"{type(value).__name__}({{{items}}})" if isinstance(value, frozenset) else f"{{{items}}}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))  # no memory addresses: the output must be stable


def _parameters(signature: inspect.Signature, *, annotations: bool = True) -> list[str]:
    """The parameters as source text, with the ``/`` and ``*`` markers where they belong."""
    parts: list[str] = []
    kinds = [p.kind for p in signature.parameters.values()]
    for i, param in enumerate(signature.parameters.values()):
        if param.kind is param.KEYWORD_ONLY and inspect.Parameter.VAR_POSITIONAL not in kinds[:i]:
            if param.KEYWORD_ONLY not in kinds[:i]:
                parts.append("*")
        clean = param.replace(
            annotation=_Raw(_annotation(param.annotation))
            if annotations and param.annotation is not param.empty
            else param.empty,
            default=_Raw(_default(param.default)) if param.default is not param.empty else param.empty,
        )
        parts.append(str(clean))
        if param.kind is param.POSITIONAL_ONLY and (i + 1 == len(kinds) or kinds[i + 1] is not param.POSITIONAL_ONLY):
            parts.append("/")
    return parts


def _signature(obj: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def _def(name: str, signature: inspect.Signature, indent: str = "") -> str:
    """``def name(...) -> ...``, on one line if it fits, else one parameter per line."""
    params = _parameters(signature)
    returns = ""
    if signature.return_annotation is not signature.empty:
        returns = f" -> {_annotation(signature.return_annotation)}"
    line = f"{indent}def {name}({', '.join(params)}){returns}"
    if len(line) <= MAX_WIDTH or not params:
        return line
    inner = "".join(f"{indent}    {p},\n" for p in params)
    return f"{indent}def {name}(\n{inner}{indent}){returns}"


def _init_of(cls: type) -> Callable | None:
    """The ``__init__`` a class gets from this package (its own, a base's, a dataclass's), or ``None``."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            init = vars(klass)["__init__"]
            return init if getattr(init, "__module__", "").startswith(PACKAGE) else None
    return None


def render_signature(name: str, obj: Any) -> str:
    if inspect.isclass(obj):
        bases = ", ".join(base.__name__ for base in obj.__bases__ if base is not object)
        header = f"class {name}({bases})" if bases else f"class {name}"
        init = _init_of(obj)
        signature = _signature(init) if init is not None else None
        if signature is None:
            return header
        return f"{header}:\n{_def('__init__', signature, indent='    ')}"
    signature = _signature(obj)
    return _def(name, signature) if signature is not None else f"def {name}(...)"


# ---------------------------------------------------------------------------------------------- docstrings
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|obj|exc|const):`~?([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)(\s*\([^)]*\))?:(\s|$)")


def _inline(text: str) -> str:
    """reStructuredText inline markup as Markdown: ``x`` and :func:`x` become `x` (a ``~`` path keeps its last part)."""

    def role(match: re.Match) -> str:
        target = match.group(1)
        if match.group(0).split("`")[1].startswith("~"):
            target = target.rsplit(".", 1)[-1]
        return f"`{target}`"

    return _LITERAL.sub(r"`\1`", _ROLE.sub(role, text))


def _section_body(lines: list[str]) -> list[str]:
    """The indented entries of an ``Args:``-like section as a list: one item per entry, its lines kept as they are."""
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    out: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        text = line[indent:]
        if not text.startswith(" ") and (_ENTRY.match(text) or not out):
            out.append(f"- {text.rstrip()}")
        else:
            out.append(f"  {text.strip()}")
    return out


def render_docstring(doc: str | None) -> str:
    """A docstring as Markdown: inline markup converted, sections such as ``Args:`` as lists, lines not reflowed."""
    if not doc:
        return "*(no docstring)*"
    lines = _inline(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        if line.rstrip(":") in SECTIONS and line.endswith(":"):
            body = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            if out and out[-1]:
                out.append("")
            out.append(line)
            if any(b.strip() for b in body):
                out += ["", *_section_body(body)]
            out.append("")
            continue
        out.append(line)
        i += 1
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _summary(doc: str | None) -> str:
    """The first paragraph of a docstring (usually its first line) on one line."""
    first = (doc or "").strip().split("\n\n", 1)[0]
    return _inline(" ".join(part.strip() for part in first.splitlines()))


# ---------------------------------------------------------------------------------------------- members of classes
def _members(cls: type) -> Iterator[tuple[str, str, Any]]:
    """``(kind, name, object)`` for the public methods and properties with a docstring that a class defines itself or
    takes from the package's own bases (``FrontEndCore``: a user reads ``strategy.layout`` on the strategy), its own
    first."""
    own = [k for k in cls.__mro__ if k is cls or (k.__module__.startswith(PACKAGE) and k.__module__ != PACKAGE)]
    seen: set[str] = set()
    for name, member in [item for klass in own for item in vars(klass).items()]:
        if name.startswith("_") or name in seen:
            continue
        seen.add(name)
        if isinstance(member, property):
            kind, func = "property", member.fget
            doc = member.__doc__
        elif isinstance(member, (classmethod, staticmethod)):
            kind, func = "method", member.__func__
            doc = func.__doc__
        elif inspect.isfunction(member):
            kind, func = "method", member
            doc = member.__doc__
        else:
            continue
        if doc and doc.strip():
            yield kind, name, (func, doc, isinstance(member, staticmethod))


def _member_lines(cls: type) -> list[str]:
    methods, properties = [], []
    for kind, name, (func, doc, is_static) in _members(cls):
        if kind == "property":
            properties.append(f"- `{name}`: {_summary(doc)}")
            continue
        signature = _signature(func)
        params = list(signature.parameters.values()) if signature is not None else []
        if params and not is_static:
            params = params[1:]  # self / cls
        text = ", ".join(_parameters(signature.replace(parameters=params), annotations=False)) if signature else "..."
        methods.append(f"- `{name}({text})`: {_summary(doc)}")
    out: list[str] = []
    if properties:
        out += ["Properties:", "", *properties, ""]
    if methods:
        out += ["Methods:", "", *methods, ""]
    return out


# ---------------------------------------------------------------------------------------------- types
def _alias_docs(module: ModuleType) -> dict[str, tuple[str, str]]:
    """``{name: (value source, docstring)}`` for each module-level ``Name = ...`` followed by a string literal (how
    this package documents its type aliases)."""
    tree = ast.parse(inspect.getsource(module))
    found = {}
    for node, after in zip(tree.body, tree.body[1:]):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            found[node.targets[0].id] = (ast.unparse(node.value), inspect.cleandoc(after.value.value))
    return found


def types_named(text: str, documented: set[str]) -> list[tuple[str, str, Any]]:
    """The package's type aliases and classes that ``text`` (the rendered signatures) names but no entry documents,
    as ``(name, kind, object or (value, docstring))`` sorted by name: a reader meets ``ModulePolicy`` in a signature
    and finds it here."""
    package = importlib.import_module(PACKAGE)
    modules = [package] + [importlib.import_module(m.name)
                           for m in pkgutil.walk_packages(package.__path__, f"{PACKAGE}.")]
    named = set(re.findall(r"\b[A-Z]\w+\b", text)) - documented
    found: dict[str, tuple[str, Any]] = {}
    for module in modules:
        aliases = _alias_docs(module)
        for name in sorted(named - found.keys()):
            obj = vars(module).get(name)
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and obj.__doc__:
                found[name] = ("class", obj)
            elif name in aliases:
                found[name] = ("alias", aliases[name])
    return [(name, *found[name]) for name in sorted(found)]


# ---------------------------------------------------------------------------------------------- the page
def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _module_summary(module: ModuleType) -> str:
    return _summary(inspect.getdoc(module))


def render() -> str:
    """The text of ``docs/api.md``."""
    plan = sections()
    out = [
        "# API reference",
        "",
        "Generated by `python docs/gen_api.py` from the docstrings and signatures; do not edit it by hand.",
        "",
    ]
    types_title = "Types named in the signatures"
    for module, _ in plan:
        title = f"`{module.__name__}`"
        out.append(f"- [{title}](#{slug(title)})")
    out += [f"- [{types_title}](#{slug(types_title)})", ""]
    signatures = []
    for module, names in plan:
        out += [f"## `{module.__name__}`", "", _module_summary(module), ""]
        for name in names:
            obj = getattr(module, name)
            signatures.append(render_signature(name, obj))
            out += [f"### {name}", "", "```python", signatures[-1], "```", ""]
            out += [render_docstring(inspect.getdoc(obj)), ""]
            if inspect.isclass(obj):
                out += _member_lines(obj)
    out += [f"## {types_title}", "", "The package's own types that the signatures above name, defined here so that each"
            " name a signature uses is explained on this page.", ""]
    entries = [getattr(module, n) for module, names in plan for n in names]
    merged = {k.__name__ for e in entries if inspect.isclass(e) for k in e.__mro__[1:]}  # members listed with e's
    for name, kind, obj in types_named("\n".join(signatures), {n for _, names in plan for n in names} | merged):
        if kind == "class":
            out += [f"### {name}", "", "```python", render_signature(name, obj), "```", ""]
            out += [render_docstring(inspect.getdoc(obj)), "", *_member_lines(obj)]
        else:
            value, doc = obj
            out += [f"### {name}", "", "```python", f"{name} = {value}", "```", "", render_docstring(doc), ""]
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date; write nothing")
    args = parser.parse_args(argv)
    text = render()
    relative = OUTPUT.relative_to(ROOT)
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else None
        if current != text:
            state = "is missing" if current is None else "is out of date"
            print(f"{relative} {state}: run `python docs/gen_api.py` to regenerate it.", file=sys.stderr)
            return 1
        print(f"{relative} is up to date.")
        return 0
    OUTPUT.write_text(text, encoding="utf-8", newline="\n")
    print(f"Wrote {relative}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
