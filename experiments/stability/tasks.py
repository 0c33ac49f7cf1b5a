"""The lab's tasks: next-token prediction on integer sequences of length seq_len + 1
(inputs are tokens[:-1], targets tokens[1:]), deterministic from a seed.

* `markov`: sequences from a random sparse Markov chain over `vocab` symbols. Each
  symbol may be followed by `branching` others, with Dirichlet(1) probabilities; the
  first symbol is drawn from the stationary distribution, so every target has the
  same conditional entropy: the chain's entropy rate H, the best loss any model can
  reach. Curves are read as excess loss over H. A model that ignores its context
  and learns only symbol frequencies sits at the unigram loss (the entropy of the
  stationary distribution); that is where failing runs get stuck.
* `copy`: a random prefix a_1..a_k followed by the same k symbols again. Only the
  second copy is scored (loss weight 1), and it is fully predictable by attending k
  positions back: H = 0. It needs attention; an MLP-only model cannot solve it.
* `text`: real text, characters of the English documentation every CPython ships
  (`pydoc_data.topics`, see experiments/stability/text.py), windows of seq_len + 1 characters, the
  training and held-out windows drawn from topics split apart. Its optimum is unknown:
  `optimal_loss` is a reference measured on the held-out text, the Witten-Bell n-gram of
  `text.REFERENCE_ORDER` trained on the training text, and `unigram_loss` the add-one
  unigram's; "trained" means half of the way from the unigram loss to the n-gram's
  (experiments.stability.analysis.failure, start=unigram), so learning character frequencies is not
  enough.

A `Task` carries what training and the report need: a jittable `sample(key, batch)`
returning (tokens (batch, seq_len + 1) int32, weights (seq_len,) float32), the optimal
loss H and the context-free (unigram) loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TASKS = ("markov", "copy", "text")


@dataclass(frozen=True)
class Task:
    """A task (frozen; its numpy arrays become constants of the jitted sampler).

    name: one of TASKS; vocab: number of symbols; seq_len: model context T.
    optimal_loss: H, the best achievable mean loss over scored targets (nats); for text, the
        n-gram reference on the held-out text (not an optimum: a model can beat it).
    unigram_loss: the loss of the best context-free predictor (nats; text: add-one, held-out).
    log_transition: (vocab, vocab) log P(next | current) (markov only).
    stationary: (vocab,) stationary distribution (markov only).
    corpus: the experiments.stability.text.Corpus (text only).
    """

    name: str
    vocab: int
    seq_len: int
    seed: int
    optimal_loss: float
    unigram_loss: float
    log_transition: np.ndarray | None = field(default=None, repr=False, compare=False)
    stationary: np.ndarray | None = field(default=None, repr=False, compare=False)
    corpus: Any = field(default=None, repr=False, compare=False)

    def identity(self) -> dict[str, Any]:
        """What the task's sequences are a function of (the lab's program cache keys by it):
        name, vocab, seq_len, seed and, for text, the corpus's sha256."""
        return {"name": self.name, "vocab": self.vocab, "seq_len": self.seq_len, "seed": self.seed,
                "corpus": getattr(self.corpus, "sha256", None)}

    def weights(self) -> np.ndarray:
        """(seq_len,) float32 loss weight of each target position (0 = not scored)."""
        if self.name == "copy":
            n = self.seq_len + 1
            start = n - n // 2  # the second copy starts at token `start`; target j is token j + 1
            return (np.arange(self.seq_len) + 1 >= start).astype(np.float32)
        return np.ones((self.seq_len,), np.float32)

    def nll(self, tokens: np.ndarray) -> float | None:
        """Mean loss of the true distribution on the scored targets of `tokens` (n, seq_len + 1):
        what the best possible model scores on these very sequences (H up to sampling noise);
        None for text (its distribution is unknown)."""
        if self.name == "copy":
            return 0.0
        if self.name == "text":
            return None
        tokens = np.asarray(tokens)
        return float(-np.mean(self.log_transition[tokens[:, :-1], tokens[:, 1:]].astype(np.float64)))

    def sample(self, key: jax.Array, batch: int) -> jax.Array:
        """Draw `batch` fresh sequences: int32 tokens of shape (batch, seq_len + 1). Jittable.
        (text: windows of the training text; the lab draws its text pools with `windows`.)"""
        n = self.seq_len + 1
        if self.name == "text":
            ids = jnp.asarray(self.corpus.train)
            starts = jax.random.randint(key, (batch,), 0, ids.shape[0] - n + 1)
            return ids[starts[:, None] + jnp.arange(n)]
        if self.name == "copy":
            k = n // 2
            prefix = jax.random.randint(key, (batch, n - k), 0, self.vocab, dtype=jnp.int32)
            return jnp.concatenate([prefix, prefix[:, :k]], axis=1)
        log_p = jnp.asarray(self.log_transition, jnp.float32)  # (V, V)
        log_pi = jnp.log(jnp.asarray(self.stationary, jnp.float32))  # (V,)
        k0, k1 = jax.random.split(key)
        x0 = jax.random.categorical(k0, log_pi, shape=(batch,)).astype(jnp.int32)
        gumbel = jax.random.gumbel(k1, (n - 1, batch, self.vocab))  # (T, B, V)

        def step(x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
            nxt = jnp.argmax(log_p[x] + g, axis=-1).astype(jnp.int32)  # Gumbel-max sampling
            return nxt, nxt

        _, rest = jax.lax.scan(step, x0, gumbel)  # (T, B)
        return jnp.concatenate([x0[:, None], rest.T], axis=1)

    def windows(self, n: int, seed: int, split: str) -> np.ndarray:
        """text: n windows (n, seq_len + 1) int32 of the "train" or "heldout" text, at offsets
        drawn by numpy's default_rng(seed) (experiments.stability.text.sample_windows)."""
        from .text import sample_windows

        if self.name != "text" or split not in ("train", "heldout"):
            raise ValueError(f"windows(split={split!r}) is for the text task's 'train' or 'heldout' split, "
                             f"not {self.name!r}")
        return sample_windows(getattr(self.corpus, split), n, self.seq_len + 1, seed)


def entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along `axis` (0 log 0 = 0)."""
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    return terms.sum(axis=axis)


def _is_primitive(adjacency: np.ndarray) -> bool:
    """True if some power of the 0/1 matrix is all positive (irreducible and aperiodic).
    Wielandt: it suffices to check the power (n - 1)^2 + 1, reached here by squaring."""
    n = adjacency.shape[0]
    m = adjacency.astype(np.int64)
    power = 1
    while power < (n - 1) ** 2 + 1:
        m = np.minimum(m @ m, 1)
        power *= 2
    return bool(np.all(m > 0))


def markov_task(vocab: int = 32, seq_len: int = 32, branching: int = 8, seed: int = 0) -> Task:
    """Random sparse Markov chain: each row has `branching` nonzero Dirichlet(1) entries.

    The matrix is built in float64 from numpy's seeded generator, then rounded to float32
    (what the sampler uses) and renormalised, so H is the entropy rate of the chain that
    is actually sampled.
    """
    if not 1 <= branching <= vocab:
        raise ValueError(f"branching must be in [1, vocab={vocab}], got {branching}")
    rng = np.random.default_rng(seed)
    for _ in range(1000):  # redraw until the chain is ergodic (a unique, positive stationary law)
        p = np.zeros((vocab, vocab))
        for i in range(vocab):
            succ = rng.choice(vocab, size=branching, replace=False)
            p[i, succ] = rng.dirichlet(np.ones(branching))
        if _is_primitive(p > 0):
            break
    else:
        raise ValueError(f"no ergodic chain found for vocab={vocab}, branching={branching}, seed={seed}")
    p = p.astype(np.float32).astype(np.float64)
    p /= p.sum(axis=1, keepdims=True)
    # Stationary distribution: left eigenvector of eigenvalue 1, refined by power iteration.
    w, v = np.linalg.eig(p.T)
    pi = np.abs(np.real(v[:, np.argmin(np.abs(w - 1.0))]))
    pi /= pi.sum()
    for _ in range(1000):
        pi = pi @ p
    pi /= pi.sum()
    with np.errstate(divide="ignore"):
        log_p = np.log(p)
    return Task(
        name="markov", vocab=vocab, seq_len=seq_len, seed=seed,
        optimal_loss=float(pi @ entropy(p, axis=1)),
        unigram_loss=float(entropy(pi)),
        log_transition=log_p.astype(np.float32), stationary=pi.astype(np.float32),
    )


def copy_task(vocab: int = 32, seq_len: int = 31, seed: int = 0) -> Task:
    """Copy task: seq_len + 1 tokens = a random prefix and its copy; H = 0, unigram = log V."""
    if seq_len < 3:
        raise ValueError(f"copy task needs seq_len >= 3, got {seq_len}")
    return Task(name="copy", vocab=vocab, seq_len=seq_len, seed=seed,
                optimal_loss=0.0, unigram_loss=math.log(vocab))


def text_task(seq_len: int = 16, vocab: int = 0) -> Task:
    """Character-level text (see the module docstring). vocab: 0 or the corpus's own
    (`experiments.stability.text.load_corpus().vocab`); anything else is refused."""
    from . import text

    corpus = text.load_corpus()
    if vocab not in (0, corpus.vocab):
        raise ValueError(f"the text task's vocabulary is its corpus's alphabet, {corpus.vocab} symbols "
                         f"(Python {corpus.python}); got vocab={vocab} (pass 0 for the corpus's)")
    if seq_len + 1 > min(len(corpus.train), len(corpus.heldout)):
        raise ValueError(f"seq_len {seq_len} is longer than the corpus's held-out text ({len(corpus.heldout)} chars)")
    ref = text.reference(corpus)
    return Task(name="text", vocab=corpus.vocab, seq_len=seq_len, seed=0, optimal_loss=ref["ngram"],
                unigram_loss=ref["unigram"], corpus=corpus)


def make_task(name: str, *, vocab: int, seq_len: int, seed: int) -> Task:
    """Build a task by name (see TASKS); text ignores seed (its windows are drawn by the lab)."""
    if name == "text":
        return text_task(seq_len=seq_len, vocab=vocab)
    if name == "markov":
        return markov_task(vocab=vocab, seq_len=seq_len, seed=seed)
    if name == "copy":
        return copy_task(vocab=vocab, seq_len=seq_len, seed=seed)
    raise ValueError(f"unknown task {name!r}; choose from {TASKS}")
