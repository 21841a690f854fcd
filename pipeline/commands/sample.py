"""`allattn-pipe sample`: text from a trained language model.

The prompt is encoded with the preprocess stage's vocabulary or tokenizer and read in blocks
of the evaluation's length (a long prompt in one block would need memory quadratic in its
length); then one token at a time, each block carrying the model's state (the cache) from
the previous one, so every new token costs one position, not the whole context again. The
text is printed as it is generated. Seeded: the same seed, prompt and checkpoint give the
same text.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from pipeline.errors import PipelineError


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's ids; a word or sentencepiece vocabulary ends every line with its
    end-of-line token, which a prompt without a final newline does not have yet."""
    from pipeline.data.vocab import Vocab

    try:
        if isinstance(tokenizer, Vocab):
            ids = tokenizer.encode(prompt.encode() if tokenizer.kind == "byte" else prompt)
        else:
            ids = tokenizer.encode(prompt.encode())
    except ValueError as e:
        raise PipelineError(f"--prompt: {e}") from None
    out = [int(i) for i in ids]
    eos = getattr(tokenizer, "eos_id", None)
    if out and eos is not None and out[-1] == eos and not prompt.endswith("\n"):
        out.pop()
    return out


def decode(tokenizer, ids: list[int]) -> str:
    from pipeline.data.vocab import Vocab
    from pipeline.data.word_vocab import WordVocab

    if isinstance(tokenizer, WordVocab):
        text = "\n".join(tokenizer.decode_lines(np.array(ids, dtype=np.int64)))
        return text + "\n" if ids and ids[-1] == tokenizer.eos_id else text
    out = tokenizer.decode(np.array(ids, dtype=np.int64))
    if isinstance(tokenizer, Vocab) and tokenizer.kind == "byte":
        return out.decode("utf-8", errors="replace")
    return out


MAX_TOKENS = 100_000
"""The most tokens one `sample` generates: each costs a forward pass of the model."""

FLUSH_EVERY = 16
"""Generated tokens between two prints of the text so far."""


def generate(
    model,
    prompt_ids: list[int],
    tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    device="cpu",
    block_len: int = 512,
) -> Iterator[int]:
    """`tokens` new ids after `prompt_ids`, yielded as they are drawn from the model's
    next-token distribution (softmax of logits / temperature, over the top_k most likely
    when given; temperature 0 is greedy). The prompt is read `block_len` tokens at a time."""
    import torch

    if not prompt_ids:
        raise PipelineError("--prompt: empty; the model needs at least one token to go on")
    if not math.isfinite(temperature) or temperature < 0:
        raise PipelineError(f"--temperature {temperature}: expected a finite number >= 0")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state = model.init_state(1, device=device)
    with torch.no_grad():
        for start in range(0, len(prompt_ids), block_len):
            block = torch.tensor(
                [prompt_ids[start : start + block_len]], dtype=torch.long, device=device
            )
            out = model(block, None, state)
            state = out.state
        for n in range(1, tokens + 1):
            if out.logits is None:
                raise PipelineError(
                    "sample: this model does not form logits (an adaptive "
                    "softmax); sampling from it is not supported"
                )
            scores = out.logits[0, -1].float().cpu()
            if temperature == 0:
                nxt = int(scores.argmax())
            else:
                # shifted so the best score is 0 before dividing, in float64 (where any
                # temperature > 0 is > 0): a tiny temperature then sends the others to -inf,
                # greedy with ties shared, instead of every score to +-inf and softmax to NaN
                scores = (scores - scores.max()).double() / temperature
                if top_k:
                    kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
                    scores = scores.masked_fill(scores < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=generator))
            yield nxt
            if n < tokens:
                out = model(torch.tensor([[nxt]], dtype=torch.long, device=device), None, state)
                state = out.state


def sample(
    spec,
    which: str,
    prompt: str,
    tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    log,
) -> Iterator[str]:
    """The prompt and its continuation, as pieces of text that join to it, yielded as the
    tokens are generated."""
    from pipeline.commands.trained_weights import trained_model
    from pipeline.data.manifest import load_tokenizer

    if tokens > MAX_TOKENS:
        raise PipelineError(
            f"--tokens {tokens:,}: at most {MAX_TOKENS:,}, each a forward pass of the model"
        )
    model, preprocess, _ = trained_model(spec, which, log)
    tokenizer = load_tokenizer(preprocess)
    ids = encode_prompt(tokenizer, prompt)
    block_len = spec.train.eval_seq_len or spec.train.seq_len
    shown = ""
    for n, nxt in enumerate(
        generate(model, ids, tokens, temperature, top_k, seed, block_len=block_len), 1
    ):
        ids.append(nxt)
        if n % FLUSH_EVERY == 0:
            # the last character waits: the next token can still change it (a byte of a
            # longer UTF-8 character, a word's end)
            text = decode(tokenizer, ids)[:-1]
            if text.startswith(shown):
                yield text[len(shown) :]
                shown = text
    text = decode(tokenizer, ids)
    yield text[len(shown) :]
