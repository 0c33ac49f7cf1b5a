"""Tests of the character-level documentation corpus (experiments/stability/text.py).

The split is checked against its rule (only topics copying less than MAX_OVERLAP of their
OVERLAP_WINDOW-character windows from other topics are eligible; eligible names in sha256 order,
by topic, the held-out share of characters; refusal when the eligible topics fall short) and for
determinism across dict order and PYTHONHASHSEED. The overlap measures are checked against a
brute-force substring search on crafted texts, and the real split's residual contamination (held-out
windows found verbatim in the training text) is checked to be small. The n-gram reference is
checked three ways: against closed-form Witten-Bell probabilities worked out by hand on tiny
texts, against a slow dictionary implementation written straight from the formula (random texts,
orders 1..5), and by normalisation (sum over w of p(w | h) = 1). A deliberately wrong smoothing
(T(h) replaced by 1) is shown to miss both the hand values and the slow implementation.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import platform
import random
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

import experiments.stability.text as text_module
from experiments.stability.text import (
    MAX_OVERLAP,
    OVERLAP_WINDOW,
    REFERENCE_ORDER,
    SEPARATOR,
    UNKNOWN_CHAR,
    Corpus,
    CorpusError,
    build_corpus,
    corpus_sha256,
    decode,
    encode,
    load_corpus,
    load_topics,
    ngram_cross_entropy,
    reference,
    sample_windows,
    split_topics,
    topic_overlaps,
    unigram_cross_entropy,
    window_overlap,
)

ROOT = Path(__file__).resolve().parents[1]

# The corpus REFERENCE_ORDER was measured on (CPython 3.11.7's pydoc_data.topics), and its held-out topics.
MEASURED_SHA256 = "37b51a0283fe86090af40650ef680bba22b90f74777f29909eceb83e57cc7ff1"
MEASURED_HELDOUT = ("assert", "atom-identifiers", "await", "bltin-type-objects", "booleans", "debugger", "lists",
                    "power", "slicings", "specialattrs", "string-methods", "typesmodules")


@pytest.fixture(scope="module")
def topics() -> dict[str, str]:
    return load_topics()


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus()


@pytest.fixture(scope="module")
def overlaps(topics) -> dict[str, float]:
    return topic_overlaps(topics)


def sha_order(names) -> list[str]:
    return sorted(names, key=lambda name: hashlib.sha256(name.encode("utf-8")).hexdigest())


def brute_overlap(text: str, others: list[str], window: int) -> float:
    """The fraction of text's windows found by `in` in at least one of `others` (0.0 without windows)."""
    windows = [text[i:i + window] for i in range(len(text) - window + 1)]
    return sum(any(w in other for other in others) for w in windows) / len(windows) if windows else 0.0


def ids(text: str, symbols: str = "abc") -> np.ndarray:
    """Tiny texts as ids: symbol i of `symbols` is id i."""
    return np.array([symbols.index(ch) for ch in text], np.int32)


# ------------------------------------------------------------------------------------
# Split
# ------------------------------------------------------------------------------------


def test_split_is_by_topic_disjoint_and_covers_every_topic(topics):
    train, heldout = split_topics(topics)
    assert train == sorted(train) and heldout == sorted(heldout)
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == set(topics)
    assert len(train) + len(heldout) == len(topics)


def test_split_follows_the_sha256_rule_over_eligible_topics(corpus, topics, overlaps):
    fraction = 0.1  # load_corpus's default; corpus.heldout_topics is split_topics(topics, 0.1)[1] (tested below)
    heldout = list(corpus.heldout_topics)
    order = sha_order(name for name in topics if overlaps[name] < MAX_OVERLAP)
    assert set(heldout) == set(order[:len(heldout)])  # a prefix of the sha256 order of the eligible topics
    total = sum(map(len, topics.values()))
    share = sum(len(topics[name]) for name in heldout) / total
    largest = max(len(topics[name]) for name in order) / total
    assert fraction <= share < fraction + largest
    # the prefix one topic shorter would fall below the fraction: held-out stops as soon as it is reached
    assert sum(len(topics[name]) for name in order[:len(heldout) - 1]) < fraction * total
    # the rule skips copied topics: some ineligible topic comes before the last held-out one in plain sha256 order
    skipped = sha_order(topics)[:sha_order(topics).index(order[len(heldout) - 1])]
    assert any(overlaps[name] >= MAX_OVERLAP for name in skipped)


