"""Reading documents segment by segment and scoring what follows their separator: the one
loop behind document-level training (the trainer), validation, the evaluate stage and
reproduce/infinity_sort.py.

A batch of documents [B, length] (pipeline.data.documents: input, separator, targets) is read
in segments of ``seq_len`` tokens from the model's ``init_state``, the state carried from each
segment to the next, so that the short-term memory and the LTM hold this document and nothing
before it. Only the targets after the separator are scored. Segments before them only build
the memory and run without a graph; the others run with one when training, and their
gradient stops at the state they start from (a model's state is detached), as in the
authors' sorting trainer, which backpropagates through a document's last segment alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor


class DocumentPass(NamedTuple):
    nll: Tensor
    """[B, targets] nll (nats) of each scored target, with a graph when training."""
    predictions: Tensor
    """[B, targets] the teacher-forced argmax at each scored target."""
    aux: Tensor
    """Σ model.aux_loss() over the segments that ran with a graph (a model's aux_loss is
    its last forward's; each of them adds its own)."""


def run_documents(
    model, docs: Tensor, seq_len: int, input_length: int, train: bool
) -> DocumentPass:
    """Read documents [B, length] segment by segment (see the module doc). ``model`` is any
    SequenceModel, or a DeepSpeed engine wrapping one."""
    tokens, targets = docs[:, :-1], docs[:, 1:]
    # targets[:, input_length:] follow the separator (the separator itself, targets[:,
    # input_length - 1], is always the same symbol: not scored)
    state = model.init_state(docs.shape[0], device=docs.device)
    nlls, predictions, aux = [], [], []
    for start in range(0, tokens.shape[1], seq_len):
        segment = tokens[:, start : start + seq_len]
        first_scored = max(input_length - start, 0)
        if first_scored >= segment.shape[1]:
            with torch.no_grad():
                state = model(segment, None, state).state
            continue
        with torch.set_grad_enabled(train):
            out = model(segment, targets[:, start : start + seq_len], state)
            if train:
                aux.append(model.aux_loss())
        state = out.state
        nlls.append(out.nll[:, first_scored:].float())
        predictions.append(out.logits[:, first_scored:].argmax(-1))
    nll = torch.cat(nlls, 1)
    return DocumentPass(
        nll, torch.cat(predictions, 1), torch.stack(aux).sum() if aux else nll.new_zeros(())
    )


@dataclass
class DocumentScores:
    """Sums over scored documents; the means are the reported metrics."""

    documents: int = 0
    targets: int = 0
    nll: float = 0.0  # nats, summed over scored targets
    correct: int = 0  # scored targets whose argmax is right
    exact: int = 0  # documents with every scored target right

    def add(self, nll: Tensor, right: Tensor) -> None:
        """Add a batch: nll and right [B, targets]."""
        self.documents += right.shape[0]
        self.targets += right.numel()
        self.nll += float(nll.sum())
        self.correct += int(right.sum())
        self.exact += int(right.all(1).sum())

    @property
    def loss(self) -> float:
        """Nats per scored target."""
        return self.nll / self.targets

    @property
    def token_accuracy(self) -> float:
        return self.correct / self.targets

    @property
    def exact_match(self) -> float:
        return self.exact / self.documents

    def metrics(self) -> dict:
        return {
            "loss": self.loss,
            "token_accuracy": self.token_accuracy,
            "exact_match": self.exact_match,
            "documents": self.documents,
            "targets": self.targets,
        }


@torch.no_grad()
def score_documents(
    model,
    docs: np.ndarray,
    batch_size: int,
    seq_len: int,
    input_length: int,
    device,
    max_batches: int | None = None,
) -> DocumentScores:
    """Loss, token accuracy and exact match of the documents [N, length] (the first
    ``max_batches`` batches of ``batch_size`` of them), in eval mode (no dropout, no random
    numbers drawn); the model's train / eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    scores = DocumentScores()
    for i, first in enumerate(range(0, len(docs), batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        batch = torch.from_numpy(docs[first : first + batch_size].astype(np.int64)).to(device)
        out = run_documents(model, batch, seq_len, input_length, train=False)
        scores.add(out.nll, out.predictions == batch[:, input_length + 1 :])
    model.train(was_training)
    return scores
