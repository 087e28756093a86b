"""Dev-only tools, outside the product's import path: the tiny model, GGUF import, the time-sliced
benchmark arm.
"""
