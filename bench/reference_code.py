"""The authors' code (facebookresearch/adaptive-span, CC-BY-NC) at one of our shapes, for the
benches that put its training step beside ours (bench/train_step.py, bench/step_counts.py,
gpu/check.py). Their code is never copied here: the user gives their own checkout
(`--reference-code DIR`), and this module imports it from there.

It builds what their main.py builds for experiments/enwik8_pers.sh (the all-attention model:
models.TransformerSeq with adaptive span, its cache, and persistent memory instead of the
feed-forward sublayer; AdagradWithGradClip, per-parameter clipping) and runs one update as
their trainer does (trainer._train_batch: forward, nll + span loss, backward, optimizer step,
span clamp). The span of every head is held at a fraction of the maximum, as our bench holds
ours.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Shape:
    """One model and micro-batch shape, in our config's terms."""

    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 36
    n_persistent: int = 2048
    max_span: int = 8192
    span_ramp: int = 32
    dropout: float = 0.4
    batch: int = 4
    seq: int = 512
    vocab: int = 205
    lr: float = 0.07
    clip: float = 0.03
    span_loss: float = 1e-7

    @classmethod
    def from_spec(cls, spec, vocab: int, batch: int) -> Shape:
        m, t = spec.model_params, spec.train
        return cls(
            d_model=m.d_model,
            n_heads=m.n_heads,
            n_layers=m.n_layers,
            n_persistent=m.n_persistent,
            max_span=m.max_span,
            span_ramp=m.span_ramp,
            dropout=m.attn_dropout,
            batch=batch,
            seq=t.seq_len,
            vocab=vocab,
            lr=t.optimizer.lr,
            clip=t.optimizer.clip_norm,
            span_loss=m.span_loss_coef,
        )


class _Wrapped(torch.nn.Module):
    """Their trainer reads ``model.module`` (DataParallel / DDP): the same, minus the
    scatter."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ReferenceCode:
    """Their modules, imported from ``directory`` (a checkout with models.py, trainer.py,
    adagrad_with_grad_clip.py)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory).resolve()
        missing = [
            f
            for f in (
                "models.py",
                "trainer.py",
                "adagrad_with_grad_clip.py",
                "adaptive_span.py",
                "persistent_memory.py",
            )
            if not (directory / f).is_file()
        ]
        if missing:
            raise FileNotFoundError(
                f"{directory} is not a checkout of the authors' "
                f"adaptive-span code: no {', '.join(missing)}"
            )
        if str(directory) not in sys.path:
            sys.path.insert(0, str(directory))
        self.directory = directory
        self.models = importlib.import_module("models")
        self.trainer = importlib.import_module("trainer")
        self.adagrad = importlib.import_module("adagrad_with_grad_clip")

    def build(self, shape: Shape, device, dtype=torch.float32):
        """(model wrapped as their trainer expects, their optimizer)."""
        model = self.models.TransformerSeq(
            vocab_size=shape.vocab,
            hidden_size=shape.d_model,
            nb_heads=shape.n_heads,
            nb_layers=shape.n_layers,
            attn_span=shape.max_span,
            emb_dropout=0.0,
            inner_hidden_size=1,
            dropout=shape.dropout,
            block_size=shape.seq,
            adapt_io_params={
                "adapt_io_enabled": False,
                "adapt_io_tied": False,
                "adapt_io_divval": 4,
                "adapt_io_cutoffs": [],
            },
            adapt_span_params={
                "adapt_span_enabled": True,
                "adapt_span_loss": shape.span_loss,
                "adapt_span_ramp": shape.span_ramp,
                "adapt_span_init": 0.0,
                "adapt_span_cache": True,
            },
            pers_mem_params={"pers_mem_size": shape.n_persistent},
        ).to(device=device, dtype=dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = self.adagrad.AdagradWithGradClip(params, lr=shape.lr, grad_clip=shape.clip)
        optimizer.grad_clip = 0  # as their utils.py: clipping is inside step()
        return _Wrapped(model), optimizer

    @staticmethod
    def hold_span(model, frac: float) -> None:
        with torch.no_grad():
            for layer in model.module.layers:
                layer.attn.attn.adaptive_span._mask.current_val.fill_(frac)

    @staticmethod
    def init_cache(model, batch: int, device, dtype=torch.float32) -> list[torch.Tensor]:
        """Zero hidden-state caches, as their main.py makes them (size from the span)."""
        d = model.module.in_emb.embedding_dim
        return [
            torch.zeros(batch, layer.attn.attn.get_cache_size(), d, device=device, dtype=dtype)
            for layer in model.module.layers
        ]

    def step(self, model, optimizer, x, y, cache):
        """One update as their trainer does it; returns (loss value, the next cache)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # addcmul_(Number, ...) is deprecated
            return self.trainer._train_batch(
                model, optimizer, None, x, y, cache, eval_only=False, batch_split=1
            )

    @staticmethod
    def span_len(model) -> int:
        """The context their layers attend to (the max span minus what trim_memory drops)."""
        attn = model.module.layers[0].attn.attn.adaptive_span
        return attn._max_span - attn.get_trim_len()
