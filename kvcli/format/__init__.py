"""The cache on disk: manifest schema, shard codec, reading and verifying, atomic writing.

Nothing here loads a model; only codec.py imports torch (to build tensors). Arrows point down:
kvcli.engine and the CLI use this package, never the other way round.
"""
