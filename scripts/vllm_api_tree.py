"""The source trees ``scripts/check_vllm_api.py`` compares: a vLLM tree read with ``ast`` (``Tree``: modules,
classes, functions, re-exports and lazy ``__getattr__`` tables followed) and the descriptions of its symbols
(signatures, class members, decorators) that the comparison looks at. Nothing of the tree is imported."""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Sym:
    """A resolved name: ``kind`` module | class | function | value (``node`` its AST, ``module`` where)."""

    kind: str
    module: str
    node: Any = None
    annotation: Any = None  # values: the annotation node, resolved in ``module``


class Tree:
    """A source tree holding a ``vllm`` package (``root/vllm/...``), parsed lazily."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._mods: dict[str, ast.Module | None] = {}

    def module(self, mod: str) -> ast.Module | None:
        if mod not in self._mods:
            base = self.root.joinpath(*mod.split("."))
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
            self._mods[mod] = ast.parse(path.read_text(), str(path)) if path else None
        return self._mods[mod]

    def is_package(self, mod: str) -> bool:
        return self.root.joinpath(*mod.split("."), "__init__.py").is_file()

    def lookup(self, mod: str, name: str, depth: int = 0) -> Sym | None:
        """``name`` in module ``mod``: definitions, re-exports, lazy ``__getattr__`` tables, submodules."""
        tree = self.module(mod)
        if tree is None or depth > 20:
            return None
        found: Sym | None = None
        for node in _top_level(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = Sym("class" if isinstance(node, ast.ClassDef) else "function", mod, node)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found = Sym("value", mod, node)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                found = Sym("value", mod, node, node.annotation)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        src = _absolute(mod, node, self.is_package(mod))
                        found = self.lookup(src, alias.name, depth + 1) or (
                            Sym("module", f"{src}.{alias.name}") if self.module(f"{src}.{alias.name}") else None)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name or (alias.asname is None and alias.name == name):
                        found = Sym("module", alias.name if alias.asname else alias.name.split(".")[0])
        if found is not None:
            return found
        lazy = _lazy_table(tree).get(name)
        if lazy is not None:
            target, _, attr = lazy.partition(":")
            if target.startswith("."):
                target = (mod if self.is_package(mod) else mod.rsplit(".", 1)[0]) + target
            return self.lookup(target, attr or name, depth + 1)
        if self.module(f"{mod}.{name}") is not None:
            return Sym("module", f"{mod}.{name}")
        return None

    def resolve(self, mod: str, expr: ast.AST | None, depth: int = 0) -> Sym | None:
        """An expression of module ``mod`` (a base class, an annotation) to the vLLM symbol it names."""
        if expr is None or depth > 10:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            try:
                return self.resolve(mod, ast.parse(expr.value, mode="eval").body, depth + 1)
            except SyntaxError:
                return None
        if isinstance(expr, ast.Name):
            return self.lookup(mod, expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.resolve(mod, expr.value, depth + 1)
            return self.member(base, expr.attr) if base else None
        if isinstance(expr, ast.Subscript):  # Foo[T] -> Foo; Optional[Foo] -> Foo; list[Foo]: not a Foo
            if _is_optional(expr.value):
                return _first_class(*(self.resolve(mod, e, depth + 1) for e in _elements(expr.slice)))
            return _first_class(self.resolve(mod, expr.value, depth + 1))
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):  # Foo | None
            return _first_class(self.resolve(mod, expr.left, depth + 1), self.resolve(mod, expr.right, depth + 1))
        return None

    def member(self, sym: Sym, attr: str, seen: frozenset[int] = frozenset()) -> Sym | None:
        """``attr`` of a module or a class (its body, ``self.attr`` assignments, then its bases)."""
        if sym.kind == "module":
            return self.lookup(sym.module, attr)
        if sym.kind != "class" or id(sym.node) in seen:
            return None
        own = class_members(sym.node).get(attr)
        if own is not None:
            node, ann = own
            kind = ("function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                    "class" if isinstance(node, ast.ClassDef) else "value")
            return Sym(kind, sym.module, node, ann)
        for base in sym.node.bases:
            b = self.resolve(sym.module, base)
            if b is not None and b.kind == "class":
                hit = self.member(b, attr, seen | {id(sym.node)})
                if hit is not None:
                    return hit
        return None

    def type_of(self, sym: Sym) -> Sym | None:
        """The class a value's annotation or a function's return annotation names (to follow a chain)."""
        if sym.kind == "value" and sym.annotation is not None:
            t = self.resolve(sym.module, sym.annotation)
        elif sym.kind == "value" and isinstance(getattr(sym.node, "value", None), ast.Call):
            made = self.resolve(sym.module, sym.node.value.func)  # x = Foo(...) / x = make_foo(...) -> Foo
            if made is not None and made.kind == "function" and made.node.returns is not None:
                made = self.resolve(made.module, made.node.returns)
            t = made
        elif sym.kind == "function" and sym.node.returns is not None and _is_property(sym.node):
            t = self.resolve(sym.module, sym.node.returns)
        else:
            return None
        return t if t is not None and t.kind == "class" else None

    def methods(self, sym: Sym | None, seen: frozenset[int] = frozenset()) -> set[str]:
        """Every method name of a class and its bases."""
        if sym is None or sym.kind != "class" or id(sym.node) in seen:
            return set()
        out = {n for n, (node, _) in class_members(sym.node).items()
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for base in sym.node.bases:
            out |= self.methods(self.resolve(sym.module, base), seen | {id(sym.node)})
        return out

    def abstract_methods(self, sym: Sym, seen: frozenset[int] = frozenset()) -> set[str]:
        """Abstract methods of a class and its bases not implemented on the way down."""
        if sym.kind != "class" or id(sym.node) in seen:
            return set()
        out: set[str] = set()
        for base in sym.node.bases:
            b = self.resolve(sym.module, base)
            if b is not None:
                out |= self.abstract_methods(b, seen | {id(sym.node)})
        for name, (node, _) in class_members(sym.node).items():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "abstractmethod" in _decorators(node):
                out.add(name)
            else:
                out.discard(name)
        return out


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module statements, including those under top-level if/try (TYPE_CHECKING, fallbacks)."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            out += _top_level(node.body) + [s for h in node.handlers for s in _top_level(h.body)]
            out += _top_level(node.orelse) + _top_level(node.finalbody)
        else:
            out.append(node)
    return out


def _absolute(mod: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.split(".")
    base = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    """``{"Name": "module:attr"}`` dict literals of a module that has a ``__getattr__`` (vllm/__init__.py)."""
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return {}
    out: dict[str, str] = {}
    for node in _top_level(tree.body):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict):
            for k, v in zip(value.keys, value.values, strict=True):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                    out[str(k.value)] = v.value
    return out


def _elements(node: ast.AST) -> list[ast.AST]:
    return list(node.elts) if isinstance(node, ast.Tuple) else [node]


def _is_optional(node: ast.AST) -> bool:
    return (node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")) in ("Optional", "Union")


def _first_class(*syms: Sym | None) -> Sym | None:
    return next((s for s in syms if s is not None and s.kind == "class"), None)


def _decorators(fn: ast.AST) -> list[str]:
    return [ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in getattr(fn, "decorator_list", [])]


def _is_property(fn: ast.AST) -> bool:
    return any(d in ("property", "cached_property") for d in _decorators(fn))


def class_members(cls: ast.ClassDef) -> dict[str, tuple[ast.AST, ast.AST | None]]:
    """Names a class defines: body definitions and assignments, ``self.x`` stores in its methods."""
    out: dict[str, tuple[ast.AST, ast.AST | None]] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name not in out or not any(d.endswith("setter") for d in _decorators(node)):
                out[node.name] = (node, None)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = (node, node.annotation)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, (node, None))
    for node in ast.walk(cls):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target] if target is not None else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                ann = node.annotation if isinstance(node, ast.AnnAssign) else None
                if t.attr not in out or (ann is not None and out[t.attr][1] is None):
                    out[t.attr] = (node, ann)
    return out


def describe(tree: Tree, sym: Sym | None) -> dict[str, Any] | None:
    """What matters of a symbol for callers: its kind, parameters and decorators, a class's fields and
    ``__init__``; None when missing."""
    if sym is None:
        return None
    out: dict[str, Any] = {"kind": sym.kind}
    if sym.kind == "function":
        out.update(signature(sym.node))
    elif sym.kind == "class":
        fields = [(n.target.id, n.value is not None) for n in sym.node.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        out["fields"] = [f"{name}{'=' if default else ''}" for name, default in fields]
        init = tree.member(sym, "__init__")
        if init is not None and init.kind == "function":
            out["init"] = signature(init.node)
    elif sym.kind == "value" and sym.annotation is not None:
        out["annotation"] = ast.unparse(sym.annotation)
    return out


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    a = fn.args
    params: list[str] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults, strict=True)):
        params.append(arg.arg + ("=" if d is not None else "") + ("/" if i == len(a.posonlyargs) - 1 else ""))
    if a.vararg:
        params.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        params.append("*")
    params += [k.arg + ("=" if d is not None else "") for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        params.append("**" + a.kwarg.arg)
    anns = {x.arg: ast.unparse(x.annotation) for x in [*positional, *a.kwonlyargs] if x.annotation is not None}
    if fn.returns is not None:
        anns["return"] = ast.unparse(fn.returns)
    keep = {"staticmethod", "classmethod", "property", "cached_property", "abstractmethod"}
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) else fn.body  # without the docstring
    digest = hashlib.sha256("\n".join(ast.dump(b) for b in body).encode()).hexdigest()[:16]
    return {"params": params, "decorators": sorted(d for d in _decorators(fn) if d in keep), "annotations": anns,
            "body": digest}


def accepts(desc: dict[str, Any] | None, npos: int, keywords: list[str]) -> str | None:
    """Why a call with ``npos`` positional arguments and ``keywords`` does not fit, or None."""
    if desc is None:
        return "missing"
    sig = desc.get("init") if desc["kind"] == "class" else desc
    if sig is None or "params" not in sig:  # a class without __init__ here: dataclass/struct fields
        names = [f.rstrip("=") for f in desc.get("fields", [])]
        bad = [k for k in keywords if k not in names]
        return f"no field {', '.join(bad)}" if bad and names else None
    params = [p.rstrip("=/") for p in sig["params"]]
    if desc["kind"] == "class" or "staticmethod" not in sig["decorators"]:
        params = params[1:] if params and params[0] in ("self", "cls") else params
    if any(p.startswith("**") for p in params):
        return None
    names = {p.lstrip("*") for p in params if not p.startswith("*")}
    bad = [k for k in keywords if k not in names]
    if bad:
        return f"no parameter {', '.join(bad)}"
    positional = [p for p in params if p != "*" and not p.startswith("*")]
    if "*" in params:
        positional = positional[: params.index("*")]
    if npos > len(positional) and not any(p.startswith("*") and p != "*" for p in params):
        return f"takes {len(positional)} positional arguments, called with {npos}"
    return None