def test_split_never_holds_out_an_ineligible_topic(corpus, topics, overlaps):
    train, heldout = corpus.train_topics, corpus.heldout_topics
    assert all(overlaps[name] < MAX_OVERLAP for name in heldout)
    ineligible = {name for name in topics if overlaps[name] >= MAX_OVERLAP}
    assert ineligible <= set(train)
    # the copies named in the module docstring, and identical topics, stay in training
    assert topics["if"] == topics["else"] and overlaps["if"] == overlaps["else"] == 1.0
    for name in ("if", "else", "compound", "specialnames", "numeric-types", "sequence-types", "for", "while",
                 "try", "with", "class"):
        assert overlaps[name] >= MAX_OVERLAP and name in train, name
    assert len(ineligible) > len(topics) // 3  # copying is widespread, so the filter matters


def test_topic_overlaps_match_brute_force_on_crafted_texts(monkeypatch):
    source = "the quick brown fox jumps over the lazy dog"
    topics = {
        "source": source,
        "copy": source[4:30],  # every window also in "source": overlap 1
        "unique": "zyxwvutsrqponmlk",  # nothing in common with anything
        "half": source[:12] + "ZZZZZZZZZZZZ",  # 12 + 12 chars: 9 of 21 windows of 4 copied
        "twin1": "abcdefgh ijkl", "twin2": "abcdefgh ijkl",  # identical texts: both overlap 1
        "short": "fox",  # shorter than the window: no windows, overlap 0
    }
    window = 4
    got = topic_overlaps(topics, window)
    for name, text in topics.items():
        others = [other for key, other in topics.items() if key != name]
        assert got[name] == pytest.approx(brute_overlap(text, others, window), abs=1e-15), name
    assert got["copy"] == got["twin1"] == got["twin2"] == 1.0
    assert got["unique"] == got["short"] == 0.0
    assert got["half"] == pytest.approx(9 / 21)
    assert 0 < got["source"] < 1  # its middle is copied by "copy", its end by nobody
    monkeypatch.setattr(text_module, "_MIX", np.uint64(0))  # every hash 0: the exact fallback sort must group
    assert topic_overlaps(topics, window) == got
    assert window_overlap(topics["half"], topics["source"], window) == got["half"]
    monkeypatch.undo()
    # a copied topic is never held out, a unique one may be, whatever the sha256 order says
    for fraction in (0.01, 0.05, 0.1, 0.13):
        train, heldout = split_topics(topics, fraction, window=window, max_overlap=0.05)
        assert {"copy", "twin1", "twin2", "half", "source"} <= set(train), (fraction, heldout)
    train, heldout = split_topics(topics, 0.1, window=window, max_overlap=0.05)
    assert set(heldout) <= {"unique", "short"} and "unique" in heldout
    with pytest.raises(ValueError, match="only 2 of 7 topics"):  # "unique" + "short" hold 19 of 138 characters
        split_topics(topics, 0.2, window=window, max_overlap=0.05)


def test_topic_overlaps_agree_with_brute_force_on_real_topics(topics, overlaps):
    """Three real topics, window 32: a copy (for, inside compound), a mixed one and an original."""
    others_of = {name: [text for key, text in topics.items() if key != name] for name in ("for", "debugger")}
    assert overlaps["for"] == pytest.approx(brute_overlap(topics["for"], others_of["for"], OVERLAP_WINDOW), abs=1e-15)
    assert overlaps["for"] > 0.9 and topics["for"][100:1200] in topics["compound"]
    sample = topics["debugger"][:1500]  # a prefix, to keep the brute force quick
    assert topic_overlaps({**topics, "debugger": sample})["debugger"] == pytest.approx(
        brute_overlap(sample, others_of["debugger"], OVERLAP_WINDOW), abs=1e-15)
    assert overlaps["debugger"] < MAX_OVERLAP


