"""`model: {kind: tiny_gru}`: a GRU language model, its hidden state carried from block to
block of a stream as the model protocol's state."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.protocol import ModelFamily, ModelOutput, SequenceModel


@dataclass
class TinyGRUConfig:
    """A token embedding, a stack of GRU layers, and a linear output over the vocabulary."""

    d_model: int = 64
    """Width of the embedding and of the GRU's hidden state."""
    n_layers: int = 1
    """GRU layers."""
    dropout: float = 0.0
    """Dropout on the embedding and the GRU's output, in training."""

    def __post_init__(self):
        # the spec's errors name the file and line of `model:` with this message
        if self.d_model < 1 or self.n_layers < 1:
            raise ValueError("d_model and n_layers must be at least 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class TinyGRU(SequenceModel):
    def __init__(self, cfg: TinyGRUConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.gru = nn.GRU(cfg.d_model, cfg.d_model, cfg.n_layers, batch_first=True)
        self.drop = nn.Dropout(cfg.dropout)
        self.out = nn.Linear(cfg.d_model, vocab_size)

    def init_state(self, batch_size: int, device=None):
        # the protocol's state is batch first: [B, layers, d_model]
        return [
            self.embed.weight.new_zeros(
                batch_size, self.cfg.n_layers, self.cfg.d_model, device=device
            )
        ]

    def forward(self, tokens, targets=None, state=None):
        if state is None:
            state = self.init_state(tokens.shape[0], tokens.device)
        hidden = state[0].transpose(0, 1).contiguous()  # the GRU's [layers, B, d_model]
        x, hidden = self.gru(self.drop(self.embed(tokens)), hidden)
        logits = self.out(self.drop(x))
        nll = (
            None
            if targets is None
            else F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        )
        return ModelOutput(logits, nll, [hidden.transpose(0, 1).detach()])


FAMILY = ModelFamily(TinyGRUConfig, TinyGRU)
