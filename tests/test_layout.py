"""Static layout rules for the source packages `mrv2/` and `executor/`.

These tests read the source as text / `ast` only; nothing from the packages is
imported, so they run in well under a second.  `tests/` and `bench/` are not
checked.  The rules:

1. no source file is over MAX_LINES lines;
2. no import cycle: `executor/` imports nothing from `mrv2`, and the graph of
   module-level imports among the modules of `mrv2/` + `executor/` is acyclic;
3. no name (top-level class, function or UPPERCASE constant) is defined in more
   than one module;
4. no block of DUP_WINDOW or more (normalised) lines occurs twice.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mrv2", "executor")

MAX_LINES = 400
DUP_WINDOW = 6  # lines in a window of the duplicate-block check
DUP_MIN_LONG_LINES = 3  # ... of which at least this many are "substantial"
DUP_LONG_LINE = 20  # a line is substantial when it has more than this many characters

# Names that are conventionally defined once per module and so may repeat.
# Dunder names (``__all__``, ``__getattr__``, ...) are exempt by rule as well.
PER_MODULE_NAMES = frozenset({
    "logger",  # each module's own logging.getLogger(__name__)
    "_logger",  # same, private spelling
})

_UPPER_RE = re.compile(r"^_*[A-Z][A-Z0-9_]*$")


# --------------------------------------------------------------------------- sources


class Source:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rel = path.relative_to(ROOT).as_posix()
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        self.is_package = parts[-1] == "__init__"
        if self.is_package:
            parts = parts[:-1]
        self.module = ".".join(parts)
        self.text = path.read_text(encoding="utf-8")
        self.tree = ast.parse(self.text, filename=self.rel)

    @property
    def package(self) -> str:
        """The package relative imports are resolved against."""
        return self.module if self.is_package else self.module.rpartition(".")[0]


@lru_cache(maxsize=1)
def sources() -> tuple[Source, ...]:
    files = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files.append(Source(path))
    assert files, f"no sources found under {ROOT} / {PACKAGES}"
    return tuple(files)


@lru_cache(maxsize=1)
def modules() -> dict[str, Source]:
    return {s.module: s for s in sources()}


# --------------------------------------------------------------------------- 1. file size


def test_no_source_file_over_400_lines():
    offenders = []
    for s in sources():
        n = len(s.text.splitlines())
        if n > MAX_LINES:
            offenders.append(f"{s.rel}: {n} lines")
    assert not offenders, (f"{len(offenders)} source file(s) over {MAX_LINES} lines:\n  "
                           + "\n  ".join(offenders))


# --------------------------------------------------------------------------- 2. imports


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _module_level_imports(body: list[ast.stmt]):
    """Import statements executed when the module is imported.

    Descends into `if` / `try` / `with` / `for` / `while` blocks and class bodies
    (all run at import time), but not into function bodies, and not into the
    body of ``if TYPE_CHECKING:`` (its ``else`` branch does run).
    """
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.ClassDef):
            yield from _module_level_imports(node.body)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            yield from _module_level_imports(node.body)
            for h in node.handlers:
                yield from _module_level_imports(h.body)
            yield from _module_level_imports(node.orelse)
            yield from _module_level_imports(node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
            yield from _module_level_imports(node.body)
            yield from _module_level_imports(getattr(node, "orelse", []))


def _absolute_from_module(src: Source, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = src.package.split(".") if src.package else []
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    if node.module:
        base.append(node.module)
    return ".".join(base)


def _known(name: str) -> str | None:
    """The longest prefix of dotted `name` that is a module of ours."""
    mods = modules()
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return None


def _import_targets(src: Source, node: ast.Import | ast.ImportFrom):
    """Our modules that the import statement `node` of `src` depends on."""
    mods = modules()
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _known(alias.name)
            if target:
                yield target
        return
    base = _absolute_from_module(src, node)
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        if sub in mods:  # `from pkg import submodule`
            yield sub
        else:
            target = _known(base)
            if target:
                yield target


@lru_cache(maxsize=1)
def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for s in sources():
        edges: dict[str, int] = {}
        for node in _module_level_imports(s.tree.body):
            for target in _import_targets(s, node):
                if target != s.module:
                    edges.setdefault(target, node.lineno)
        graph[s.module] = edges
    return graph


def _dynamic_import_names(tree: ast.AST):
    """(line, name) of ``importlib.import_module("x")`` / ``__import__("x")`` with a literal name."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if fname in ("import_module", "__import__"):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value


