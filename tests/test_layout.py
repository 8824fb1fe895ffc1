"""The package's shape, checked from its source (no processes, no ranks): packages by
concern with imports that point down the layers below, no import cycles, no private
names read across modules, at most 8 modules at the top level, one root error class,
and test files that share helpers through helper modules rather than through each other.

Imports are read with ``ast`` at every level: module level, inside functions (lazy
imports count: they run), and under ``if TYPE_CHECKING:`` (a type-only cycle is still a
cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zeroshard"
TESTS = ROOT / "tests"

# DeepSpeed's module paths, kept as one-line re-exports for users; nothing in zeroshard
# imports them (the root package's lazy names aside)
SHIMS = {"zeroshard.accelerator", "zeroshard.checkpointing", "zeroshard.comm"}
SHIMS |= {"zeroshard.pipe", "zeroshard.utils"}

# Layers, lowest first. A package may import from a package of a lower layer only
# (its own modules aside). The unit of a module is its package, or its sub-package
# under zero/ and parallel/ (zero.layout, parallel.tensor, ...); the modules at the top
# level are units of their own.
LAYERS: list[tuple[str, ...]] = [
    ("config", "models", "ops"),  # leaves: the config schema, the built-in GPT, FusedAdam
    ("distributed",),  # process groups, the mesh, Comm and its ledger, the device seam
    # mixture-of-experts layers (DeepSpeed's MoE, gating, all-to-all dispatch over Comm,
    # grouped expert compute, the transformers sparse-block plan) and the marks saying
    # which parameters are experts, read by ZeRO's layout users, AutoTP and checkpoints
    ("moe",),
    ("offload",),  # where shards and optimizer states live (host, NVMe)
    ("zero.layout",),  # who owns which elements; the flat buffer
    ("zero.params", "zero.grads", "parallel.sequence", "activation", "monitor"),
    ("zero.optim", "parallel.tensor"),  # the step over params/grads; AutoTP over SP's prepare
    ("zero", "parallel"),  # the packages' own modules compose their sub-packages
    # fp8 matmuls swapped into the Linear layers (torchao's, and a hand-written one for
    # parallel.tensor's layers, whose amaxes it all-reduces): the engine applies it after
    # tensor parallelism and before ZeRO's layout, so it sits just under runtime
    ("fp8",),
    ("checkpoint",),  # saves and loads what the runtime holds (it is handed the engine)
    ("runtime",),  # the engine and how it is built
    ("parallel.pipeline", "inference"),  # engines over the runtime / over checkpoints
    ("compat",),  # the DeepSpeed facade over all of the above
    ("tools",),  # the command line
    ("api", "as_deepspeed", *sorted(s.split(".")[1] for s in SHIMS)),  # entry points
]

# Upward package edges kept for now, each with the reason and the fix that removes it.
# None left: offload/ reads the layout and the stores through its own Protocols
# (offload/layout.py, store.py, states.py), and zero/optim gets the master dtype and a
# Scaler Protocol instead of runtime/precision.
ALLOWED_UP: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (the deepest one the statement names)
    names: tuple[str, ...]  # what ``from target import ...`` takes (empty for ``import``)
    kind: str  # "module", "function" or "typing" (under ``if TYPE_CHECKING:``)
    line: int


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _deepest(name: str, known: dict[str, Path]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import of a zeroshard module in ``path``'s source, with its level."""
    out: list[Import] = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def add(node: ast.stmt, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "zeroshard":
                    out.append(Import(name, _deepest(alias.name, known), (), kind, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] != "zeroshard":
                return
            for alias in node.names:  # ``from pkg import module`` imports that module
                full = f"{base}.{alias.name}"
                target = full if full in known else _deepest(base, known)
                out.append(Import(name, target, (alias.name,), kind, node.lineno))

    def walk(body: list[ast.stmt], kind: str) -> None:
        for node in body:
            add(node, kind)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                walk(node.body, "typing")
                walk(node.orelse, kind)
                continue
            inner = "function" if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else kind
            for field in ("body", "orelse", "finalbody", "handlers"):
                walk([n for n in getattr(node, field, []) if isinstance(n, ast.stmt | ast.excepthandler)], inner)  # type: ignore[misc]  # fmt: skip

    walk(ast.parse(path.read_text(encoding="utf-8")).body, "module")
    return out


def all_imports() -> list[Import]:
    known = module_files()
    return [i for name, path in known.items() for i in imports_of(name, path, known)]


def unit(module: str) -> str:
    """The layer unit of a module (see LAYERS)."""
    parts = module.split(".")[1:]
    if not parts:
        return "zeroshard"
    if parts[0] in ("zero", "parallel") and len(parts) > 1:
        sub = f"{parts[0]}.{parts[1]}"
        if sub in LAYER_OF:
            return sub
    return parts[0]


LAYER_OF = {u: i for i, layer in enumerate(LAYERS) for u in layer}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node (or a node with an edge to itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def import_cycles(imports: list[Import]) -> list[list[str]]:
    # the root package is the lazy facade: it imports its names on first use (and under
    # TYPE_CHECKING for the type checker); modules may read ``zeroshard.__version__``
    edges: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        if "zeroshard" not in (i.source, i.target) and i.source != i.target:
            edges[i.source].add(i.target)
    return strongly_connected(edges)


def upward_edges(imports: list[Import]) -> list[str]:
    bad = []
    for i in imports:
        a, b = unit(i.source), unit(i.target)
        if a == b or "zeroshard" in (a, b):  # within a unit; the root (see above)
            continue
        if a not in LAYER_OF or b not in LAYER_OF:
            bad.append(f"{i.source} -> {i.target}: {a if a not in LAYER_OF else b} has no layer")
        elif LAYER_OF[b] >= LAYER_OF[a] and (a, b) not in ALLOWED_UP:
            where = "the same layer as" if LAYER_OF[b] == LAYER_OF[a] else "a layer above"
            bad.append(f"{i.source} -> {i.target} (line {i.line}, {i.kind}): {b} is {where} {a}")
    return bad


def private_reads(name: str, path: Path, known: dict[str, Path]) -> list[str]:
    """``from x import _y`` of a zeroshard module, and ``module._y`` on a name bound to
    another zeroshard module (``from zeroshard.a import b``, ``import zeroshard.a as b``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: set[str] = set()
    bad = []
    for i in imports_of(name, path, known):
        for n in i.names:
            if n.startswith("_") and not n.startswith("__"):
                bad.append(f"{name}:{i.line}: imports {n} from {i.target}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("zeroshard") and a.asname:
                    bound.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zeroshard"):
            for a in node.names:
                if f"{node.module}.{a.name}" in known:
                    bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            bad.append(f"{name}:{node.lineno}: reads {node.value.id}.{node.attr}")
    return bad


# -- the checks -------------------------------------------------------------------------
def test_no_import_cycles() -> None:
    assert import_cycles(all_imports()) == []


def test_imports_point_down_the_layers() -> None:
    assert upward_edges(all_imports()) == []
    # every package has a layer, and every allowance is still needed
    units = {unit(m) for m in module_files()} - {"zeroshard"}
    assert units <= set(LAYER_OF), units - set(LAYER_OF)
    used = {(unit(i.source), unit(i.target)) for i in all_imports()}
    assert used >= ALLOWED_UP, ALLOWED_UP - used


def test_no_private_names_across_modules() -> None:
    known = module_files()
    bad = [b for name, path in known.items() for b in private_reads(name, path, known)]
    assert bad == []
    private = [m for m in known if any(p.startswith("_") for p in m.split(".")[1:])]
    assert private == ["zeroshard.config.__main__"]  # python -m zeroshard.config


def test_nothing_inside_imports_the_deepspeed_paths() -> None:
    users = sorted({f"{i.source} -> {i.target}" for i in all_imports() if i.target in SHIMS})
    assert [u for u in users if not u.startswith("zeroshard -> ")] == []


def test_at_most_eight_top_level_modules() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


# modules whose import acts: as_deepspeed registers the ``deepspeed`` alias, refused
# once transformers is imported (as it is when other tests ran first in this process)
IMPORT_ACTS = {"zeroshard.as_deepspeed"}


def test_every_error_is_a_zeroshard_error() -> None:
    import zeroshard

    root = zeroshard.ZeroshardError
    defined: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(zeroshard.__path__, "zeroshard."):
        if info.name in IMPORT_ACTS:
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and issubclass(cls, BaseException):
                defined.append(cls)
    defined += [c for _, c in inspect.getmembers(zeroshard, inspect.isclass) if issubclass(c, BaseException)]  # fmt: skip
    assert len(defined) > 15
    assert [c.__qualname__ for c in defined if not issubclass(c, root)] == []


BUILTIN_RAISES = {"ValueError", "RuntimeError", "NotImplementedError", "FloatingPointError"}
# builtin raises that are not errors of ours
BUILTIN_ALLOWED = {
    # the fake device runtime imitates torch.cuda's own error for a bad device index
    ("zeroshard/distributed/fake_device.py", "RuntimeError"),
}


def builtin_raises(path: Path, root: Path = ROOT) -> list[str]:
    """``raise ValueError(...)`` and kin: errors of ours raised without our root. A bare
    ``raise NotImplementedError`` (no call) is the abstract-method idiom, not an error."""
    rel = path.relative_to(root).as_posix()
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
            continue
        name = node.exc.func.id if isinstance(node.exc.func, ast.Name) else ""
        if name in BUILTIN_RAISES and (rel, name) not in BUILTIN_ALLOWED:
            bad.append(f"{rel}:{node.lineno}: raise {name}")
    return bad


def test_errors_are_raised_as_ours() -> None:
    assert [b for p in module_files().values() for b in builtin_raises(p)] == []


def test_test_files_do_not_import_each_other() -> None:
    bad = []
    test_files = {p.stem for p in TESTS.rglob("test_*.py")}  # ours, not accelerate.test_utils
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
            else:
                continue
            for n in names:
                if any(part in test_files for part in n.split(".")):
                    bad.append(f"{path.name}:{node.lineno}: imports {n}")
    assert bad == []


# -- each check fails when its rule is broken (the scanners, on planted sources) -------
def _scan(tmp_path: Path, files: dict[str, str]) -> tuple[dict[str, Path], list[Import]]:
    for rel, text in files.items():
        f = tmp_path / "zeroshard" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    known = module_files(tmp_path / "zeroshard")
    return known, [i for n, p in known.items() for i in imports_of(n, p, known)]


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    known, imports = _scan(
        tmp_path,
        {
            "__init__.py": "",
            "distributed/__init__.py": "",
            "distributed/ledger.py": "def f():\n    from zeroshard.monitor import comms\n",
            "monitor/__init__.py": "",
            "monitor/comms.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from zeroshard.distributed.ledger import Ledger\n",
            "runtime/__init__.py": "",
            "runtime/engine.py": "from zeroshard.distributed.ledger import _private\n"
            "from zeroshard.distributed import ledger\nledger._cache\n",
        },
    )
    assert import_cycles(imports) == [["zeroshard.distributed.ledger", "zeroshard.monitor.comms"]]
    up = upward_edges(imports)
    assert len(up) == 1 and up[0].startswith(
        "zeroshard.distributed.ledger -> zeroshard.monitor.comms"
    )
    bad = private_reads("zeroshard.runtime.engine", known["zeroshard.runtime.engine"], known)
    assert [b.split(": ")[1] for b in bad] == [
        "imports _private from zeroshard.distributed.ledger",
        "reads ledger._cache",
    ]
    raises = tmp_path / "raises.py"
    raises.write_text(
        "def f():\n    raise ValueError('x')\n\ndef g():\n    raise KeyError('y')\n\n"
        "def h():\n    raise NotImplementedError\n"
    )
    assert [b.split(": ")[1] for b in builtin_raises(raises, tmp_path)] == ["raise ValueError"]


@pytest.mark.parametrize("kind", ["module", "function", "typing"])
def test_every_import_level_is_read(tmp_path: Path, kind: str) -> None:
    line = "from zeroshard.a import x\n"
    body = {
        "module": line,
        "function": "def f():\n    " + line,
        "typing": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    " + line,
    }[kind]
    _, imports = _scan(tmp_path, {"__init__.py": "", "a.py": "x = 1\n", "b.py": body})
    assert [(i.source, i.target, i.kind) for i in imports] == [("zeroshard.b", "zeroshard.a", kind)]
