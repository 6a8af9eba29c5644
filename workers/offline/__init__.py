"""The engine without a cluster: the offline API shaped like vLLM's (`LLM(...).generate`) and
`pagedserve generate --offline` (`cli`).
"""
