"""kvgraft inside other serving engines.

- ``kvgraft.integrations.vllm``: ``KvgraftConnector``, a vLLM KV connector (``KVConnectorBase_V1``)
  that saves computed prefix blocks as signed, chained kvgraft artifacts and loads a block only
  after its signature, digests and binding verify (docs/vllm.md).
"""
