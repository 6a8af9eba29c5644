"""The cluster's prefix index, which workers hold which cached KV blocks: the index actor
(`prefix_index`) over its Ray-free state (`state`), its change feed (`feed`), each router's own
copy (`view`), the one match rule both use (`match`) and what it reports (`stats`).
"""
