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
than MAX_KV_CACHE_GROUPS groups (a lone windowed layer among many full ones) stays one group:
its windowed layers then keep their blocks (correct, only less frugal).

Torch-free: the scheduler builds the same layout as the worker, from the model config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_KV_CACHE_GROUPS = 8

LAYER_TYPES = ("full_attention", "sliding_attention")


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


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request."""

    window: int  # 0: full attention (every block is kept)
    layers: tuple[int, ...]

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

    @classmethod
    def for_windows(cls, windows: Sequence[int] | None, num_layers: int) -> KVCacheLayout:
        """Group `num_layers` layers by their windows (None: no layer has one)."""
        windows = tuple(windows) if windows is not None else (0,) * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} windows for {num_layers} layers")
        kinds: dict[int, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        num_groups = sum(-(-len(layers) // size) for layers in kinds.values())
        if len(kinds) == 1 or num_groups > MAX_KV_CACHE_GROUPS:
            # One group; its blocks follow a window only when every layer has that window.
            window = windows[0] if len(kinds) == 1 else 0
            return cls((KVCacheGroup(window, tuple(range(num_layers))),),
                       (0,) * num_layers, tuple(range(num_layers)))
        groups = []
        layer_group = [0] * num_layers
        layer_tensor = [0] * num_layers
        for window, layers in kinds.items():
            for start in range(0, len(layers), size):
                members = tuple(layers[start:start + size])
                for position, layer in enumerate(members):
                    layer_group[layer] = len(groups)
                    layer_tensor[layer] = position
                groups.append(KVCacheGroup(window, members))
        return cls(tuple(groups), tuple(layer_group), tuple(layer_tensor))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_tensors(self) -> int:
        """KV tensors to allocate: as many as the largest group has layers."""
        return max(len(group.layers) for group in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def max_blocks_per_request(self, num_tokens: int, block_size: int,
                               max_new_tokens: int) -> int:
        """Block ids a request of `num_tokens` tokens holds at most, over all groups."""
        return sum(group.max_blocks(num_tokens, block_size, max_new_tokens)
                   for group in self.groups)