def test_window_overlap_matches_brute_force():
    rng = random.Random(5)
    reference_text = "".join(rng.choice("abcd") for _ in range(300))
    text = reference_text[50:90] + "".join(rng.choice("abcde") for _ in range(60)) + reference_text[:20]
    for window in (1, 3, 6, 12):
        assert window_overlap(text, reference_text, window) == pytest.approx(
            brute_overlap(text, [reference_text], window), abs=1e-15), window
    assert window_overlap(reference_text, reference_text, 8) == 1.0
    # many symbols (12 bits each, 5 per packed word) and windows spanning several words
    symbols = [chr(c) for c in range(0x100, 0x100 + 3000)]
    wide = "".join(rng.choice(symbols[:40]) for _ in range(400)) + "".join(symbols[::7])
    probe = wide[30:80] + "".join(rng.choice(symbols[:40]) for _ in range(40)) + wide[-60:]
    for window in (2, 5, 11, 17):
        assert window_overlap(probe, wide, window) == pytest.approx(brute_overlap(probe, [wide], window),
                                                                    abs=1e-15), window
    assert window_overlap("xyz", "xyz", 4) == 0.0  # no windows
    assert window_overlap("eeee", reference_text, 2) == 0.0
    with pytest.raises(ValueError, match="window"):
        window_overlap("ab", "ab", 0)


def test_split_refuses_when_eligible_topics_fall_short():
    base = "the quick brown fox jumps over the lazy dog " * 3
    topics = {f"copy{i}": base for i in range(8)} | {"unique": "zyxwvutsrqponmlkjihgfedcba0123456789"}
    total = sum(map(len, topics.values()))
    assert split_topics(topics, 0.02, window=8) == (sorted(f"copy{i}" for i in range(8)), ["unique"])
    with pytest.raises(ValueError) as info:
        split_topics(topics, 0.1, window=8)
    message = str(info.value)
    for part in ("only 1 of 9 topics", f"hold 36 of {total} characters", f"= {36 / total:.4f}",
                 "heldout_fraction=0.1", "0.05", "8-character"):
        assert part in message, part
    with pytest.raises(ValueError, match="only 0 of 2 topics"):  # nothing eligible at all
        split_topics({"a": "same text here", "b": "same text here"}, 0.5, window=4)
    # a looser max_overlap makes the copies eligible again
    assert split_topics(topics, 0.1, window=8, max_overlap=1.01)[1]


def test_split_independent_of_dict_order(topics, overlaps):
    items = list(topics.items())
    random.Random(0).shuffle(items)
    expected = split_topics(topics, 0.2)
    assert split_topics(dict(items), 0.2) == expected
    assert split_topics(dict(reversed(items)), 0.2) == expected
    assert topic_overlaps(dict(items)) == overlaps


def test_split_independent_of_pythonhashseed(corpus, topics):
    code = ("import json; from experiments.stability.text import load_topics, split_topics; "
            "print(json.dumps(split_topics(load_topics())))")
    expected = [list(corpus.train_topics), list(corpus.heldout_topics)]  # == split_topics(topics), tested below
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True).stdout
        assert json.loads(out) == expected


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_refuses_fraction_outside_unit_interval(fraction):
    with pytest.raises(ValueError, match=str(fraction)):
        split_topics({"a": "xx", "b": "yy"}, fraction)


def test_split_refuses_an_empty_side():
    with pytest.raises(ValueError, match=r"0\.5 of 1 topics .* 0 training and 1 held-out"):
        split_topics({"only": "text"}, 0.5)
    with pytest.raises(ValueError, match=r"0 characters.* 2 training and 0 held-out"):
        split_topics({"a": "", "b": ""}, 0.5)


