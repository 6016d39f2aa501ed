"""kvcli: prefill a long document once into a compressed key/value cache, then ask many questions.

Python API (heavy modules load on first use, so `import kvcli` stays cheap):

    import kvcli
    lm = kvcli.load()                                  # default model, or load("path/or/hub-id")
    kvcli.prefill(lm, kvcli.read_document("doc.txt"), "doc.kv")
    session = kvcli.Session(lm, "doc.kv")
    print(session.ask("Who is the licensor?").answer)
    both = kvcli.Session(lm, ["a.kv", "b.kv"], blend=0.15)   # two documents, one prompt (approximate: docs/composing.md)
"""

__version__ = "0.3.0"

_LAZY = {
    "load": ("kvcli.engine.model.models", "load"),
    "from_objects": ("kvcli.engine.model.models", "from_objects"),
    "LoadedModel": ("kvcli.engine.model.models", "LoadedModel"),
    "read_document": ("kvcli.documents", "read"),
    "Document": ("kvcli.documents", "Document"),
    "prefill": ("kvcli.engine.sections.build", "prefill"),  # prefilling.prefill, sections past the window
    "Session": ("kvcli.engine.answer", "Session"),
    "Answer": ("kvcli.engine.answer", "Answer"),
    "GenerationOptions": ("kvcli.engine.answer", "GenerationOptions"),
    "ask": ("kvcli.engine.answer", "ask"),
    "Check": ("kvcli.engine.check", "Check"),
    "verify": ("kvcli.format.store", "verify"),
    "read_manifest": ("kvcli.format.store", "read_manifest"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'kvcli' has no attribute {name!r}")
