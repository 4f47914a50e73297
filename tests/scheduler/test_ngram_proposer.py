"""The n-gram prompt-lookup proposer on hand-made sequences, against a plain-Python reference."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_svc.core.ngram_proposer import NgramProposer, propose_ngram_drafts


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, one position at a time."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # most recent first; one token must follow
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def drafts(tokens, k=3, min_n=1, max_n=3) -> list[int]:
    out = propose_ngram_drafts(np.asarray(tokens, dtype=np.int32), k, min_n, max_n)
    assert out.dtype == np.int32
    return out.tolist()


def test_copies_what_followed_the_longest_match():
    # "7 8 9" occurred once, followed by 10 11 12; "9" alone occurred later, followed by 50.
    tokens = [1, 7, 8, 9, 10, 11, 12, 2, 9, 50, 3, 7, 8, 9]
    assert drafts(tokens, k=3, max_n=3) == [10, 11, 12]
    assert drafts(tokens, k=3, max_n=1) == [50, 3, 7]  # only unigrams: the latest 9


def test_most_recent_occurrence_wins():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert drafts(tokens, k=1, max_n=2) == [2]


def test_no_match_proposes_nothing():
    assert drafts([1, 2, 3, 4, 5]) == []
    assert drafts([1, 2, 3, 4, 5], min_n=1, max_n=1) == []


def test_min_n_excludes_shorter_matches():
    tokens = [4, 9, 1, 2, 3, 9]  # only a unigram match (9 -> 1)
    assert drafts(tokens, min_n=1, max_n=3) == [1, 2, 3]
    assert drafts(tokens, min_n=2, max_n=3) == []


def test_match_at_the_very_end_overlapping_the_suffix():
    # The latest earlier "1 1" ends one before the last token: only one token follows it.
    assert drafts([1, 1, 1, 1], k=4, max_n=2) == [1]
    assert drafts([3, 1, 2, 1, 2], k=4, max_n=2) == [1, 2]


def test_k_longer_than_what_follows():
    assert drafts([1, 2, 3, 1], k=10, max_n=2) == [2, 3, 1]


def test_min_n_longer_than_the_sequence_and_tiny_inputs():
    assert drafts([1, 2, 1], min_n=3, max_n=4) == []
    assert drafts([7], k=2) == []
    assert drafts([], k=2) == []
    assert drafts([1, 2, 1], k=0) == []


def test_accepts_a_plain_list():
    assert propose_ngram_drafts([1, 2, 3, 1, 2], 2, 1, 2).tolist() == [3, 1]


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_reference_on_random_sequences(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        length = int(rng.integers(0, 40))
        tokens = rng.integers(0, 4, size=length).tolist()  # a small alphabet: many matches
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        assert drafts(tokens, k, min_n, max_n) == reference(tokens, k, min_n, max_n), (
            tokens, k, min_n, max_n,
        )  # fmt: skip


def test_proposer_checks_its_settings():
    assert NgramProposer(2, 1, 3).propose([1, 2, 3, 1]).tolist() == [2, 3]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(2, min_n=3, max_n=2)
