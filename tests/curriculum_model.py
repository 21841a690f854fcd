"""A tiny position-wise model for the curriculum tests, registered as model kind
`curriculum_probe` on import (the CLI tests start `python -c "import tests.curriculum_model;
..."`). Embedding -> dropout -> a width-3 convolution over positions -> output: enough to
learn `not` in a few steps, with dropout so that resuming must replay it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

from pipeline.models import MODELS
from pipeline.models.protocol import ModelOutput, SequenceModel


@dataclass
class ProbeConfig:
    d_model: int = 16
    dropout: float = 0.1


class Probe(SequenceModel):
    def __init__(self, cfg: ProbeConfig, vocab_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.mix = nn.Conv1d(cfg.d_model, cfg.d_model, 3, padding=1)
        self.out = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, tokens, targets=None, state=None):
        h = self.drop(self.embed(tokens))
        h = h + self.mix(h.transpose(1, 2)).transpose(1, 2)
        logits = self.out(h)
        nll = None if targets is None else F.cross_entropy(
            logits.transpose(1, 2), targets, reduction="none")
        return ModelOutput(logits, nll, [])


MODELS["curriculum_probe"] = (ProbeConfig, Probe)
