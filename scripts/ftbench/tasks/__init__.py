"""Task families: one module per family, the interface they share (base.py) and the registry that names
them (registry.py: ``family(name)``). Torch-free at import."""
