"""A real-text task: the English documentation that every CPython ships, character by character.

The corpus is `pydoc_data.topics.topics`, the help() texts of the standard library (a dict of
79 topic names -> text, about 465,000 characters and 103 distinct characters on CPython
3.11.7). It needs no download and is the same on every machine with the same Python version;
`Corpus.sha256` and `Corpus.python` record exactly which text was used.

* Split: by topic, never within one, and only topics that copy little from the others may be
  held out, so that the held-out text measures generalisation rather than memorised copies (the
  topics repeat each other's passages: "compound" contains the "for", "while", "try", "with"
  and "class" sections, "specialnames" contains "numeric-types" and "sequence-types", "if" and
  "else" are the same text). The rule, all computed by `split_topics`:
  1. a topic's overlap (`topic_overlaps`) is the fraction of its windows of OVERLAP_WINDOW (32)
     characters that occur verbatim, as exact substrings, inside the text of some other topic;
  2. a topic is eligible for the held-out split only if its overlap is below MAX_OVERLAP (0.05);
  3. eligible topics are ordered by the sha256 of their name and taken into the held-out split
     in that order until it holds `heldout_fraction` of all characters; everything else,
     including every ineligible topic, is training. If the eligible topics together hold less
     than `heldout_fraction` of the characters, the split is refused (ValueError), never
     silently smaller.
  Deterministic, and independent of dict order and PYTHONHASHSEED. What copying is left after
  the split is measured and kept: `Corpus.heldout_overlap` is the fraction of the held-out
  text's 32-character windows that occur verbatim in the training text (`window_overlap`).
* Symbols: every character of the training text, sorted by code point (id i = alphabet[i]),
  plus one last id, len(alphabet), for "unknown" (held-out characters never seen in training).
* References, in nats per character, that the lab states its verdicts against: the add-one
  unigram (`unigram_cross_entropy`) and an interpolated Witten-Bell character n-gram
  (`ngram_cross_entropy`) trained on the training text and scored on the held-out text.
* Windows: `sample_windows` cuts (n, length) int32 windows at seeded uniform offsets; the lab
  draws seq_len + 1 tokens per window (inputs window[:-1], targets window[1:]).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import platform
import sys
from dataclasses import dataclass, field

import numpy as np

SEPARATOR = "\n\n"  # between topics when their texts are joined into one sequence
UNKNOWN_CHAR = "\ufffd"  # what `decode` writes for the unknown id
OVERLAP_WINDOW = 32  # characters per window when measuring verbatim copying between texts
MAX_OVERLAP = 0.05  # a topic may be held out only if less than this share of its windows is copied

# The n-gram order of `reference`: the order in 1..8 with the lowest held-out cross-entropy on
# the real corpus (CPython 3.11.7, heldout_fraction 0.1, OVERLAP_WINDOW 32, MAX_OVERLAP 0.05:
# 12 held-out topics, 409,588 training and 55,536 held-out characters, vocab 102 + 1; residual
# held-out overlap with the training text 0.078 / 0.012 / 0.0004 at 16 / 32 / 64-character
# windows), measured once:
#   order:       1      2      3      4      5      6      7      8
#   nats/char: 3.2763 2.6440 2.1405 1.8530 1.7985 1.8584 1.9532 2.0473
# (add-one unigram: 3.2763; order 9: 2.1333). With copied topics kept out of the held-out split,
# longer contexts stop paying off after order 5 and then overfit the training text.
REFERENCE_ORDER = 5


class CorpusError(RuntimeError):
    """The corpus cannot be read on this Python (its pydoc_data module is missing)."""


# ------------------------------------------------------------------------------------
# The corpus: topics, split, symbols
# ------------------------------------------------------------------------------------


def load_topics() -> dict[str, str]:
    """The documentation topics of this Python: {topic name: text}, from pydoc_data.topics."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:
        raise CorpusError(
            f"the text task needs the standard-library module pydoc_data.topics, which "
            f"{sys.executable} (Python {platform.python_version()}) does not have ({err}); "
            f"install the full CPython standard library or use a Python that ships pydoc_data "
            f"(e.g. a python.org, uv or pyenv build)"
        ) from err
    return dict(topics)


