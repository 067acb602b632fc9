"""The edges: lm-eval (the OrtLM adapter and its registration) and Olive.

Nothing here is imported by ``import ortevals``: each edge imports its framework.
"""
