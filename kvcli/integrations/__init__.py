"""kvcli caches served by other engines.

`kvcli.integrations.vllm` is a vLLM KV connector (imports vllm; load it only inside vLLM).
`kvcli.integrations.caches` is its engine-free half: indexing caches by their prompt ids and the
rules deciding which caches fit the engine. Like everything under kvcli.integrations it imports only
kvcli.format and kvcli.remote (never kvcli.engine, never transformers at import), so it installs
next to an engine that pins its own transformers (docs/vllm.md, "Install").
"""
