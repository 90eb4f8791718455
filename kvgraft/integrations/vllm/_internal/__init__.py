"""The vLLM connector's implementation; the public surface is ``kvgraft.integrations.vllm``."""
