"""``ortevals fidelity``: token-level distance between a candidate package and a reference on real text.

The text (by default the bundled MMLU-Pro questions with worked answers,
:mod:`~ortevals.fidelity.text`) is cut into llama.cpp-style windows
(:mod:`~ortevals.fidelity.windows`); each window is one raw-ORT prefill pass
with the LM head at every position, reduced at once to per-token statistics
(:mod:`~ortevals.fidelity.stats`): KL(ref‖cand) over the reference's top-k plus
a tail bucket, same top-1, top-k overlap, Δp and the log-probs of the actual
next token. The reference is another package, a transformers checkpoint (the
``torch`` extra) or a file saved once with ``--save-ref``
(:mod:`~ortevals.fidelity.reference`). :mod:`~ortevals.fidelity.run` ties them
together and prints the report with standard errors clustered by window.

Importing this package imports neither torch nor onnxruntime.
"""