# ------------------------------------------------------------------------------------
# Corpus, symbols, hash
# ------------------------------------------------------------------------------------


def test_missing_pydoc_data_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # makes the import raise ImportError
    with pytest.raises(CorpusError) as info:
        load_topics()
    message = str(info.value)
    assert "\n" not in message
    for part in ("pydoc_data.topics", sys.executable, platform.python_version(), "install"):
        assert part in message
    with pytest.raises(CorpusError):
        load_corpus(0.3125)  # a fraction no other test caches


def test_corpus_texts_alphabet_and_arrays(corpus, topics):
    train_text = SEPARATOR.join(topics[name] for name in corpus.train_topics)
    heldout_text = SEPARATOR.join(topics[name] for name in corpus.heldout_topics)
    assert (list(corpus.train_topics), list(corpus.heldout_topics)) == split_topics(topics)
    assert corpus.alphabet == "".join(sorted(set(train_text)))
    assert corpus.vocab == len(corpus.alphabet) + 1 == corpus.unknown + 1
    assert corpus.train.dtype == corpus.heldout.dtype == np.int32
    assert corpus.train.shape == (len(train_text),) and corpus.heldout.shape == (len(heldout_text),)
    assert decode(corpus.train, corpus.alphabet) == train_text
    unknown = [ch not in corpus.alphabet for ch in heldout_text]
    np.testing.assert_array_equal(corpus.heldout == corpus.unknown, unknown)
    assert decode(corpus.heldout, corpus.alphabet) == "".join(UNKNOWN_CHAR if u else ch
                                                              for ch, u in zip(heldout_text, unknown, strict=True))
    assert not corpus.train.flags.writeable and not corpus.heldout.flags.writeable
    assert corpus.python == platform.python_version()
    assert corpus.sha256 == corpus_sha256(topics) == hashlib.sha256(
        json.dumps(topics, sort_keys=True).encode()).hexdigest()
    assert load_corpus() is corpus  # cached
    assert corpus.overlap_window == OVERLAP_WINDOW
    assert corpus.heldout_overlap == window_overlap(heldout_text, train_text, OVERLAP_WINDOW)


def test_real_heldout_is_barely_contaminated(corpus, topics):
    """The held-out text measures generalisation: few of its 32-character windows occur verbatim in
    the training text (under the plain sha256 split it was most of them)."""
    print(f"\nheld-out {OVERLAP_WINDOW}-char windows found verbatim in training: {corpus.heldout_overlap:.4f} "
          f"(held-out topics: {', '.join(corpus.heldout_topics)})")
    assert 0.0 <= corpus.heldout_overlap < 0.1
    if corpus.sha256 == MEASURED_SHA256:
        assert corpus.heldout_topics == MEASURED_HELDOUT
        assert corpus.heldout_overlap == pytest.approx(0.011999, abs=1e-6)


def test_encode_decode_round_trip():
    alphabet = "\n !Aaz\u00e9\u2014"
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list(alphabet), size=500))
    encoded = encode(text, alphabet)
    assert encoded.dtype == np.int32 and encoded.shape == (500,)
    assert [alphabet[i] for i in encoded] == list(text)
    assert decode(encoded, alphabet) == text
    assert encode("", alphabet).shape == (0,) and decode(np.zeros(0, np.int32), alphabet) == ""
    np.testing.assert_array_equal(encode("a?z\U0001f600", alphabet), [4, 8, 5, 8])  # unknowns -> len(alphabet)
    with pytest.raises(ValueError, match="strictly increasing"):
        encode("ab", "ba")


def test_unknown_heldout_characters_map_to_the_last_id():
    topics = {f"topic{i}": "abcab" * 4 for i in range(10)}
    _, heldout = split_topics(topics, 0.1)
    victim = heldout[0]
    topics[victim] = "abcZb" + topics[victim][5:]  # same length, so the same split
    corpus = build_corpus(topics, 0.1)
    assert list(corpus.heldout_topics) == heldout
    assert corpus.alphabet == "\nabc" and corpus.vocab == 5  # "\n" from the separators
    start = SEPARATOR.join(topics[name] for name in heldout).index("Z")
    assert corpus.heldout[start] == 4 == corpus.vocab - 1
    assert np.count_nonzero(corpus.heldout == 4) == 1
    assert decode(corpus.heldout, corpus.alphabet)[start] == UNKNOWN_CHAR


