"""Duplicate and near-duplicate texts: exact after normalising case and whitespace, or MinHash signatures of
word shingles compared within LSH bands (so not every pair is compared)."""

from __future__ import annotations

import hashlib
import re
import zlib

import numpy as np

SHINGLE = 5
"""Tokens per shingle of the near-duplicate test."""
NUM_PERM = 64
"""MinHash permutations (signature length); 16 LSH bands of 4 rows."""
LSH_BANDS = 16
_WORD = re.compile(r"\w+|[^\w\s]")


def normalise(text: str) -> str:
    """Content key of the exact test: case-folded, all whitespace runs collapsed to one space."""
    return " ".join(text.lower().split())


def shingle_hashes(text: str, cache: dict[str, int]) -> np.ndarray:
    """32-bit hashes of the text's overlapping ``SHINGLE``-token windows (words and punctuation, case-folded)."""
    toks = []
    for w in _WORD.findall(text.lower()):
        h = cache.get(w)
        if h is None:
            h = cache[w] = zlib.crc32(w.encode())
        toks.append(h)
    t = np.array(toks, dtype=np.uint64)  # (n,)
    if len(t) < SHINGLE:
        return np.unique(t)
    n = len(t) - SHINGLE + 1
    h = np.zeros(n, dtype=np.uint64)  # (n,) polynomial rolling combination, kept to 32 bits
    for j in range(SHINGLE):
        h = (h * np.uint64(1_000_003) + t[j:j + n]) & np.uint64(0xFFFFFFFF)
    return np.unique(h)


def minhash(shingles: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """(NUM_PERM,) MinHash signature: per seed, the minimum over shingles of splitmix64(h + seed)."""
    if len(shingles) == 0:
        return np.full(len(seeds), np.iinfo(np.uint64).max, dtype=np.uint64)
    z = shingles[None, :] + seeds[:, None]  # (P, n), uint64 arithmetic wraps modulo 2^64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).min(axis=1)


def duplicates(texts: list[str], mode: str, threshold: float, order: list[int]) -> dict[int, int]:
    """{dropped index: index of the kept text it duplicates}, visiting the texts in ``order``.

    ``exact``: the same normalised content; ``near``: also an estimated Jaccard similarity of shingles
    >= ``threshold`` (MinHash with LSH banding: only texts sharing a band are compared).
    """
    seeds = np.random.default_rng(0).integers(0, np.iinfo(np.uint64).max, NUM_PERM, dtype=np.uint64)  # (P,)
    rows = NUM_PERM // LSH_BANDS
    seen: dict[str, int] = {}
    buckets: dict[tuple, list[int]] = {}
    sigs: dict[int, np.ndarray] = {}
    cache: dict[str, int] = {}
    found: dict[int, int] = {}
    for i in order:
        key = hashlib.sha1(normalise(texts[i]).encode()).hexdigest()
        if key in seen:
            found[i] = seen[key]
            continue
        if mode == "near":
            sig = minhash(shingle_hashes(texts[i], cache), seeds)
            bands = [(band, sig[band * rows:(band + 1) * rows].tobytes()) for band in range(LSH_BANDS)]
            cands = {j for bk in bands for j in buckets.get(bk, [])}
            match = next((j for j in sorted(cands) if float(np.mean(sigs[j] == sig)) >= threshold), None)
            if match is not None:
                found[i] = match
                continue
            sigs[i] = sig
            for bk in bands:
                buckets.setdefault(bk, []).append(i)
        seen[key] = i
    return found
