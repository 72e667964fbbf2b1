from mrv2.attention.backend import Attention, AttentionMetadata

__all__ = ["Attention", "AttentionMetadata"]
