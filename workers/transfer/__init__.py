"""KV that leaves one worker for another: a running request handed off with its KV (`handoff`:
packing and adopting the `RequestHandoff` of `workers/protocol/handoff.py`) through Ray's object
store (`handoff_ref`), cached prefix blocks exported and imported between pools
(`prefix_transfer`), and the chains a worker offers first (`hot_chains`).
"""
