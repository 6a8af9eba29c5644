"""Beam search inside the engine on shared blocks: the scoring as HF transformers does it
(`search`), a group's live beams as sequences (`groups`), moving a group to a peer engine as one
unit (`moves`) and what a beam-search request may ask for (`checks`).
"""