def test_executor_does_not_import_mrv2():
    offenders = []
    for s in sources():
        if s.module.split(".")[0] != "executor":
            continue
        type_checking = {id(n) for node in ast.walk(s.tree)
                         if isinstance(node, ast.If) and _is_type_checking(node.test)
                         for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(s.tree):  # everywhere: module level and functions
            if id(node) in type_checking:
                # Annotations may name mrv2's config and message types: nothing is imported
                # at run time, so the dependency stays one-way where it matters.
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [_absolute_from_module(s, node)]
            for name in names:
                if name == "mrv2" or name.startswith("mrv2."):
                    offenders.append(f"{s.rel}:{node.lineno}: imports {name}")
        for line, name in _dynamic_import_names(s.tree):
            if name == "mrv2" or name.startswith("mrv2."):
                offenders.append(f"{s.rel}:{line}: imports {name} dynamically")
    assert not offenders, ("executor/ must import nothing from mrv2 -- at module level, in "
                           "functions (the dependency is one-way, mrv2 -> executor):\n  " + "\n  ".join(offenders))


def _strongly_connected_components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the module count
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _simple_cycles(graph: dict[str, dict[str, int]], comp: list[str], limit: int = 50):
    """Elementary cycles inside one strongly connected component (each found once)."""
    members = set(comp)
    order = {m: i for i, m in enumerate(comp)}
    cycles: list[list[str]] = []
    for start in comp:
        # only cycles whose smallest member is `start`: each cycle is reported once
        stack = [(start, [start])]
        while stack and len(cycles) < limit:
            v, path = stack.pop()
            for w in sorted(graph[v], reverse=True):
                if w not in members or order[w] < order[start]:
                    continue
                if w == start:
                    cycles.append(path + [start])
                elif w not in path:
                    stack.append((w, path + [w]))
    return cycles


def test_no_module_level_import_cycle():
    graph = import_graph()
    report = []
    for comp in _strongly_connected_components(graph):
        if len(comp) < 2:
            continue
        for cyc in _simple_cycles(graph, comp):
            hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cyc, cyc[1:])]
            report.append(" -> ".join(hops + [cyc[-1]]))
    assert not report, (f"{len(report)} module-level import cycle(s) among mrv2/ + executor/ "
                        "(imports inside functions and under `if TYPE_CHECKING:` not counted):\n  "
                        + "\n  ".join(report))


# --------------------------------------------------------------------------- 3. names


