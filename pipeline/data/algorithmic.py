"""The active-memory paper's algorithmic tasks (docs/papers.md#active-memory-tasks), generated
online.

Each problem makes a batch of (inputs, targets), two int64 tensors [B, T] of the same shape
(position-wise targets, an encoder-only model), from a `torch.Generator`, so a seed fixes
every batch. `length` is the curriculum's length; T is the number of positions it makes:

    reverse  T = length; tokens uniform in [0, vocab); targets the inputs reversed
    sort     T = length; tokens uniform in [0, vocab); targets the inputs sorted ascending
    not      T = length; tokens uniform in {0, 1}; targets 1 - input
    remember T = 2 * length; inputs N = length tokens uniform in [0, vocab), then N zeros;
             targets N zeros, then those tokens
    add      T = length, odd and >= 3; two operands of w = (length - 1) // 2 bits, each
             uniform in [0, 2**w - 1) (every w-bit number but all ones), written in binary most
             significant bit first: inputs a, the separator 2, b; targets a + b in `length` bits
    mult     as add, targets a * b in `length` bits

These are the authors' generators (github.com/Anon-111/Active-Memory, Algorithmic-Tasks/
tasks.py), including their ranges, with one exception: their multiply draws below
int(np.sqrt(2**(length-1) - 1)), which is 2**w - 1 (add's range) at odd lengths up to 53; from
55 on, float64 rounding makes it 2**w, so there they can draw the all-ones operand (and from
67 numpy's square root of the Python int fails). Ours stays below 2**w - 1 at every length.

Vocabulary: add, mult and not use the tokens 0, 1 and the separator 2, and their model's
vocabulary (input and output classes) is 3 as the paper says; the authors' script
(Algorithmic-Tasks/main.py) gives every task a vocabulary of 20, which `vocab` reproduces
(the tokens drawn stay the same).
"""

from __future__ import annotations

import torch
from torch import Tensor

PROBLEMS = ("reverse", "sort", "add", "mult", "not", "remember")
SEPARATOR = 2
BINARY_VOCAB = {"add": 3, "mult": 3, "not": 3}  # 0, 1 and the separator 2
DEFAULT_VOCAB = {"reverse": 100, "sort": 20, "remember": 20}
BINARY = ("add", "mult")


def vocab_size(problem: str, vocab: int | None = None) -> int:
    """The model's vocabulary: `vocab` if given, else the paper's: 3 for add, mult and not,
    100 for reverse, 20 for sort and remember. For reverse, sort and remember the tokens are
    drawn from all of it; add, mult and not draw only 0, 1 (and the separator 2)."""
    return vocab or BINARY_VOCAB.get(problem) or DEFAULT_VOCAB[problem]


def length_step(problem: str, step: int | None = None) -> int:
    """How much a solved length grows: the paper's 2 for add and mult (their lengths stay
    odd), 1 for the others; `step` overrides."""
    return step or (2 if problem in BINARY else 1)


def check_length(problem: str, length: int) -> None:
    """ValueError naming the problem if it cannot make cases of `length`."""
    if problem in BINARY and (length < 3 or length % 2 == 0):
        raise ValueError(
            f"{problem} needs an odd length of at least 3 (two operands of "
            f"(length - 1) / 2 bits and a separator); got {length}"
        )
    if length < 1:
        raise ValueError(f"{problem} needs a length of at least 1; got {length}")


def generate(
    problem: str, length: int, batch: int, generator: torch.Generator, vocab: int | None = None
) -> tuple[Tensor, Tensor]:
    """A batch of `batch` cases of `problem` at `length` (see the module doc for the layouts),
    drawn from `generator` (CPU)."""
    check_length(problem, length)
    v = vocab_size(problem, vocab)
    if problem in BINARY:
        return _arithmetic(problem, length, batch, generator)
    if problem == "not":
        x = torch.randint(0, 2, (batch, length), generator=generator)
        return x, 1 - x
    x = torch.randint(0, v, (batch, length), generator=generator)
    if problem == "reverse":
        return x, x.flip(-1)
    if problem == "sort":
        return x, x.sort(dim=-1).values
    if problem == "remember":
        zeros = torch.zeros_like(x)
        return torch.cat([x, zeros], dim=1), torch.cat([zeros, x], dim=1)
    raise ValueError(f"unknown problem {problem!r}; known: {', '.join(PROBLEMS)}")


def _arithmetic(
    problem: str, length: int, batch: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    width = (length - 1) // 2
    a, b = _operands(width, batch, generator), _operands(width, batch, generator)
    rows = [binary_case(problem, length, x, y) for x, y in zip(a, b, strict=False)]
    return (
        torch.tensor([r[0] for r in rows], dtype=torch.int64).view(batch, length),
        torch.tensor([r[1] for r in rows], dtype=torch.int64).view(batch, length),
    )


def binary_case(problem: str, length: int, a: int, b: int) -> tuple[list[int], list[int]]:
    """One add / mult case: inputs a and b in (length - 1) // 2 bits each, most significant
    first, around the separator; targets a + b (or a * b) in `length` bits."""
    width = (length - 1) // 2
    result = a + b if problem == "add" else a * b
    return (_bits(a, width) + [SEPARATOR] + _bits(b, width), _bits(result, length))


def _operands(width: int, batch: int, generator: torch.Generator) -> list[int]:
    """`batch` numbers uniform in [0, 2**width - 1): uniform bits, a row of all ones drawn
    again. Python ints, since the curriculum's longer lengths pass 64 bits."""
    bits = torch.randint(0, 2, (batch, width), generator=generator)
    while (ones := bits.all(dim=1)).any():
        bits[ones] = torch.randint(0, 2, (int(ones.sum()), width), generator=generator)
    return [int("".join(map(str, row)), 2) for row in bits.tolist()]


def _bits(number: int, width: int) -> list[int]:
    """`number` in `width` binary digits, most significant first."""
    return [int(c) for c in format(number, f"0{width}b")]
