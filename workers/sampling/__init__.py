"""From logits to tokens: per-request sampling parameters validated once at the edge
(`params`), the batched sampler (`sampler`) and log-probabilities as vLLM reports them
(`logprobs`).
"""