def test_corpus_hash_changes_with_one_character(corpus, topics):
    changed = dict(topics)
    name = sorted(changed)[17]
    text = changed[name]
    changed[name] = text[:100] + ("x" if text[100] != "x" else "y") + text[101:]
    assert corpus_sha256(changed) != corpus_sha256(topics)
    assert build_corpus(changed).sha256 != corpus.sha256 == corpus_sha256(topics)
    assert corpus_sha256(dict(reversed(list(topics.items())))) == corpus_sha256(topics)  # order-free


# ------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------


def test_unigram_add_one_by_hand():
    # train "aab" over {a, b, c}: p = (count + 1) / (3 + 3) = 3/6, 2/6, 1/6
    expected = -(math.log(3 / 6) + 2 * math.log(2 / 6) + math.log(1 / 6)) / 4
    assert unigram_cross_entropy(ids("aab"), ids("abbc"), 3) == pytest.approx(expected, abs=1e-12)


def test_witten_bell_by_hand_symmetric():
    # train "abab" over {a, b}. Order 1: c = 4, T = 2, p(a) = (2 + 2 * 1/2) / (4 + 2) = 1/2 = p(b).
    train = ids("abab")
    assert ngram_cross_entropy(train, train, 2, 1) == pytest.approx(math.log(2), abs=1e-12)
    # Order 2: after a: c = 2, T = 1, c(a,b) = 2; after b: c = 1, T = 1, c(b,a) = 1.
    p_b_a = (2 + 1 * 1 / 2) / (2 + 1)  # 5/6
    p_a_b = (1 + 1 * 1 / 2) / (1 + 1)  # 3/4
    expected = -(math.log(1 / 2) + math.log(p_b_a) + math.log(p_a_b) + math.log(p_b_a)) / 4
    assert ngram_cross_entropy(train, train, 2, 2) == pytest.approx(expected, abs=1e-12)


# train "aab" over {a, b, c}. Order 1: c = 3, T = 2 (a, b), base 1/3.
P1 = {"a": (2 + 2 / 3) / (3 + 2), "b": (1 + 2 / 3) / (3 + 2), "c": (0 + 2 / 3) / (3 + 2)}  # 8/15, 1/3, 2/15
# Order 2: after a: c = 2, T = 2, c(a,a) = c(a,b) = 1; contexts b and c unseen (back off to P1).
P2_A = {w: ((w in "ab") + 2 * P1[w]) / (2 + 2) for w in "abc"}
# Order 3: after aa: c = 1, T = 1, c(aa,b) = 1; every other pair context unseen.
P3_AA = {w: ((w == "b") + 1 * P2_A[w]) / (1 + 1) for w in "abc"}


def test_witten_bell_by_hand_with_unseen_symbols_and_contexts():
    train = ids("aab")
    assert sum(P1.values()) == pytest.approx(1.0) and sum(P2_A.values()) == pytest.approx(1.0)
    # test "abbc": order 1 scores every position by P1
    order1 = -(math.log(P1["a"]) + 2 * math.log(P1["b"]) + math.log(P1["c"])) / 4
    assert ngram_cross_entropy(train, ids("abbc"), 3, 1) == pytest.approx(order1, abs=1e-12)
    # order 2: a (no context), b|a, b|b (unseen -> P1), c|b (unseen -> P1)
    order2 = -(math.log(P1["a"]) + math.log(P2_A["b"]) + math.log(P1["b"]) + math.log(P1["c"])) / 4
    assert ngram_cross_entropy(train, ids("abbc"), 3, 2) == pytest.approx(order2, abs=1e-12)
    # test "aabc" at order 3: a (no context), a|a (order 2 only), b|aa, c|ab (unseen; b unseen -> P1)
    order3 = -(math.log(P1["a"]) + math.log(P2_A["a"]) + math.log(P3_AA["b"]) + math.log(P1["c"])) / 4
    assert ngram_cross_entropy(train, ids("aabc"), 3, 3) == pytest.approx(order3, abs=1e-12)
    assert P2_A["b"] == pytest.approx(5 / 12, abs=1e-15) and P3_AA["b"] == pytest.approx(17 / 24, abs=1e-15)


