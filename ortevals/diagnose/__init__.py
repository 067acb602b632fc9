"""``ortevals diagnose``: where a quantized package loses accuracy, and which weights to keep in higher precision.

A candidate package (int4/int8 builder output) is compared with the same model in higher
precision (a float package, or the transformers checkpoint built once into one):

1. per layer (:mod:`~ortevals.diagnose.layers`): the residual stream after each attention and MLP
   block on real text, read through extra outputs of a derived copy of each graph
   (:mod:`ortevals.runtime.taps`), as relative L2 error and cosine similarity, and the error each
   block adds (:mod:`~ortevals.diagnose.stats`);
2. sensitivity (:mod:`~ortevals.diagnose.sensitivity`): the weight groups of the blocks that add
   the most, each put back at the reference's precision in a derived candidate
   (:mod:`ortevals.runtime.swap`) and measured as ``ortevals fidelity`` and ``ortevals compare``
   measure (:mod:`~ortevals.diagnose.measure`); a greedy selection by KL recovered per megabyte,
   each cumulative set measured again;
3. the recommendation within a size budget, with the builder's command line and the Olive pass
   that make it (:mod:`~ortevals.diagnose.recommend`), ``--verify`` building and measuring it
   (:mod:`~ortevals.diagnose.verify`); the table, ``diagnose.json`` and ``diagnose.png``
   (:mod:`~ortevals.diagnose.report`, :mod:`~ortevals.diagnose.plot`).

:mod:`~ortevals.diagnose.inputs` checks everything that can be wrong before any work;
:mod:`~ortevals.diagnose.run` runs the stages in order. Importing this package imports neither
torch nor onnxruntime.
"""
