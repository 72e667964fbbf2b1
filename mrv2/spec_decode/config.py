"""SpeculativeConfig: vLLM's `speculative_config` (a dict of its fields), checked once.

Methods mrv2 drafts with: "ngram" (prompt lookup: the tokens that followed the latest earlier
occurrence of the context's last n-gram), "suffix" (SuffixDecoding's suffix trees over the
request and earlier requests' outputs), "draft_model" (`model`: a smaller model sharing the
target's vocabulary, run greedily with its own KV cache: draft_model.py), "eagle" (`model`:
an EAGLE-1 head that drafts from the target's hidden states: eagle.py) and "eagle3" (`model`:
an EAGLE-3 head that drafts from three of the target's layers' input streams). Every draft is
verified by the target model in one forward and kept only where it equals the token the target
samples at that position (sampler/rejection.py), so the output is the same token for token as
without speculation.

A key vLLM takes and mrv2 does not implement (MTP heads, a draft's own tensor parallelism) is
refused by name, as is any unknown key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from mrv2.config import ConfigError, ModelConfig
from mrv2.core.kv_cache_layout import KVCacheLayout
from mrv2.models.gguf import is_gguf_path

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
# The methods that draft with a checkpoint of their own (`model`), and those of them whose
# checkpoint is a head reading the target's hidden states (spec_decode/eagle.py).
CHECKPOINT_METHODS = ("draft_model", "eagle", "eagle3")
EAGLE_METHODS = ("eagle", "eagle3")
# vLLM's methods that need heads mrv2 has not implemented yet.
UNIMPLEMENTED_METHODS = ("mtp", "medusa", "mlp_speculator", "ngram_gpu")
# vLLM's keys mrv2 does not implement: refused by name rather than ignored. (A draft model runs
# unsharded beside the target, in the target's dtype and max_model_len; `quantization` and
# `revision` are the draft's own.)
UNIMPLEMENTED_KEYS = ("max_model_len", "code_revision", "speculative_token_tree",
                      "parallel_drafting", "disable_padded_drafter_batch", "draft_load_config")
# vLLM's default n-gram length when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Each request's chance that its draft at a position is kept (given the drafts before it
# were) is estimated from its verify steps: counts of kept drafts and of rejections there, each
# decayed by ACCEPT_DECAY a verify step that reached it, plus ACCEPT_PRIOR (kept, rejected): a
# new request drafts as if 4 of 5 drafts at each position were kept. It drafts as many as pay
# for their rows (step_cost.py); one whose chances pay for none stops drafting for
# ADAPTIVE_BACKOFF steps, then verifies one draft as a probe; each stop in a row without a kept
# draft in between doubles the pause, up to ADAPTIVE_MAX_BACKOFF (text that does not repeat,
# or a draft model that does not agree, costs almost no verify rows).
ACCEPT_DECAY = 0.9
ACCEPT_PRIOR = (2.0, 0.5)
ADAPTIVE_BACKOFF = 16
ADAPTIVE_MAX_BACKOFF = 512
# A lookup that finds no match (ngram, suffix) looks again after 1 decode step, each miss in a
# row doubling the pause up to LOOKUP_MISS_MAX_PAUSE: copied text comes back within a few
# tokens, and the scheduler runs a pause as one run of decode steps (core/decode_steps.py), so
# text that never matches pays the host path once per this many steps.
LOOKUP_MISS_MAX_PAUSE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # suffix: vLLM's fields and defaults.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # vLLM's: no drafts in a step of more than this many running requests (None: always).
    disable_by_batch_size: int | None = None
    # draft_model / eagle: the draft's checkpoint (a directory, GGUF file or Hub id; an EAGLE
    # head's is a directory), its revision and quantization ("gguf" or None, as the
    # target's), and its tensor parallelism (1 only).
    model: str | None = None
    revision: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int | None = None
    # The draft's ModelConfig, resolved by EngineArgs (None until then, and for other methods).
    draft_model_config: ModelConfig | None = field(default=None, compare=False, repr=False)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its step's tokens: a draft model or head writes its
        drafts' KV (all but the last) after the token it samples, in the request's blocks."""
        return self.num_speculative_tokens if self.method in CHECKPOINT_METHODS else 0

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"speculative_config.num_speculative_tokens={k!r} must be a "
                              f"positive integer")
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is None and high is None:
                low = high = DEFAULT_PROMPT_LOOKUP
            low = high if low is None else low
            high = low if high is None else high
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ConfigError(f"speculative_config.{name}={value!r} must be a "
                                      f"positive integer")
            if low > high:
                raise ConfigError(f"speculative_config.prompt_lookup_min={low} is larger than "
                                  f"prompt_lookup_max={high}")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        if self.suffix_decoding_max_tree_depth < 1:
            raise ConfigError("speculative_config.suffix_decoding_max_tree_depth must be >= 1")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError("speculative_config.suffix_decoding_max_cached_requests must be "
                              ">= 0")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ConfigError("speculative_config.suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError("speculative_config.suffix_decoding_min_token_prob must be in "
                              "[0, 1]")
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise ConfigError(f"speculative_config.disable_by_batch_size={limit!r} must be a "
                              f"positive integer")
        if (self.method in CHECKPOINT_METHODS) != (self.model is not None):
            raise ConfigError(f"speculative_config.model names the draft model or head of "
                              f"method={self.method!r}, which needs it" if self.model is None
                              else f"speculative_config.model is for method='draft_model', "
                                   f"'eagle' or 'eagle3', not {self.method!r}")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ConfigError(f"speculative_config.draft_tensor_parallel_size="
                              f"{self.draft_tensor_parallel_size!r}: mrv2 runs the draft model "
                              f"unsharded (1)")

    @classmethod
    def from_value(cls, value: dict[str, Any] | SpeculativeConfig | None
                   ) -> SpeculativeConfig | None:
        """The config of `speculative_config` as a user gives it (None: no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(value).__name__}")
        value = dict(value)
        method = value.pop("method", None)
        for key in UNIMPLEMENTED_KEYS:
            if value.get(key) is not None:
                raise ConfigError(f"speculative_config.{key} is not implemented in mrv2")
            value.pop(key, None)
        if method in UNIMPLEMENTED_METHODS:
            raise ConfigError(f"speculative_config.method={method!r} is not implemented in "
                              f"mrv2; it implements {', '.join(map(repr, METHODS))}")
        if method is None and value.get("model") is not None:
            method = "draft_model"  # vLLM's default for a draft checkpoint
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method={method!r}: expected one of "
                              f"{', '.join(map(repr, METHODS))}")
        known = {f.name for f in fields(cls)} - {"method", "draft_model_config"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(unknown)}; mrv2 "
                              f"takes method, {', '.join(sorted(known))}")
        if value.get("num_speculative_tokens") is None:
            if method != "suffix":
                raise ConfigError(f"speculative_config.num_speculative_tokens is required for "
                                  f"method={method!r}")
            # vLLM's: suffix drafts up to its tree depth
            value["num_speculative_tokens"] = value.get("suffix_decoding_max_tree_depth",
                                                      cls.suffix_decoding_max_tree_depth)
        return cls(method=method, **value)


def _plain_layout(layout: KVCacheLayout) -> bool:
    """One full-attention block table for every layer, each layer with KV of its own (none
    with a recurrent state instead)."""
    return (layout.num_groups == 1 and layout.groups[0].window == 0 and not layout.recurrent
            and layout.groups[0].block_scale == 1
            and layout.layer_source == tuple(range(len(layout.layer_source))))


def check_draft_model(draft: ModelConfig, target: ModelConfig, method: str = "draft_model"
                      ) -> None:
    """A draft model or EAGLE head mrv2 runs: the target's vocabulary, and both KV caches of
    plain layout (the draft's blocks are addressed through the target's one block table); a
    head: a Llama-layer directory checkpoint of the target's hidden size."""
    if method in EAGLE_METHODS:
        check_eagle_head(draft, target, method)
    draft_vocab, target_vocab = draft.hf_config.vocab_size, target.hf_config.vocab_size
    if draft_vocab != target_vocab:
        raise ConfigError(f"speculative_config.model={draft.model!r} has a vocabulary of "
                          f"{draft_vocab} tokens, the target's has {target_vocab}: a draft "
                          f"model must share the target's tokenizer")
    for which, config in (("draft", draft), ("target", target)):
        if not _plain_layout(config.kv_cache_layout):
            raise ConfigError(f"speculative_config.method={method!r}: the {which} model "
                              f"{config.model!r} has sliding-window, hybrid or shared KV "
                              f"layers; mrv2 runs a draft model beside full-attention models "
                              f"only")