def test_wrong_smoothing_would_be_caught():
    """Dropping T(h) (weight 1 on the lower order instead) changes the hand values: the checks
    above would fail for such a bug, and so would the comparison with the slow implementation."""
    w1 = {"a": (2 + 1 / 3) / (3 + 1), "b": (1 + 1 / 3) / (3 + 1), "c": (1 / 3) / (3 + 1)}
    w2_a_b = (1 + w1["b"]) / (2 + 1)
    wrong = -(math.log(w1["a"]) + math.log(w2_a_b) + math.log(w1["b"]) + math.log(w1["c"])) / 4
    right = ngram_cross_entropy(ids("aab"), ids("abbc"), 3, 2)
    assert abs(wrong - right) > 1e-2
    train, test = _random_texts(1)
    assert abs(_slow_witten_bell(train, test, 6, 3, drop_t=True) - ngram_cross_entropy(train, test, 6, 3)) > 1e-3


def _slow_witten_bell(train: np.ndarray, test: np.ndarray, vocab: int, order: int, drop_t: bool = False) -> float:
    """The Witten-Bell formula with dictionaries, contexts as tuples (oldest symbol first)."""
    c_h, c_hw, successors = Counter(), Counter(), defaultdict(set)
    train, test = train.tolist(), test.tolist()
    for k in range(order):
        for i in range(k, len(train)):
            h = tuple(train[i - k:i])
            c_h[h] += 1
            c_hw[h, train[i]] += 1
            successors[h].add(train[i])

    def p(w: int, h: tuple[int, ...]) -> float:
        lower = p(w, h[1:]) if h else 1 / vocab
        if c_h[h] == 0:
            return lower
        t = 1 if drop_t else len(successors[h])
        return (c_hw[h, w] + t * lower) / (c_h[h] + t)

    return -sum(math.log(p(w, tuple(test[max(0, j - order + 1):j]))) for j, w in enumerate(test)) / len(test)


