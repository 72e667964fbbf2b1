"""Which layers share a block table, and which KV tensors they share (vLLM's hybrid KV cache).

A layer with a sliding window never reads a key more than `window - 1` positions behind its
query, so the blocks of its cache that lie wholly behind every future query's window can be
given back while the request runs. Layers are grouped by window: the layers of one *KV cache
group* share one block table per request, and the manager (kv_cache_manager.py) frees a
windowed group's blocks as its window moves on, so that group holds about `window` tokens of
blocks per request however long the request grows. A full-attention group keeps every block.

Every group draws from one pool of block ids, and one id must mean the same number of bytes in
every group: so groups hold the same number of layers, `group_size` (the smallest count of
layers of one window; a kind with more layers is split into several groups, the last one
possibly smaller), and the cache is `group_size` tensors: layer `l` keeps its K/V in tensor
`layer_tensor[l]`, the tensor its position in its group names. A block id then addresses one
block of each tensor, and the group that holds the id decides which of its layers' K/V is there.

A model with one window for every layer (or none) is one group of all its layers: one tensor
per layer, one block table, as before hybrid layouts existed. A layout that would need more
than MAX_KV_CACHE_GROUPS groups (a lone windowed layer among many full ones) stays one group
per KV width: its windowed layers then keep their blocks (correct, only less frugal).

Layers whose caches differ in width (Gemma 4: 512-dim global heads beside 256-dim windowed
ones; `width` = kv heads x head dim per token) fall into separate groups. Every tensor is as
wide as the widest layer, so a block id holds `block_scale` blocks of a narrower group's shape:
that group's layers view the tensor as that many times as many blocks of their own shape and
address block id b as their block b * block_scale (the worker scales the ids as it stages
them), so the kernels see contiguous caches of one shape each.

A layer that reuses an earlier layer's keys and values (Gemma 4's KV-shared layers,
`kv_sources`) owns no cache: it reads its source's tensor through its source's group.

Torch-free: the scheduler builds the same layout as the worker, from the model config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_KV_CACHE_GROUPS = 8

# "linear_attention": Qwen3-Next's / Qwen3.5's gated delta rule layers, which keep a
# fixed-size recurrent state per request instead of a KV cache (`recurrent_layers`).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def layer_windows(hf: Any) -> tuple[int, ...] | None:
    """Each layer's sliding window (0: it sees every key) as transformers applies it: the layers
    `layer_types` marks "sliding_attention" (Gemma, Qwen2 / Qwen3 with use_sliding_window,
    SmolLM3), or every layer of a config with a `sliding_window` and no layer types (Mistral,
    Phi-3). None: no layer has one. A layer type mrv2 does not implement is refused by name."""
    layer_types = getattr(hf, "layer_types", None)
    unknown = sorted(set(layer_types or ()) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: "
                         f"{', '.join(LAYER_TYPES)}")
    window = getattr(hf, "sliding_window", None) or 0
    if getattr(hf, "use_sliding_window", True) is False:
        window = 0  # Qwen2 / Qwen3 keep the value with the switch off
    if not window:
        return None
    if layer_types is None:
        windows = (window,) * hf.num_hidden_layers
    else:
        windows = tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    return windows if any(windows) else None


def recurrent_layers(hf: Any) -> tuple[bool, ...] | None:
    """Which layers keep a recurrent state in place of a KV cache (`layer_types`
    "linear_attention"); None: none does."""
    flags = tuple(kind == "linear_attention" for kind in getattr(hf, "layer_types", None) or ())
    return flags if any(flags) else None


def recurrent_state_shapes(hf: Any, tp_size: int = 1
                           ) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One request's state in a recurrent layer on one of `tp_size` ranks: the convolution's
    window [conv channels, kernel - 1] (q, k and v of this rank's heads) and the delta rule's
    memory [value heads, key head dim, value head dim] (models/layers/gated_delta_rule.py)."""
    k_heads, v_heads = hf.linear_num_key_heads // tp_size, hf.linear_num_value_heads // tp_size
    k_dim, v_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
    return ((2 * k_heads * k_dim + v_heads * v_dim, hf.linear_conv_kernel_dim - 1),
            (v_heads, k_dim, v_dim))


