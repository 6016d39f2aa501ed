"""The model side: load and fingerprint models, frame prompts, prefill, restore caches, answer.

Everything here needs torch and transformers, so it is imported only by commands that run a model.
Uses kvcli.format for the files; never imported by it.
"""