def _random_texts(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A structured random train text over 4 of 6 symbols and a test text using all 6."""
    rng = np.random.default_rng(seed)
    words = [rng.integers(0, 4, size=rng.integers(2, 5)) for _ in range(5)]
    train = np.concatenate([words[i] for i in rng.integers(0, 5, size=60)])
    test = np.concatenate([words[i] for i in rng.integers(0, 5, size=15)] + [np.array([4, 5, 0, 4])])
    return train.astype(np.int32), test.astype(np.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_witten_bell_matches_slow_implementation(seed):
    train, test = _random_texts(seed)
    for order in range(1, 6):
        slow = _slow_witten_bell(train, test, 6, order)
        assert ngram_cross_entropy(train, test, 6, order) == pytest.approx(slow, abs=1e-12), order
    assert ngram_cross_entropy(train[:2], test, 6, 4) == pytest.approx(_slow_witten_bell(train[:2], test, 6, 4),
                                                                       abs=1e-12)  # train shorter than the order
    assert ngram_cross_entropy(train[:0], test, 6, 3) == pytest.approx(math.log(6), abs=1e-12)  # empty: uniform


def test_witten_bell_is_normalised():
    """sum over w of p(w | h) = 1 for seen and unseen contexts, read off the mean over test = h + w."""
    train, _ = _random_texts(3)
    vocab, order = 6, 4
    for h in ([0, 1, 2], [1, 1], [5, 4, 3], [2]):
        prefix = len(h) * ngram_cross_entropy(train, np.array(h), vocab, order)
        total = sum(math.exp(prefix - (len(h) + 1) * ngram_cross_entropy(train, np.array(h + [w]), vocab, order))
                    for w in range(vocab))
        assert total == pytest.approx(1.0, abs=1e-12), h


def test_higher_order_lowers_cross_entropy_on_repetitive_text():
    symbols = " .acehmnost"
    train = ids("the cat sat on the mat. " * 30, symbols)
    test = ids(("the cat sat on the mat. " * 4)[7:90], symbols)  # same pattern, another phase
    values = [ngram_cross_entropy(train, test, len(symbols), order) for order in range(1, 6)]
    assert all(a > b for a, b in itertools.pairwise(values)), values
    assert unigram_cross_entropy(train, test, len(symbols)) < math.log(len(symbols))


def test_reference_arguments_are_checked():
    with pytest.raises(ValueError, match="order must be >= 1"):
        ngram_cross_entropy(ids("ab"), ids("ab"), 3, 0)
    with pytest.raises(ValueError, match=r"vocab=2"):
        ngram_cross_entropy(ids("abc"), ids("ab"), 2, 1)
    with pytest.raises(ValueError, match="overflows"):
        ngram_cross_entropy(ids("ab"), ids("ab"), 1000, 7)
    with pytest.raises(ValueError, match="empty"):
        unigram_cross_entropy(ids("ab"), ids(""), 3)


def test_real_corpus_references(corpus):
    ref = reference(corpus)
    assert ref["order"] == REFERENCE_ORDER
    assert all(math.isfinite(ref[key]) for key in ("unigram", "ngram"))
    assert 0 < ref["ngram"] < ref["unigram"] < math.log(corpus.vocab)
    assert ref["unigram"] == unigram_cross_entropy(corpus.train, corpus.heldout, corpus.vocab)


def test_reference_order_is_the_measured_minimum(corpus):
    if corpus.sha256 != MEASURED_SHA256:
        pytest.skip(f"REFERENCE_ORDER was measured on another corpus (this is Python {corpus.python})")
    values = {order: ngram_cross_entropy(corpus.train, corpus.heldout, corpus.vocab, order) for order in range(1, 9)}
    assert min(values, key=values.get) == REFERENCE_ORDER == 5
    assert values[5] == pytest.approx(1.7984743, abs=1e-6)
    assert values[4] > values[5] < values[6] < values[7] < values[8]  # turns at 5: longer contexts overfit


# ------------------------------------------------------------------------------------
# Windows
# ------------------------------------------------------------------------------------


def test_sample_windows_deterministic_and_in_range():
    data = np.arange(1000, dtype=np.int32)
    windows = sample_windows(data, 64, 33, seed=7)
    assert windows.shape == (64, 33) and windows.dtype == np.int32
    starts = windows[:, 0]
    np.testing.assert_array_equal(windows, starts[:, None] + np.arange(33))  # contiguous slices
    assert starts.min() >= 0 and starts.max() <= 1000 - 33
    np.testing.assert_array_equal(sample_windows(data, 64, 33, seed=7), windows)
    assert not np.array_equal(sample_windows(data, 64, 33, seed=8), windows)
    expected = np.random.default_rng(7).integers(0, 1000 - 33 + 1, size=64)
    np.testing.assert_array_equal(starts, expected)
    small = sample_windows(np.arange(10), 300, 8, seed=0)
    assert set(small[:, 0].tolist()) == {0, 1, 2}  # both ends reachable
    np.testing.assert_array_equal(sample_windows(np.arange(5), 3, 5, seed=0), np.tile(np.arange(5), (3, 1)))


def test_sample_windows_refuses_too_long_windows(corpus):
    with pytest.raises(ValueError, match=r"window length 11 .* len\(ids\)=10"):
        sample_windows(np.arange(10), 2, 11, seed=0)
    windows = sample_windows(corpus.heldout, 4, 129, seed=0)
    assert windows.shape == (4, 129) and windows.max() < corpus.vocab