def layer_kv_shape(hf: Any, layer: int) -> tuple[int, int]:
    """(kv heads, head dim) of a layer: the model's, or its own where the config gives layers
    their own (Gemma 4's `per_layer_config`: global layers' wider heads)."""
    per_layer = getattr(hf, "per_layer_config", None)
    own = per_layer[layer] if per_layer else hf
    kv_heads = getattr(own, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(own, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return kv_heads, head_dim


def layer_kv_widths(hf: Any) -> tuple[int, ...] | None:
    """Each layer's KV width per token (kv heads x head dim) where layers differ; None: every
    layer has the model's."""
    widths = tuple(kv_heads * head_dim for kv_heads, head_dim
                   in (layer_kv_shape(hf, layer) for layer in range(hf.num_hidden_layers)))
    return widths if len(set(widths)) > 1 else None


def layer_kv_sources(hf: Any) -> tuple[int, ...] | None:
    """Each layer's KV source: itself, or for Gemma 4's last `num_kv_shared_layers` layers the
    last earlier layer of its type that computes its own keys and values (transformers'
    `kv_sharing_modes`). None: every layer owns its cache."""
    shared = getattr(hf, "num_kv_shared_layers", 0) or 0
    if not shared:
        return None
    num_layers = hf.num_hidden_layers
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * num_layers)
    first_shared = num_layers - shared
    if first_shared < 1:
        raise ValueError(f"num_kv_shared_layers={shared} leaves no layer of the "
                         f"{num_layers} computing keys and values")
    last_owner = {kind: layer for layer, kind in enumerate(types[:first_shared])}
    missing = sorted(set(types[first_shared:]) - set(last_owner))
    if missing:
        raise ValueError(f"num_kv_shared_layers={shared}: no earlier layer of type "
                         f"{missing} computes the keys and values the shared layers reuse")
    return tuple(layer if layer < first_shared else last_owner[types[layer]]
                 for layer in range(num_layers))


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request."""

    window: int  # 0: full attention (every block is kept)
    layers: tuple[int, ...]
    # Blocks of this group's shape in one block id of the (widest layer's) tensors.
    block_scale: int = 1

    def max_blocks(self, num_tokens: int, block_size: int, max_new_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds in this group at once, when a
        step computes at most `max_new_tokens` tokens: a window group keeps the blocks of the
        `window - 1` keys behind its first new token, and the new tokens'."""
        whole = -(-num_tokens // block_size)
        if not self.window:
            return whole
        return min(whole, -(-(self.window - 1 + max_new_tokens) // block_size) + 1)

    def first_live_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block a query at position `num_computed_tokens` (or later) may read: every
        block before it lies wholly behind the window. 0 for full attention."""
        if not self.window:
            return 0
        return max(num_computed_tokens - self.window + 1, 0) // block_size


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    # Per layer: its group, and the tensor (its position in that group) holding its K/V.
    layer_group: tuple[int, ...]
    layer_tensor: tuple[int, ...]
    # Per layer: the layer whose keys and values it reads (itself unless KV-shared).
    layer_source: tuple[int, ...]
    # The layers with a recurrent state and no KV cache: in no group (group and tensor -1).
    recurrent: tuple[int, ...] = ()

    @classmethod
    def for_windows(cls, windows: Sequence[int] | None, num_layers: int, *,
                    widths: Sequence[int] | None = None,
                    sources: Sequence[int] | None = None,
                    recurrent: Sequence[bool] | None = None) -> KVCacheLayout:
        """Group `num_layers` layers by their windows (None: no layer has one) and KV widths
        (None: all equal); a layer whose `sources` entry names another layer joins that
        layer's group and tensor; a `recurrent` layer joins none."""
        windows = tuple(windows) if windows is not None else (0,) * num_layers
        widths = tuple(widths) if widths is not None else (1,) * num_layers
        sources = tuple(sources) if sources is not None else tuple(range(num_layers))
        if not len(windows) == len(widths) == len(sources) == num_layers:
            raise ValueError(f"{len(windows)} windows, {len(widths)} widths and "
                             f"{len(sources)} KV sources for {num_layers} layers")
        stateful = tuple(recurrent) if recurrent is not None else (False,) * num_layers
        owners = [layer for layer in range(num_layers)
                  if sources[layer] == layer and not stateful[layer]]
        if not owners:
            raise ValueError("no layer keeps a KV cache")
        if any(sources[sources[layer]] != sources[layer] for layer in range(num_layers)):
            raise ValueError(f"KV sources {sources}: a layer must read a layer that owns its "
                             f"cache")
        widest = max(widths)
        if any(widest % width for width in widths):
            raise ValueError(f"KV widths {sorted(set(widths))} per token: each must divide "
                             f"the widest")
        kinds: dict[tuple[int, int], list[int]] = {}
        for layer in owners:
            kinds.setdefault((windows[layer], widths[layer]), []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        if sum(-(-len(layers) // size) for layers in kinds.values()) > MAX_KV_CACHE_GROUPS:
            # One group per width; its blocks follow a window only when all its layers have it.
            merged: dict[int, list[int]] = {}
            for (_, width), layers in kinds.items():
                merged.setdefault(width, []).extend(layers)
            kinds = {}
            for width, layers in merged.items():
                one_window = {windows[layer] for layer in layers}
                window = one_window.pop() if len(one_window) == 1 else 0
                kinds[(window, width)] = sorted(layers)
            size = max(len(layers) for layers in kinds.values())
        groups = []
        layer_group = [0] * num_layers
        layer_tensor = [0] * num_layers
        for (window, width), layers in kinds.items():
            for start in range(0, len(layers), size):
                members = tuple(layers[start:start + size])
                for position, layer in enumerate(members):
                    layer_group[layer] = len(groups)
                    layer_tensor[layer] = position
                groups.append(KVCacheGroup(window, members, widest // width))
        for layer in range(num_layers):
            layer_group[layer] = -1 if stateful[layer] else layer_group[sources[layer]]
            layer_tensor[layer] = -1 if stateful[layer] else layer_tensor[sources[layer]]
        return cls(tuple(groups), tuple(layer_group), tuple(layer_tensor), sources,
                   tuple(layer for layer in range(num_layers) if stateful[layer]))

    @classmethod
    def for_model(cls, hf: Any) -> KVCacheLayout:
        """The layout of a transformers config's layers (one layer for a config without them:
        a scheduler test's)."""
        if getattr(hf, "num_hidden_layers", None) is None:
            return cls.for_windows(None, 1)
        return cls.for_windows(layer_windows(hf), hf.num_hidden_layers,
                               widths=layer_kv_widths(hf), sources=layer_kv_sources(hf),
                               recurrent=recurrent_layers(hf))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_tensors(self) -> int:
        """KV tensors to allocate: as many as the largest group has layers."""
        return max(len(group.layers) for group in self.groups)

    @property
    def group_block_scales(self) -> tuple[int, ...]:
        return tuple(group.block_scale for group in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def max_blocks_per_request(self, num_tokens: int, block_size: int,
                               max_new_tokens: int) -> int:
        """Block ids a request of `num_tokens` tokens holds at most, over all groups."""
        return sum(group.max_blocks(num_tokens, block_size, max_new_tokens)
                   for group in self.groups)
