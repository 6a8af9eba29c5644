"""The kernel backends a config can name (`EngineConfig.attention_backend`,
`EngineConfig.linear_backend`); torch-free, so configs and command lines can list them without
importing torch."""

BACKENDS = ("auto", "triton", "cpu", "torch")
LINEAR_BACKENDS = ("auto", "gguf", "onednn", "torch")
