"""`compare`'s table: parameter counts that differ by a quarter are told apart (one decimal
of millions printed 113,775 and 146,543 both as 0.1M), and bits per token are called bpc
only where every run's tokens are characters or bytes."""

from __future__ import annotations

import pytest

from pipeline.commands.compare import Group, RunRow, table_rows


def group(name: str, parameters: int | None = 1000, tokenizer: str | None = None) -> Group:
    row = RunRow(
        run_id=name,
        run_ids=[name],
        name=name,
        status="finished",
        params={"model.kind": "allattn", "name": name}
        | ({"dataset.tokenizer.kind": tokenizer} if tokenizer else {}),
        metrics={"valid_bpc": 2.5, "valid_ppl": 5.6},
        steps=10,
        parameters=parameters,
        wall_s=1.0,
        sweep=None,
    )
    return Group([row], key={"name": name})


def parameters_column(*counts: int | None) -> list[str]:
    header, cells = table_rows([group(f"run{i}", n) for i, n in enumerate(counts)], [])
    return [row[header.index("parameters")] for row in cells]


def test_two_small_models_are_told_apart():
    assert parameters_column(113_775, 146_543) == ["114k", "147k"]


@pytest.mark.parametrize(
    "count, shown",
    [
        (None, "-"),
        (12_345, "12,345"),
        (99_999, "99,999"),
        (373_631, "374k"),
        (999_600, "1.00M"),  # rounds up into the next unit, not "1000k"
        (1_234_567, "1.23M"),
        (38_512_000, "38.5M"),
        (113_980_000, "114M"),
        (1_500_000_000, "1.50B"),
    ],
)
def test_three_significant_figures_past_a_hundred_thousand(count, shown):
    assert parameters_column(count) == [shown]


@pytest.mark.parametrize(
    "tokenizers, column",
    [
        (["byte", "char"], "valid_bpc"),
        ([None], "valid_bpc"),  # a run logged without its tokenizer: as it was shown
        (["sentencepiece"], "valid_bits/token"),
        (["word", "word"], "valid_bits/token"),
        (["byte", "sentencepiece"], "valid_bits/token"),  # a character is a token too
    ],
)
def test_bits_per_token_are_bpc_only_for_characters_and_bytes(tokenizers, column):
    groups = [group(f"run{i}", tokenizer=t) for i, t in enumerate(tokenizers)]
    header, _ = table_rows(groups, ["valid_bpc", "valid_ppl"])
    assert header[-2:] == [column, "valid_ppl"]
