"""Choosing a token: decoding settings, seeds, logits processors and draws, stops, self-certainty.

Pure numpy, no runtime: every generation path (rows/, search/, og/) builds on these modules.
"""
