"""Speculative decoding, off by default: its config, where draft tokens come from
(`proposer`, `draft`), their verification against the target's logits (`verify`), the engine's
side of a speculative step (`decoding`) and its counters (`stats`).
"""
