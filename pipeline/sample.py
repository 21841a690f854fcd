"""`allattn-pipe sample`: text from a trained language model.

The prompt is encoded with the preprocess stage's vocabulary or tokenizer and read in one
block; then one token at a time, each block carrying the model's state (the cache) from the
previous one, so every new token costs one position, not the whole context again. Seeded:
the same seed, prompt and checkpoint give the same text.
"""

from __future__ import annotations

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
    ids = [int(i) for i in ids]
    eos = getattr(tokenizer, "eos_id", None)
    if ids and eos is not None and ids[-1] == eos and not prompt.endswith("\n"):
        ids.pop()
    return ids


def decode(tokenizer, ids: list[int]) -> str:
    from pipeline.data.vocab import Vocab, WordVocab

    if isinstance(tokenizer, WordVocab):
        text = "\n".join(tokenizer.decode_lines(np.array(ids, dtype=np.int64)))
        return text + "\n" if ids and ids[-1] == tokenizer.eos_id else text
    out = tokenizer.decode(np.array(ids, dtype=np.int64))
    if isinstance(tokenizer, Vocab) and tokenizer.kind == "byte":
        return out.decode("utf-8", errors="replace")
    return out


def generate(model, prompt_ids: list[int], tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, device="cpu") -> list[int]:
    """`tokens` new ids after `prompt_ids`, drawn from the model's next-token distribution
    (softmax of logits / temperature, over the top_k most likely when given; temperature 0
    is greedy)."""
    import torch

    if not prompt_ids:
        raise PipelineError("--prompt: empty; the model needs at least one token to go on")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    state = model.init_state(1, device=device)
    block = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out_ids: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            out = model(block, None, state)
            if out.logits is None:
                raise PipelineError("sample: this model does not form logits (an adaptive "
                                    "softmax); sampling from it is not supported")
            state = out.state
            scores = out.logits[0, -1].float().cpu()
            if temperature == 0:
                nxt = int(scores.argmax())
            else:
                scores = scores / temperature
                if top_k:
                    kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
                    scores = scores.masked_fill(scores < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=generator))
            out_ids.append(nxt)
            block = torch.tensor([[nxt]], dtype=torch.long, device=device)
    return out_ids


def sample(spec, which: str, prompt: str, tokens: int, temperature: float,
           top_k: int | None, seed: int, log) -> str:
    """The prompt and its continuation, as text."""
    from pipeline.data.manifest import load_tokenizer
    from pipeline.export import trained_model

    model, preprocess, _ = trained_model(spec, which, log)
    tokenizer = load_tokenizer(preprocess)
    ids = encode_prompt(tokenizer, prompt)
    return decode(tokenizer, ids + generate(model, ids, tokens, temperature, top_k, seed))
