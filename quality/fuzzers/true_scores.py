"""The true score of a set of weights, computed here and not by `evaluate`: the stateful
fuzzer's oracle for every score a command shows (quality/fuzzers/state_fuzz.py).

The weights are read from where a display says they are (a checkpoint directory's
`mp_rank_00_model_states.pt`, an export's `model.safetensors`), loaded into the config's
model, and every split evaluate scores is scored by this module's own loop: the split's
n - 1 targets cut into `evaluate.batch_size` streams (the first (n - 1) mod B streams one
target longer), each stream read `seq_len` tokens at a time with the model's state carried
from one block to the next, the nll summed in float64 over the real targets only. That is
what evaluate's docstring promises; a score that disagrees with this one by more than its
printed precision belongs to other weights.

Scores are cached by the sha256 of the weights file: a display beside unchanged weights
costs a hash.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

MODEL_FILE = "mp_rank_00_model_states.pt"
EXPORTED_FILE = "model.safetensors"


@dataclass(frozen=True)
class Score:
    """One split's numbers, as evaluate names them: loss (nats per token), bpc, ppl."""

    loss: float
    tokens: int

    @property
    def bpc(self) -> float:
        return self.loss / math.log(2)

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)

    def value(self, name: str) -> float | None:
        """`loss`, `bpc` (or `bits/token`), `ppl`; None for a number that is no score."""
        return {"loss": self.loss, "bpc": self.bpc, "bits/token": self.bpc, "ppl": self.ppl}.get(
            name
        )


class Scorer:
    """Scores weights on the splits of the preprocessed corpus in `preprocess`, with the
    model of `config`."""

    def __init__(self, config: Path, preprocess: Path):
        from pipeline.data.manifest import load_manifest, load_split
        from pipeline.spec import load_spec

        spec = load_spec(config, [])
        manifest = load_manifest(preprocess)
        self.model = spec.build_model(manifest["vocab_size"], str(preprocess)).eval()
        self.splits = {s: load_split(preprocess, s) for s in spec.evaluate.splits}
        self.batch_size = spec.evaluate.batch_size
        self.seq_len = spec.evaluate.seq_len or spec.train.seq_len
        self.cache: dict[str, dict[str, Score]] = {}
        self.scored = 0  # weights scored (not from the cache)

    def of_checkpoint(self, directory: Path) -> dict[str, Score] | None:
        """The scores of a checkpoint directory's weights; None when it has none."""
        path = Path(directory) / MODEL_FILE
        if not path.is_file():
            return None
        return self._scores(path, self._checkpoint_weights)

    def of_export(self, directory: Path) -> dict[str, Score] | None:
        """The scores of an export's weights; None when it has none."""
        path = Path(directory) / EXPORTED_FILE
        if not path.is_file():
            return None
        return self._scores(path, self._exported_weights)

    def _scores(self, path: Path, load) -> dict[str, Score]:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest not in self.cache:
            load(path)
            self.cache[digest] = {name: self._score(t) for name, t in self.splits.items()}
            self.scored += 1
        return self.cache[digest]

    def _checkpoint_weights(self, path: Path) -> None:
        from pipeline.training.checkpoint_dirs import read_checkpoint_file

        self.model.load_state_dict(read_checkpoint_file(path)["module"])

    def _exported_weights(self, path: Path) -> None:
        """A native export's weights (tied tensors stored once), or a Hugging Face folder's
        (every tensor under the wrapper's `model.` prefix)."""
        from safetensors.torch import load_file, load_model

        weights = load_file(str(path))
        if weights and all(k.startswith("model.") for k in weights):
            self.model.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
        else:
            load_model(self.model, str(path), strict=True)

    def _score(self, tokens) -> Score:
        import numpy as np
        import torch

        tokens = np.asarray(tokens, dtype=np.int64)
        rows, width = self.batch_size, self.seq_len
        targets = len(tokens) - 1
        base, extra = divmod(targets, rows)
        lengths = np.array([base + 1 if r < extra else base for r in range(rows)])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        state = self.model.init_state(rows, device="cpu")
        total, blocks = 0.0, -(-int(lengths.max()) // width)
        with torch.no_grad():
            for b in range(blocks):
                x = np.zeros((rows, width), dtype=np.int64)
                y = np.zeros((rows, width), dtype=np.int64)
                real = np.zeros((rows, width), dtype=bool)
                for r in range(rows):
                    done = b * width
                    n = int(min(max(lengths[r] - done, 0), width))
                    first = starts[r] + done
                    x[r, :n] = tokens[first : first + n]
                    y[r, :n] = tokens[first + 1 : first + 1 + n]
                    real[r, :n] = True
                out = self.model(torch.from_numpy(x), torch.from_numpy(y), state)
                state = out.state
                nll = out.nll.to(torch.float64).numpy()
                total += float(nll[real].sum())
        return Score(total / targets, targets)
