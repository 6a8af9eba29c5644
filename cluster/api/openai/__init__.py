"""The OpenAI-compatible HTTP API (the subset pagedserve serves): `/v1/completions` and
chat (`api`), request and response bodies (`models`, `responses`), log-probabilities, tool
calling and its parser, the Responses API (`responses_*`), embeddings, `/tokenize` and
`/detokenize` (`tokenization`), LoRA adapter routes and how the newer routes read a request.
"""