def corpus_sha256(topics: dict[str, str]) -> str:
    """Hex sha256 of the topics' names and texts in sorted-name order (JSON, sorted keys)."""
    return hashlib.sha256(json.dumps(topics, sort_keys=True).encode()).hexdigest()


_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier that mixes a window's packed words into one hash


def _window_owners(texts: list[str], window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every `window`-character window of every text (windows never straddle two texts;
    texts in order, windows in order within a text): (owner, lo, hi) int arrays, where owner is
    the index of the window's text and lo / hi are the smallest / largest index of a text that
    contains the same string as a window. So the window also occurs in another text iff lo != hi.

    Exact: each window's characters are packed losslessly into a few uint64 words (dense symbol
    ids of ceil(log2(#symbols)) bits each), equal windows are grouped by sorting on a hash of
    those words, and if any two different windows share a hash the grouping falls back to a full
    lexicographic sort of the words.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    codes = [np.frombuffer(text.encode("utf-32-le"), np.uint32) for text in texts]
    counts = np.array([max(len(c) - window + 1, 0) for c in codes], np.int64)
    owner = np.repeat(np.arange(len(texts), dtype=np.int64), counts)
    if not len(owner):
        return owner, owner, owner
    symbols, dense = np.unique(np.concatenate(codes), return_inverse=True)
    bits = max(1, (len(symbols) - 1).bit_length())
    per_word = 64 // bits
    keys = np.zeros((-(-window // per_word), len(owner)), np.uint64)
    dense = dense.astype(np.uint64)
    start = out = 0
    for c, n in zip(codes, counts, strict=True):
        d = dense[start:start + len(c)]
        start += len(c)
        for j in range(window):
            keys[j // per_word, out:out + n] |= d[j:j + n] << np.uint64(bits * (j % per_word))
        out += n
    hashes = np.zeros(len(owner), np.uint64)
    for words in keys:
        hashes = (hashes ^ words) * _MIX  # wraps modulo 2**64
    order = np.argsort(hashes, kind="stable")
    ordered = keys[:, order]
    differs = np.any(ordered[:, 1:] != ordered[:, :-1], axis=0)  # window i+1 != window i (sorted)
    if np.any(differs & (hashes[order][1:] == hashes[order][:-1])):  # a collision: sort exactly
        order = np.lexsort(keys)
        ordered = keys[:, order]
        differs = np.any(ordered[:, 1:] != ordered[:, :-1], axis=0)
    group_starts = np.concatenate([[0], np.flatnonzero(differs) + 1])
    lo = np.minimum.reduceat(owner[order], group_starts)
    hi = np.maximum.reduceat(owner[order], group_starts)
    group = np.empty(len(owner), np.int64)
    group[order] = np.cumsum(np.concatenate([[0], differs]))
    return owner, lo[group], hi[group]


def topic_overlaps(topics: dict[str, str], window: int = OVERLAP_WINDOW) -> dict[str, float]:
    """{name: the fraction of the topic's `window`-character windows (counted with repetition)
    that occur verbatim inside the text of at least one OTHER topic}.

    Windows are exact substrings of one topic's text (a window straddling the join of two texts
    is not a copy of either). A topic shorter than `window` has no windows and overlap 0.0.
    A topic identical to another has overlap 1.0. Exact; well under a second for the whole corpus.
    """
    names = list(topics)
    owner, lo, hi = _window_owners([topics[name] for name in names], window)
    copied = np.bincount(owner, weights=lo != hi, minlength=len(names))
    windows = np.bincount(owner, minlength=len(names))
    return {name: float(copied[i] / windows[i]) if windows[i] else 0.0 for i, name in enumerate(names)}


def window_overlap(text: str, reference: str, window: int = OVERLAP_WINDOW) -> float:
    """The fraction of `text`'s `window`-character windows (counted with repetition) that occur
    verbatim somewhere in `reference`; 0.0 if `text` is shorter than `window`. Exact."""
    owner, _, hi = _window_owners([text, reference], window)
    own = owner == 0
    return float(np.mean(hi[own] == 1)) if np.any(own) else 0.0


def split_topics(topics: dict[str, str], heldout_fraction: float = 0.1, window: int = OVERLAP_WINDOW,
                 max_overlap: float = MAX_OVERLAP) -> tuple[list[str], list[str]]:
    """Split topic names into (train, heldout), each sorted by name.

    A topic is eligible for held-out only if `topic_overlaps(topics, window)[name] < max_overlap`.
    Eligible names are ordered by sha256 of their utf-8 bytes; held-out takes them in that order
    until its characters (the texts' lengths) reach heldout_fraction of all characters (of ALL
    topics). So the held-out fraction lies in [heldout_fraction, heldout_fraction + the largest
    eligible topic's share). Every other topic, eligible or not, is training.

    Raises ValueError if heldout_fraction is outside (0, 1), if the eligible topics together fall
    short of heldout_fraction (the message gives the share they reach), or if either side would
    be empty.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    total = sum(len(text) for text in topics.values())
    target = heldout_fraction * total
    overlaps = topic_overlaps(topics, window)
    eligible = [name for name in topics if overlaps[name] < max_overlap]
    order = sorted(eligible, key=lambda name: hashlib.sha256(name.encode("utf-8")).digest())
    heldout, chars = [], 0
    for name in order:
        if chars >= target:
            break
        heldout.append(name)
        chars += len(topics[name])
    if chars < target:
        raise ValueError(
            f"only {len(eligible)} of {len(topics)} topics are eligible for the held-out split (less than "
            f"{max_overlap} of their {window}-character windows copied from other topics), and together they "
            f"hold {chars} of {total} characters = {chars / total:.4f}, short of heldout_fraction="
            f"{heldout_fraction} ({math.ceil(target)} characters); lower heldout_fraction or raise max_overlap"
        )
    train = sorted(set(topics) - set(heldout))
    if not train or not heldout:
        raise ValueError(
            f"heldout_fraction={heldout_fraction} of {len(topics)} topics ({total} characters) "
            f"leaves {len(train)} training and {len(heldout)} held-out topics; both must be non-empty"
        )
    return train, sorted(heldout)


def encode(text: str, alphabet: str) -> np.ndarray:
    """text -> (len(text),) int32 ids: id i is alphabet[i] (alphabet sorted by code point);
    characters not in the alphabet get the unknown id len(alphabet)."""
    symbols = np.frombuffer(alphabet.encode("utf-32-le"), np.uint32)
    chars = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    if np.any(symbols[1:] <= symbols[:-1]):
        raise ValueError("alphabet must be strictly increasing by code point")
    idx = np.minimum(np.searchsorted(symbols, chars), max(len(symbols) - 1, 0))
    known = symbols[idx] == chars if len(symbols) else np.zeros(len(chars), bool)
    return np.where(known, idx, len(alphabet)).astype(np.int32)


def decode(ids: np.ndarray, alphabet: str) -> str:
    """ids (n,) -> text; the unknown id len(alphabet) becomes U+FFFD."""
    table = np.array(list(alphabet) + [UNKNOWN_CHAR])
    return "".join(table[np.asarray(ids)].tolist())


@dataclass(frozen=True)
class Corpus:
    """The character-level corpus, split by topic.

    train: (n_train,) int32 ids of the training topics' texts, joined in sorted-name order
        with SEPARATOR between topics; heldout: (n_heldout,) int32, the same for held-out topics.
    alphabet: every character of the training text, sorted by code point (id i = alphabet[i]);
        vocab = len(alphabet) + 1, the last id being "unknown" (held-out characters only).
    sha256: hex sha256 of the topics as read (`corpus_sha256`); python: the Python version.
    heldout_overlap: residual contamination, the fraction of the held-out text's (as joined)
        `overlap_window`-character windows that occur verbatim in the training text (as joined).
    Arrays are read-only (a Corpus is cached and shared).
    """

    alphabet: str
    vocab: int
    sha256: str
    python: str
    train_topics: tuple[str, ...]
    heldout_topics: tuple[str, ...]
    overlap_window: int
    heldout_overlap: float
    train: np.ndarray = field(repr=False, compare=False)
    heldout: np.ndarray = field(repr=False, compare=False)

    @property
    def unknown(self) -> int:
        """The unknown id (= len(alphabet) = vocab - 1)."""
        return len(self.alphabet)


def build_corpus(topics: dict[str, str], heldout_fraction: float = 0.1, window: int = OVERLAP_WINDOW,
                 max_overlap: float = MAX_OVERLAP) -> Corpus:
    """Split `topics` (see `split_topics`), join each side's texts, encode them and measure the
    held-out text's residual overlap with the training text (`window_overlap`)."""
    train_names, heldout_names = split_topics(topics, heldout_fraction, window, max_overlap)
    train_text = SEPARATOR.join(topics[name] for name in train_names)
    heldout_text = SEPARATOR.join(topics[name] for name in heldout_names)
    alphabet = "".join(sorted(set(train_text)))
    train, heldout = encode(train_text, alphabet), encode(heldout_text, alphabet)
    train.setflags(write=False)
    heldout.setflags(write=False)
    return Corpus(
        alphabet=alphabet, vocab=len(alphabet) + 1, sha256=corpus_sha256(topics),
        python=platform.python_version(), train_topics=tuple(train_names),
        heldout_topics=tuple(heldout_names), overlap_window=window,
        heldout_overlap=window_overlap(heldout_text, train_text, window), train=train, heldout=heldout,
    )


@functools.lru_cache(maxsize=8)
def load_corpus(heldout_fraction: float = 0.1) -> Corpus:
    """This Python's documentation corpus (cached; raises CorpusError without pydoc_data)."""
    return build_corpus(load_topics(), heldout_fraction)


def sample_windows(ids: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """n windows (n, length) int32 of `ids`, starting at offsets drawn uniformly from
    [0, len(ids) - length] by np.random.default_rng(seed)."""
    ids = np.asarray(ids)
    if not 1 <= length <= len(ids):
        raise ValueError(f"window length {length} must be in [1, len(ids)={len(ids)}]")
    if n < 0:
        raise ValueError(f"number of windows must be >= 0, got {n}")
    starts = np.random.default_rng(seed).integers(0, len(ids) - length + 1, size=n)
    return ids[starts[:, None] + np.arange(length)].astype(np.int32)


# ------------------------------------------------------------------------------------
# References (nats per character)
# ------------------------------------------------------------------------------------


def _check_ids(name: str, ids: np.ndarray, vocab: int) -> np.ndarray:
    """ids as a 1-D int64 array with every id in [0, vocab)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{name} ids must be in [0, vocab={vocab}), got [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int64)


def unigram_cross_entropy(train: np.ndarray, test: np.ndarray, vocab: int) -> float:
    """Mean -log p(w) over `test` of the add-one unigram of `train`:
    p(w) = (count of w in train + 1) / (len(train) + vocab)."""
    train, test = _check_ids("train", train, vocab), _check_ids("test", test, vocab)
    if test.size == 0:
        raise ValueError("test is empty")
    counts = np.bincount(train, minlength=vocab).astype(np.float64)
    p = (counts[test] + 1.0) / (len(train) + vocab)
    return float(-np.mean(np.log(p)))


def _context_codes(x: np.ndarray, k: int, vocab: int) -> np.ndarray:
    """(len(x) - k,) int64 codes of the contexts x[i-k:i] for i = k..len(x)-1:
    sum over m = 1..k of x[i-m] * vocab**(m-1) (newest symbol in the lowest digit)."""
    codes = np.zeros(len(x) - k, np.int64)
    for m in range(1, k + 1):
        codes += x[k - m:len(x) - m] * vocab ** (m - 1)
    return codes


def _lookup(keys: np.ndarray, values: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """values[j] where keys[j] == query (keys sorted and unique), 0 where a query is absent."""
    if len(keys) == 0:
        return np.zeros(len(queries), values.dtype)
    idx = np.minimum(np.searchsorted(keys, queries), len(keys) - 1)
    return np.where(keys[idx] == queries, values[idx], 0)


def ngram_cross_entropy(train: np.ndarray, test: np.ndarray, vocab: int, order: int) -> float:
    """Mean -log p over every position of `test` of an interpolated Witten-Bell n-gram of `train`.

    p_WB(w | h) = (c(h, w) + T(h) p_WB(w | h')) / (c(h) + T(h)), where, counted over `train`,
    c(h, w) = occurrences of context h followed by w, c(h) = occurrences of h followed by any
    symbol, T(h) = number of distinct symbols seen after h, and h' = h without its oldest
    symbol. An unseen context (c(h) = 0) backs off fully: p_WB(w | h) = p_WB(w | h'). The empty
    context (order 1) has c = len(train), T = distinct symbols of train, and backs off to the
    uniform 1/vocab. Position j of `test` is scored with the context test[max(0, j-order+1):j].
    """
    train, test = _check_ids("train", train, vocab), _check_ids("test", test, vocab)
    if order < 1:
        raise ValueError(f"order must be >= 1, got {order}")
    if test.size == 0:
        raise ValueError("test is empty")
    if vocab ** order > np.iinfo(np.int64).max:
        raise ValueError(f"vocab**order = {vocab}**{order} overflows the int64 context codes")
    counts = np.bincount(train, minlength=vocab).astype(np.float64)
    seen = np.count_nonzero(counts)
    p = (counts[test] + seen / vocab) / (len(train) + seen) if len(train) else np.full(len(test), 1.0 / vocab)
    for k in range(1, order):  # context length k: refine the positions j >= k
        if len(train) <= k or len(test) <= k:
            break  # no context of length k in train (all back off) or none to score in test
        h = _context_codes(train, k, vocab)
        contexts, c_h = np.unique(h, return_counts=True)
        pairs, c_hw = np.unique(h * vocab + train[k:], return_counts=True)
        _, t_h = np.unique(pairs // vocab, return_counts=True)  # aligned with `contexts`
        q = _context_codes(test, k, vocab)
        qc_h = _lookup(contexts, c_h, q).astype(np.float64)
        qt_h = _lookup(contexts, t_h, q).astype(np.float64)
        qc_hw = _lookup(pairs, c_hw, q * vocab + test[k:]).astype(np.float64)
        lower = p[k:]
        with np.errstate(divide="ignore", invalid="ignore"):
            p[k:] = np.where(qc_h > 0, (qc_hw + qt_h * lower) / (qc_h + qt_h), lower)
    return float(-np.mean(np.log(p)))


def reference(corpus: Corpus, order: int = REFERENCE_ORDER) -> dict[str, float]:
    """The held-out references of `corpus` (nats/char): {"unigram": add-one unigram,
    "ngram": Witten-Bell n-gram of `order`, "order": order}, both trained on corpus.train."""
    return {
        "unigram": unigram_cross_entropy(corpus.train, corpus.heldout, corpus.vocab),
        "ngram": ngram_cross_entropy(corpus.train, corpus.heldout, corpus.vocab, order),
        "order": order,
    }


def _main() -> None:
    """Print the split, its residual overlaps and the references at orders 1..8 with timings."""
    import time

    start = time.perf_counter()
    topics = load_topics()
    corpus = load_corpus()
    print(f"corpus built in {time.perf_counter() - start:.2f} s: {corpus}")
    total = sum(map(len, topics.values()))
    heldout_chars = sum(len(topics[name]) for name in corpus.heldout_topics)
    print(f"held-out topics {', '.join(corpus.heldout_topics)}: {heldout_chars} of {total} topic characters "
          f"({heldout_chars / total:.4f})")
    print(f"train {len(corpus.train)} chars, held-out {len(corpus.heldout)} chars (joined), vocab {corpus.vocab}, "
          f"unknown held-out chars {int(np.sum(corpus.heldout == corpus.unknown))}")
    train_text = SEPARATOR.join(topics[name] for name in corpus.train_topics)
    heldout_text = SEPARATOR.join(topics[name] for name in corpus.heldout_topics)
    for window in (16, OVERLAP_WINDOW, 64, 128):
        print(f"held-out {window}-char windows found in the training text: "
              f"{window_overlap(heldout_text, train_text, window):.4f}")
    print(f"unigram (add-one) {unigram_cross_entropy(corpus.train, corpus.heldout, corpus.vocab):.4f} nats/char, "
          f"ln(vocab) {math.log(corpus.vocab):.4f}")
    for order in range(1, 9):
        start = time.perf_counter()
        ce = ngram_cross_entropy(corpus.train, corpus.heldout, corpus.vocab, order)
        print(f"order {order}: {ce:.4f} nats/char ({time.perf_counter() - start:.3f} s)")


if __name__ == "__main__":
    _main()
