"""Speculative decoding: draft proposers (ngram, suffix) and their per-slot state."""
