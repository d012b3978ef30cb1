"""Text for the language-model jobs: generated in the package, byte-level, no downloads.

:func:`generate` writes a corpus from a small seeded grammar (sentences with agreement
between subject and verb, a few fixed phrases, and sums written out as ``12 + 7 = 19``),
so there is structure at several ranges for a model to learn: spelling, word order,
agreement and, for a larger model, arithmetic. The same seed gives the same text.

Tokens are printable ASCII (``' '`` .. ``'~'``) as 0..94 and the newline as 95: a
vocabulary of :data:`VOCAB` = 96. :func:`batch` cuts ``[m, b, T]`` windows of the
training part at offsets drawn from ``(seed, step, replica)``, so a resumed or
recovered run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import numpy as np

VOCAB = 96
NEWLINE = 95

_SUBJECTS = [("the cat", "s"), ("a dog", "s"), ("the old man", "s"), ("my sister", "s"), ("the river", "s"),
             ("the birds", "p"), ("two farmers", "p"), ("the children", "p"), ("our neighbours", "p"), ("the stars", "p")]
_VERBS = [("sees", "see"), ("follows", "follow"), ("likes", "like"), ("finds", "find"), ("remembers", "remember"), ("watches", "watch")]
_OBJECTS = ["the garden", "a red house", "the long road", "the morning light", "a small boat", "the quiet hill", "an open window"]
_ENDINGS = ["", " every day", " in the rain", " after dinner", " near the sea", " without a word"]
_PHRASES = ["once upon a time,", "in the end,", "meanwhile,", "later that year,"]


def generate(chars: int = 200_000, seed: int = 0) -> str:
    """About ``chars`` characters of generated text (whole lines), the same for the same seed."""
    if chars < 1:
        raise ValueError(f"chars must be >= 1, got {chars}")
    rng = np.random.default_rng(seed)
    lines: list[str] = []
    size = 0
    while size < chars:
        kind = rng.random()
        if kind < 0.2:
            a, b = (int(x) for x in rng.integers(0, 50, size=2))
            line = f"{a} + {b} = {a + b}."
        else:
            subj, number = _SUBJECTS[rng.integers(len(_SUBJECTS))]
            verb = _VERBS[rng.integers(len(_VERBS))][0 if number == "s" else 1]
            line = f"{subj} {verb} {_OBJECTS[rng.integers(len(_OBJECTS))]}{_ENDINGS[rng.integers(len(_ENDINGS))]}."
            if kind > 0.85:
                line = f"{_PHRASES[rng.integers(len(_PHRASES))]} {line}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


def encode(text: str) -> np.ndarray:
    """Text -> int64 tokens; refuses characters outside printable ASCII and newline."""
    raw = np.frombuffer(text.encode("ascii", errors="strict"), dtype=np.uint8).astype(np.int64)
    out = raw - 32
    out[raw == 10] = NEWLINE
    bad = (out < 0) | (out >= NEWLINE) & (raw != 10)
    if bad.any():
        at = int(np.argmax(bad))
        raise ValueError(f"character {text[at]!r} at {at} is outside the vocabulary (printable ASCII and newline)")
    return out


def decode(tokens: np.ndarray | list[int]) -> str:
    return "".join("\n" if t == NEWLINE else chr(int(t) + 32) for t in tokens)


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The training part (first) and the held-out part (last ``val_fraction``)."""
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def batch(tokens: np.ndarray, m: int, b: int, seq_len: int, *, seed: int, step: int, replica: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)`` of shape ``[m, b, seq_len]``: windows at offsets drawn from
    ``(seed, step, replica)``; targets are the inputs shifted by one token."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"{len(tokens)} tokens are too few for windows of seq_len={seq_len}; use more text or a shorter seq_len")
    rng = np.random.default_rng([seed, step, replica])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=m * b)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    windows = tokens[idx].reshape(m, b, seq_len + 1)
    return np.ascontiguousarray(windows[..., :-1]), np.ascontiguousarray(windows[..., 1:])


def eval_windows(tokens: np.ndarray, seq_len: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``limit`` non-overlapping windows of the held-out part, in order."""
    n = min(limit, (len(tokens) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"the held-out text ({len(tokens)} tokens) is shorter than one window of seq_len={seq_len}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]