def _defined_names(body: list[ast.stmt]):
    """(name, line) of top-level classes, functions and UPPERCASE constants.

    Looks through module-level `if` / `try` / `with` blocks (definitions there are
    still top-level), not into classes or functions.
    """
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue  # a bare annotation defines nothing
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and _UPPER_RE.match(n.id):
                        yield n.id, node.lineno
        elif isinstance(node, ast.If):
            yield from _defined_names(node.body)
            yield from _defined_names(node.orelse)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            yield from _defined_names(node.body)
            for h in node.handlers:
                yield from _defined_names(h.body)
            yield from _defined_names(node.orelse)
            yield from _defined_names(node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _defined_names(node.body)


_IMPL_SUFFIX = re.compile(r"_(torch|numba|triton)$")


def _implementations_of_one_owner(paths) -> bool:
    """Kernel twins (`<owner>.py`, `<owner>_torch.py`, `<owner>_numba.py`, `<owner>_triton.py`
    in one folder) give one function the same name in each: that is one concept, chosen by
    platform.kernel_impl, not a collision."""
    owners = {(str(Path(p).parent), _IMPL_SUFFIX.sub("", Path(p).stem)) for p in paths}
    return len(owners) == 1


def test_no_name_defined_in_two_modules():
    where: dict[str, dict[str, int]] = defaultdict(dict)
    for s in sources():
        for name, line in _defined_names(s.tree.body):
            if name.startswith("__") and name.endswith("__"):
                continue
            if name in PER_MODULE_NAMES:
                continue
            where[name].setdefault(s.rel, line)
    dups = {name: locs for name, locs in where.items()
            if len(locs) > 1 and not _implementations_of_one_owner(locs)}
    report = [f"{name}: " + ", ".join(f"{rel}:{line}" for rel, line in sorted(locs.items()))
              for name, locs in sorted(dups.items())]
    assert not report, (f"{len(report)} name(s) defined in more than one module "
                        "(define once, import elsewhere):\n  " + "\n  ".join(report))


# --------------------------------------------------------------------------- 4. repeated blocks


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _import_lines(tree: ast.AST) -> set[int]:
    """Import statements are a header, not logic a shared helper could hold."""
    return {line for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for line in range(node.lineno, node.end_lineno + 1)}


def _normalised_lines(s: Source) -> list[tuple[int, str]]:
    """(line number, text) of the lines that count: stripped, without comments,
    blank lines and docstrings."""
    raw = s.text.splitlines()
    comment_at: dict[int, int] = {}  # line -> column where its comment starts
    for tok in tokenize.generate_tokens(io.StringIO(s.text).readline):
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.start[1]
    skip = _docstring_lines(s.tree) | _import_lines(s.tree)
    out = []
    for i, line in enumerate(raw, start=1):
        if i in skip:
            continue
        if i in comment_at:
            line = line[: comment_at[i]]
        line = line.strip()
        if line:
            out.append((i, line))
    return out


def test_no_repeated_block_of_six_lines():
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    norm: dict[str, list[tuple[int, str]]] = {}
    for s in sources():
        lines = norm[s.rel] = _normalised_lines(s)
        texts = [t for _, t in lines]
        for i in range(len(texts) - DUP_WINDOW + 1):
            win = tuple(texts[i: i + DUP_WINDOW])
            if sum(len(t) > DUP_LONG_LINE for t in win) < DUP_MIN_LONG_LINES:
                continue
            occ = windows[win]
            # a run of identical lines matching itself one line further on is not a repeat
            if occ and occ[-1][0] == s.rel and i - occ[-1][1] < DUP_WINDOW:
                continue
            occ.append((s.rel, i))

    # every window start that is repeated elsewhere, with its other places
    dup_at: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for occ in windows.values():
        if len(occ) > 1:
            for here in occ:
                dup_at[here] = [o for o in occ if o != here]

    # merge overlapping repeated windows of a file into one block per run
    report = []
    seen_pairs: set[frozenset] = set()
    for rel in sorted(norm):
        lines = norm[rel]
        starts = sorted(i for (r, i) in dup_at if r == rel)
        run: list[int] = []
        for i in starts + [None]:
            if run and (i is None or i > run[-1] + 1):
                first, last = run[0], run[-1] + DUP_WINDOW - 1
                others = dup_at[(rel, run[0])]
                key = frozenset([(rel, run[0])] + others)
                if key not in seen_pairs:  # report A~B once, not again as B~A
                    seen_pairs.add(key)
                    where = ", ".join(f"{o_rel}:{norm[o_rel][o_i][0]}" for o_rel, o_i in others)
                    report.append(f"{rel}:{lines[first][0]}-{lines[last][0]} "
                                  f"({last - first + 1} lines) also at {where}")
                run = []
            if i is not None:
                run.append(i)
    assert not report, (f"{len(report)} block(s) of >= {DUP_WINDOW} lines repeated "
                        "(comments, blank lines and docstrings ignored):\n  " + "\n  ".join(report))
