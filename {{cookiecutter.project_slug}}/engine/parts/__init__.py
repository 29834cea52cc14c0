"""The optional features of a run, one module each; engine/hooks.py says what a part module
holds and lists the hooks through which the core calls it."""
