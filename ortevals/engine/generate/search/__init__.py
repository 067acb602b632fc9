"""Search and selection over a decoder: beam and diverse beam search, MBR, process reward models,
and the verifier-guided step-level searches (PRM beam search, DVTS, particle filtering).

The searches are pure numpy over protocols (``beam.StepModel``, ``steps.RowModel``,
``steps.StepScorer``); ``rawrows.py`` is the row model on raw onnxruntime.
"""
