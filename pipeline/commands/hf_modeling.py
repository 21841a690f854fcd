"""The remote code `export --format hf` writes from templates (pipeline.commands.hf_export
fills them in): the transformers config and the causal-LM wrapper of the family's model,
whose `generate` keeps the model's Transformer-XL memory as its cache. Never imported as code
here: they import transformers, which this package does not need.
"""

CONFIGURATION_TEMPLATE = '''\
"""Written by allattn-pipe export --format hf: the model's hyperparameters."""

from transformers import PretrainedConfig


class AllAttnPipeConfig(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, kind="allattn", family=None, model=None, vocab_size=256, block_len=512,
                 source=None, **kwargs):
        self.kind = kind
        self.family = family or {{}}
        self.model = model or {{}}
        self.vocab_size = vocab_size
        self.block_len = block_len
        self.source = source or {{}}
        kwargs.setdefault("use_cache", True)  # generate's cache: the model's memory
        super().__init__(**kwargs)
'''

MODELING_TEMPLATE = '''\
"""Written by allattn-pipe export --format hf: the family's model ({model_class},
in {module}.py) as a transformers causal LM. A sequence is read as allattn-pipe's `sample`
reads a prompt: in blocks of `config.block_len` tokens, each carrying the model's state (its
Transformer-XL memory) from the block before. `generate` keeps that state as its cache, so
each new token is one position read against the memory, whatever the prompt's length."""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .{config_module} import AllAttnPipeConfig
from .{module} import {model_class}
from .{config_file} import {config_class}

# transformers 5 renamed the output's `past_key_values` to `cache` (the old name warns)
CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class AllAttnPipeCache:
    """The model's state after `seen` tokens: each layer's memory of hidden states, [B, C, d].
    Not a transformers `Cache`: the memory is a window that slides, with no per-token entries
    to crop or roll back (so no assisted generation)."""

    is_croppable = False
    is_compileable = False

    def __init__(self, state, seen):
        self.state, self.seen = state, seen

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def reorder_cache(self, beam_idx):  # beam search: each row follows its beam
        self.state = [s.index_select(0, beam_idx.to(s.device)) for s in self.state]
        return self


class AllAttnPipeForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AllAttnPipeConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the memory cannot be rolled back: no assisted generation

    def __init__(self, config):
        super().__init__(config)
        self.model = {model_class}({config_class}(**config.model), config.vocab_size)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # the cache is the model's own, made by the first forward

    def _init_weights(self, module):
        pass  # every weight comes from model.safetensors

    def forward(self, input_ids, attention_mask=None, labels=None, cache=None,
                past_key_values=None, use_cache=None, **kwargs):
        """input_ids: the tokens after those `cache` has read (all of them without one)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padding (an attention_mask with zeros) is not supported")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, AllAttnPipeCache):
            if cache.get_seq_length():
                raise ValueError("a transformers Cache holds no state of this model")
            cache = None  # an empty one some transformers version made: ours replaces it
        if cache is None:
            cache = AllAttnPipeCache(self.model.init_state(input_ids.shape[0],
                                                           device=input_ids.device), 0)
        state, logits = cache.state, []
        for start in range(0, input_ids.shape[1], self.config.block_len):
            out = self.model(input_ids[:, start : start + self.config.block_len], None, state)
            state = out.state
            logits.append(out.logits)
        logits = torch.cat(logits, dim=1)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        if use_cache is None:  # transformers 5 keeps use_cache out of the config
            use_cache = getattr(self.config, "use_cache", True)
        if not use_cache:
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        cache = AllAttnPipeCache(state, cache.seen + input_ids.shape[1])
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{{CACHE_FIELD: cache}})

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, use_cache=None,
                                      **kwargs):
        # only the tokens the cache has not read; transformers' own slicing differs by version
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, AllAttnPipeCache):
            cache = None
        return {{"input_ids": input_ids[:, cache.seen if cache is not None else 0 :],
                "attention_mask": attention_mask, "cache": cache, "use_cache": use_cache}}
'''
