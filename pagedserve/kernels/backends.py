"""The kernel backends a config can name (`EngineConfig.attention_backend`); torch-free, so
configs and command lines can list them without importing torch."""

BACKENDS = ("auto", "triton", "cpu", "torch")