def check_eagle_head(head: ModelConfig, target: ModelConfig, method: str = "eagle") -> None:
    """An EAGLE head: a Hugging Face directory of Llama layers whose `fc` reads the target's
    hidden states (EAGLE-1: models/eagle.py, config architectures ["LlamaForCausalLM"]) or
    three of its layers' input streams (EAGLE-3: models/eagle3.py), both of the target's hidden
    size; an EAGLE-3 head's target must output those streams (models/llama.py)."""
    from mrv2.models.eagle3 import eagle3_aux_layers
    from mrv2.models.registry import EAGLE3_HEAD_ARCHITECTURES

    if is_gguf_path(head.model) or head.quantization is not None:
        raise ConfigError(f"speculative_config.model={head.model!r}: an EAGLE head is a Hugging "
                          f"Face directory of its own weights, not quantization="
                          f"{head.quantization!r}")
    hf = head.hf_config
    architectures = list(getattr(hf, "architectures", None) or [])
    expected = ["LlamaForCausalLM"] if method == "eagle" else list(EAGLE3_HEAD_ARCHITECTURES)
    if not architectures or any(a not in expected for a in architectures):
        raise ConfigError(f"speculative_config.model={head.model!r}: method={method!r} runs "
                          f"heads of Llama layers (config architectures {expected}), not "
                          f"{architectures}")
    target_hidden = target.hf_config.hidden_size
    head_hidden = (getattr(hf, "target_hidden_size", None) or hf.hidden_size
                   if method == "eagle3" else hf.hidden_size)
    if head_hidden != target_hidden:
        raise ConfigError(f"speculative_config.model={head.model!r}: an EAGLE head of hidden "
                          f"size {head_hidden} for a target of {target_hidden}")
    if method == "eagle3":
        eagle = getattr(hf, "eagle_config", None) or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise ConfigError(f"speculative_config.model={head.model!r}: eagle_config."
                              f"use_aux_hidden_state=false is not implemented in mrv2")
        layers = eagle3_aux_layers(hf, target.num_layers)
        if len(set(layers)) != 3 or not all(0 <= i < target.num_layers for i in layers):
            raise ConfigError(f"speculative_config.model={head.model!r}: an EAGLE-3 head reads "
                              f"3 distinct layers of the target's {target.num_layers}, not "
                              f"{list(layers)}")


def eagle3_target(spec: SpeculativeConfig | None, target: ModelConfig) -> ModelConfig:
    """The target's config, outputting the layer streams its EAGLE-3 head reads (as is for
    any other method)."""
    from mrv2.models.eagle3 import eagle3_aux_layers

    if spec is None or spec.method != "eagle3":
        return target
    layers = eagle3_aux_layers(spec.draft_model_config.hf_config, target.num_layers)
    return replace(target, aux_hidden_state_layers=layers)
