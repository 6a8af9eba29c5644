"""From logits to tokens: the batched sampler (`sampler`) and log-probabilities as vLLM reports
them (`logprobs`). The per-request sampling parameters it applies (`SamplingParams`, validated
once at the edge) cross every process boundary, so they are in `workers/protocol/sampling.py`.
"""
