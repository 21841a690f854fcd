"""Mutation check of the active-memory operators' tests (issue 19, item 5): each entry of
MUTATIONS changes one line of a formula in pipeline/models/active_memory.py (the
convolution, the persistent-convolution's padding, the highway-convolution, the CGRU, the
attention branch, the sa+X sums, and the block around them); each is applied alone to a
copy of the repository, the TEST_FILES run there, and the mutation is killed when they
fail. A surviving mutation is a wrong formula the tests would let through.

    .venv/bin/python bench/mutations_active_memory.py [--only 3,7] [--list]

The data format is bench/mutations.py's: a family is (test files, [(file, old line, new
line, description), ...]); `old` must match exactly one line of `file` once stripped of its
indentation, which `new` keeps. The copy holds the files git tracks plus untracked ones it
does not ignore (so uncommitted edits are checked too), and no bytecode is written, so a
mutation of the same length within the same second is never hidden by a stale .pyc.
A benchmark: it prints a table and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "pipeline/models/active_memory.py"
TEST_FILES = ["tests/test_active_memory.py"]

MUTATIONS = [
    # the hard sigmoid: highway gate, CGRU gates
    (MODEL, "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
     "return torch.clamp(1.0 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
     "hard sigmoid: slope 1.2 -> 1.0"),
    (MODEL, "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
     "return torch.clamp(1.2 * torch.sigmoid(x) - 0.2, 0.0, 1.0)",
     "hard sigmoid: offset -0.1 -> -0.2"),
    (MODEL, "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
     "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.1)",
     "hard sigmoid: no upper clip (1.2 sigmoid - 0.1 tops out at 1.1)"),
    (MODEL, "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, 0.0, 1.0)",
     "return torch.clamp(1.2 * torch.sigmoid(x) - 0.1, -0.1, 1.0)",
     "hard sigmoid: no lower clip (bottoms out at -0.1)"),
    # the convolution every operator uses
    (MODEL, "padded = torch.cat([left.expand(b, -1, -1), x, right.expand(b, -1, -1)], dim=1)",
     "padded = torch.cat([right.expand(b, -1, -1), x, left.expand(b, -1, -1)], dim=1)",
     "conv: left and right padding blocks swapped"),
    (MODEL, "return F.conv1d(padded.transpose(1, 2), self.weight, self.bias).transpose(1, 2)",
     "return F.conv1d(padded.transpose(1, 2), self.weight).transpose(1, 2)",
     "conv: bias dropped"),
    (MODEL, "return F.conv1d(padded.transpose(1, 2), self.weight, self.bias).transpose(1, 2)",
     "return F.conv1d(padded.transpose(1, 2), self.weight.flip(-1), self.bias).transpose(1, 2)",
     "conv: taps reversed (correlation -> convolution)"),
    (MODEL, "return F.conv1d(padded.transpose(1, 2), self.weight, self.bias).transpose(1, 2)",
     "return F.conv1d(padded.transpose(1, 2), self.weight.transpose(0, 1), "
     "self.bias).transpose(1, 2)",
     "conv: input and output channels swapped"),
    (MODEL, "return (k - 1, 0) if self.causal else ((k - 1) // 2, k - 1 - (k - 1) // 2)",
     "return (k - 1, 0) if self.causal else (k - 1 - (k - 1) // 2, (k - 1) // 2)",
     "same padding: left and right row counts swapped"),
    (MODEL, "return (k - 1, 0) if self.causal else ((k - 1) // 2, k - 1 - (k - 1) // 2)",
     "return (0, k - 1) if self.causal else ((k - 1) // 2, k - 1 - (k - 1) // 2)",
     "causal padding on the right"),
    # conv and persistent-conv
    (MODEL, 'return F.relu(y) if self.relu else F.gelu(y, approximate="tanh")',
     "return F.relu(y) if self.relu else F.gelu(y)",
     "conv: exact (erf) GELU instead of the code's tanh approximation"),
    (MODEL, 'self.relu = cfg.conv_activation == "relu"',
     'self.relu = cfg.conv_activation != "relu"',
     "conv: activation option inverted"),
    (MODEL, "left, right = self.persistent_padding.left, self.persistent_padding.right",
     "left, right = self.persistent_padding.right, self.persistent_padding.left",
     "persistent-conv: trainable blocks swapped"),
    # highway-convolution
    (MODEL, "b = hard_sigmoid(self.gate(x, left, right))",
     "b = torch.sigmoid(self.gate(x, left, right))",
     "highway: sigmoid gate instead of the hard sigmoid"),
    (MODEL, "b = hard_sigmoid(self.gate(x, left, right))",
     "b = hard_sigmoid(self.transform(x, left, right))",
     "highway: gate from the transform's convolution"),
    (MODEL, "return a * b + x * (1 - b)", "return a * (1 - b) + x * b",
     "highway: transform and carry gates swapped"),
    (MODEL, "return a * b + x * (1 - b)", "return a * b + x",
     "highway: carry not gated"),
    # CGRU
    (MODEL, 'self.gate = hard_sigmoid if cfg.cgru_gate == "hard_sigmoid" else torch.sigmoid',
     'self.gate = torch.sigmoid if cfg.cgru_gate == "hard_sigmoid" else hard_sigmoid',
     "CGRU: gate option inverted"),
    (MODEL, "r = self.gate(self.reset(x, left, right))",
     "r = self.gate(self.update(x, left, right))",
     "CGRU: reset gate from the update gate's convolution"),
    (MODEL, "return u * x + (1 - u) * torch.tanh(self.candidate(r * x, left, right))",
     "return u * x + (1 - u) * torch.tanh(self.candidate(x, left, right))",
     "CGRU: reset gate not applied"),
    (MODEL, "return u * x + (1 - u) * torch.tanh(self.candidate(r * x, left, right))",
     "return (1 - u) * x + u * torch.tanh(self.candidate(r * x, left, right))",
     "CGRU: update gate on the wrong term"),
    (MODEL, "return u * x + (1 - u) * torch.tanh(self.candidate(r * x, left, right))",
     "return u * x + (1 - u) * torch.sigmoid(self.candidate(r * x, left, right))",
     "CGRU: sigmoid candidate instead of tanh"),
    # the attention branch
    (MODEL, "self.scale = cfg.head_dim ** (-1.5 if cfg.attn_double_scale else -0.5)",
     "self.scale = cfg.head_dim ** (-1.0 if cfg.attn_double_scale else -0.5)",
     "attention: the code's scale d_h^-1.0 instead of d_h^-1.5"),
    (MODEL, "self.scale = cfg.head_dim ** (-1.5 if cfg.attn_double_scale else -0.5)",
     "self.scale = cfg.head_dim ** (-1.5 if cfg.attn_double_scale else -1.0)",
     "attention: the standard scale d_h^-1.0 instead of d_h^-0.5"),
    (MODEL, 'future = torch.ones(m, m, dtype=torch.bool, device=x.device).triu(1)',
     'future = torch.ones(m, m, dtype=torch.bool, device=x.device).triu(2)',
     "attention: causal mask lets each position see the next one"),
    (MODEL, "weights = self.dropout(torch.softmax(logits, dim=-1))",
     "weights = self.dropout(torch.softmax(logits, dim=-2))",
     "attention: softmax over queries instead of keys"),
    (MODEL, "return self.out((weights @ v).transpose(1, 2).reshape(b, m, -1))",
     "return self.out((weights.transpose(-1, -2) @ v).transpose(1, 2).reshape(b, m, -1))",
     "attention: weights transposed"),
    # the sa+X sums
    (MODEL, "mixed = mixed + self.attention(y)", "mixed = self.attention(y)",
     "sa+X: operator output dropped from the sum"),
    (MODEL, "mixed = mixed + self.attention(y)", "mixed = mixed + self.attention(x)",
     "sa+X: attention on the un-normalised input"),
    (MODEL, "mixed = self.operator(y, left, right) if self.operator is not None else 0",
     "mixed = self.operator(x, left, right) if self.operator is not None else 0",
     "operator on the un-normalised input"),
    (MODEL, "mixed = mixed + self.attention(y)", "mixed = mixed - self.attention(y)",
     "sa+X: attention subtracted"),
    # the block around the mixer
    (MODEL, "x = layer(x + timing, left, right)", "x = layer(x, left, right)",
     "timing signal not added again at every layer"),
    (MODEL, "signal = torch.cat([torch.sin(t), torch.cos(t)], dim=1)",
     "signal = torch.cat([torch.cos(t), torch.sin(t)], dim=1)",
     "timing signal: cos channels first"),
    (MODEL, "x = self.embedding(tokens) * math.sqrt(d)", "x = self.embedding(tokens)",
     "embedding not scaled by sqrt(d)"),
    (MODEL, "y = self.ff_out(self.dropout(F.relu(self.ff_in(self.ff_norm(x)))))",
     "y = self.ff_out(self.dropout(F.relu(self.ff_in(x))))",
     "feed-forward on the un-normalised input"),
]

FAMILIES = {"active_memory": (TEST_FILES, MUTATIONS)}


def copy_repository(dest: Path) -> None:
    """The files git tracks and the untracked ones it does not ignore, into `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def mutated(text: str, old: str, new: str) -> str:
    """`text` with its one line equal to `old` (indentation aside) replaced by `new`."""
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == old.strip()]
    if len(hits) != 1:
        raise SystemExit(f"{old!r} matches {len(hits)} lines, not one")
    line = lines[hits[0]]
    lines[hits[0]] = line[:len(line) - len(line.lstrip())] + new.strip()
    return "\n".join(lines)


def run_tests(root: Path, test_files: list[str]) -> tuple[bool, str, float]:
    """(passed, the first failing test or error line, seconds), stopping at the first
    failure."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p",
                           "no:cacheprovider", *test_files],
                          cwd=root, env=env, capture_output=True, text=True)
    failed = [ln for ln in done.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return done.returncode == 0, (failed or [""])[0][:90], time.time() - started


def check_family(name: str, test_files: list[str], mutations: list, only: set[int] | None
                 ) -> list[tuple]:
    """[(index, description, killed, by what, seconds)] for each mutation run."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        copy_repository(root)
        where = subprocess.run([sys.executable, "-c", "import pipeline; print(pipeline.__file__)"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(root)):   # the copy, not the installed tree, is tested
            raise SystemExit(f"the copy imports pipeline from {where}")
        passed, why, seconds = run_tests(root, test_files)
        if not passed:
            raise SystemExit(f"{name}: the tests fail unmutated: {why}")
        print(f"{name}: unmutated tests pass ({seconds:.0f} s)", flush=True)
        for index, (file, old, new, description) in enumerate(mutations, 1):
            if only and index not in only:
                continue
            original = (root / file).read_text()
            (root / file).write_text(mutated(original, old, new))
            try:
                passed, why, seconds = run_tests(root, test_files)
            finally:
                (root / file).write_text(original)
            rows.append((index, description, not passed, why, seconds))
            print(f"{index:>3} {'killed  ' if not passed else 'SURVIVED'} {description:<62} "
                  f"{seconds:>4.0f} s  {why}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutation numbers (1-based)")
    ap.add_argument("--list", action="store_true", help="print the mutations and stop")
    args = ap.parse_args()
    only = {int(i) for i in args.only.split(",")} if args.only else None
    for name, (test_files, mutations) in FAMILIES.items():
        if args.list:
            for index, (file, old, new, description) in enumerate(mutations, 1):
                print(f"{index:>3} {file}: {description}\n      - {old}\n      + {new}")
            continue
        rows = check_family(name, test_files, mutations, only)
        survived = [f"{i} ({d})" for i, d, killed, _, _ in rows if not killed]
        print(f"\n{name}: {len(rows)} mutations, {len(rows) - len(survived)} killed, "
              f"{len(survived)} survived{': ' + '; '.join(survived) if survived else ''} "
              f"(tests: {' '.join(test_files)})")


if __name__ == "__main__":
    main()
