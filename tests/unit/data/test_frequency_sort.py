"""The sorting task's generator (pipeline/data/frequency_sort.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from pipeline.data.frequency_sort import (
    document,
    drifting_tokens,
    generate_split,
    mixture_ends,
    padding,
    separator,
    sort_by_count,
)


def test_sort_by_count_orders_by_count_then_first_appearance_then_absent_by_index():
    assert sort_by_count(np.array([3, 1, 1, 2, 3, 0]), 6).tolist() == [3, 1, 2, 0, 4, 5]
    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens = rng.integers(0, 7, size=rng.integers(1, 30))
        # the authors' construction: Counter.most_common, then the absent symbols
        direct = [s for s, _ in Counter(tokens.tolist()).most_common()]
        direct += [s for s in range(9) if s not in direct]
        assert sort_by_count(tokens, 9).tolist() == direct


def test_the_mixture_drifts_from_the_first_distribution_to_the_second():
    rng = np.random.default_rng(1)
    start, end = np.eye(2)  # symbol 0 only, then symbol 1 only
    tokens = drifting_tokens(rng, start, end, 20_000)
    assert tokens[-1] == 1  # r = 1 at the last position
    # P(symbol 1) at position j is (j + 1)/length: 0.05 on average over the first tenth
    assert abs(tokens[:2000].mean() - 0.05) < 0.015
    assert abs(tokens[-2000:].mean() - 0.95) < 0.015


def test_mixture_ends_are_normalised_integer_weights():
    p_start, p_end = mixture_ends(np.random.default_rng(2), 20, (1, 9))
    for p in (p_start, p_end):
        assert p.shape == (20,) and abs(p.sum() - 1) < 1e-12
        ratios = p / p.min()  # the weights over the smallest one, in [1, 9]
        assert ratios.max() <= 9 + 1e-9


def test_documents_are_seeded_per_split_and_laid_out_input_separator_target():
    train = generate_split(7, "train", 3, 20, 50, (1, 9))
    assert train.shape == (3, 71)
    np.testing.assert_array_equal(train, generate_split(7, "train", 3, 20, 50, (1, 9)))
    # more train sequences leave the first ones, and the valid split, as they were
    np.testing.assert_array_equal(generate_split(7, "train", 5, 20, 50, (1, 9))[:3], train)
    assert not np.array_equal(generate_split(7, "valid", 3, 20, 50, (1, 9)), train)
    assert not np.array_equal(generate_split(8, "train", 3, 20, 50, (1, 9)), train)
    for doc in train:
        assert doc[:50].max() < 20 and doc[50] == separator(20) == 20
        assert sorted(doc[51:].tolist()) == list(range(20))
        assert doc[51:].tolist() == sort_by_count(doc[:50], 20).tolist()
    assert padding(20) == 21
    assert document(np.random.default_rng(0), 4, 10, (1, 9)).shape == (15,)
