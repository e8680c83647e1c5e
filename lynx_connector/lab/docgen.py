"""Generated parts of docs/OPERATIONS.md: the configuration-keys table (from `LynxConfig`'s fields, types, defaults
and their `#:` comments in lynx_connector/config.py), the transfer-modes table (lynx_connector/modes.py) and the
data-flow picture (matplotlib PNG).

    python -m lynx_connector.lab.docgen            # rewrite the tables in docs/OPERATIONS.md and the PNG
    python -m lynx_connector.lab.docgen --check    # exit 1 when a table is stale (what the tests do)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "OPERATIONS.md"
FIGURE = ROOT / "docs" / "OPERATIONS-dataflow.png"
CONFIG_PY = ROOT / "lynx_connector" / "config.py"
BEGIN, END = "<!-- config-table:begin (generated: python -m lynx_connector.lab.docgen) -->", "<!-- config-table:end -->"
MODES_BEGIN = "<!-- modes-table:begin (generated: python -m lynx_connector.lab.docgen) -->"
MODES_END = "<!-- modes-table:end -->"


def field_comments() -> dict[str, str]:
    """`#:` comment block above each field of LynxConfig; a field without one shares the previous field's."""
    lines = CONFIG_PY.read_text().splitlines()
    tree = ast.parse(CONFIG_PY.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LynxConfig")
    out: dict[str, str] = {}
    last = ""
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#:"):
            block.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        last = " ".join(block) or last
        out[node.target.id] = last
    return out


def _type_name(tp: object) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return str(text).replace("typing.", "")


def config_table() -> str:
    from lynx_connector.config import LynxConfig

    comments = field_comments()
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(LynxConfig):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        meaning = comments.get(f.name, "").replace("|", "\\|")
        tp = _type_name(f.type).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{tp}` | `{default}` | {meaning} |")
    return "\n".join(rows)


def modes_table() -> str:
    from lynx_connector.modes import modes_table

    return modes_table()


def current_table(doc: str, begin: str = BEGIN, end: str = END) -> str | None:
    m = re.search(re.escape(begin) + r"\n(.*?)\n?" + re.escape(end), doc, re.S)
    return None if m is None else m.group(1)


def _tables() -> list[tuple[str, str, str]]:
    return [(BEGIN, END, config_table()), (MODES_BEGIN, MODES_END, modes_table())]


def write_table() -> bool:
    doc = new = DOC.read_text()
    for begin, end, table in _tables():
        block = f"{begin}\n{table}\n{end}"
        new = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _m, b=block: b, new, count=1, flags=re.S)
    if new != doc:
        DOC.write_text(new)
    return new != doc


def draw_figure(path: Path = FIGURE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig, ax = plt.subplots(figsize=(11, 5.6), dpi=110)
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 5.6)
    ax.axis("off")

    def box(x: float, y: float, w: float, h: float, title: str, body: str, color: str) -> None:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=color, ec="#333", lw=1.2))
        ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=11, weight="bold")
        ax.text(x + w / 2, y + h - 0.6, body, ha="center", va="top", fontsize=8.2, linespacing=1.35)

    def arrow(x0: float, y0: float, x1: float, y1: float, label: str, color: str = "#333", lw: float = 1.4,
              dy: float = 0.12, ls: str = "-") -> None:
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, color=color, lw=lw,
                                     linestyle=ls))
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + dy, label, ha="center", va="bottom", fontsize=8, color=color)

    box(0.2, 3.9, 2.0, 1.4, "client", "OpenAI API\n/v1/completions\n/v1/chat/completions", "#eeeeee")
    box(4.4, 3.9, 2.2, 1.4, "lynx proxy", "1) P: max_tokens=1,\n    do_remote_decode\n2) D: kv_transfer_params\n"
        "   (P host, side-channel port)", "#e8f0fe")
    box(0.2, 0.3, 3.6, 2.8, "prefill pod (P)", "vLLM + LynxConnector\nprefill -> KV (paged)\n"
        "encode: 4-bit anchor + 4-bit residual\ninto NIXL-registered staging\nside channel (zmq) :5600\n"
        "frees staging on D's done / lease_s", "#fdecea")
    box(7.2, 0.3, 3.6, 2.8, "decode pod (D)", "vLLM + LynxConnector\npulls anchor first (high priority),\n"
        "then residual (low priority)\ndecode on the anchor (speculative),\nverify when the residual lands\n"
        "timeout_s -> kv_load_failure_policy", "#e6f4ea")
    arrow(2.2, 4.6, 4.4, 4.6, "request / stream")
    arrow(5.0, 3.9, 2.6, 3.1, "1 prefill", dy=0.0)
    arrow(6.0, 3.9, 8.4, 3.1, "2 decode", dy=0.0)
    arrow(7.2, 1.25, 3.8, 1.25, "side channel: hello, query regions, done", color="#555", dy=0.06, ls="--")
    arrow(3.8, 2.15, 7.2, 2.15, "anchor stream (NIXL READ by D, first)", color="#c62828", lw=3.0)
    arrow(3.8, 0.6, 7.2, 0.6, "residual stream (chunked, after anchors)", color="#1565c0", lw=1.6)
    ax.text(5.5, 2.75, "NIXL / UCX (rdma, cuda_copy, tcp ...)", ha="center", fontsize=8.5, style="italic")
    ax.set_title("Lynx data flow: KV crosses P -> D as two priority streams", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        doc = DOC.read_text()
        ok = all(current_table(doc, begin, end) == table for begin, end, table in _tables())
        sys.stderr.write("" if ok else "docs/OPERATIONS.md tables are stale: python -m lynx_connector.lab.docgen\n")
        return 0 if ok else 1
    write_table()
    draw_figure()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
