"""Token sampling: the torch (CPU) sampler; noise.py holds the seeded Gumbel noise recipe."""

from mrv2.sampler.sampler import Sampler

__all__ = ["Sampler"]
