"""The model a worker serves: what a model name means (`registry`), loading it (`loader`,
`gguf_cache`, `tiny_llama`), its tokenizer, and one forward step over the paged pool (`runner`,
`fused_decoder`, `cpu_linear`, `paged_attend`) from a packed batch (`batch`,
`attention_metadata`); `cli` is `pagedserve model`.
"""
