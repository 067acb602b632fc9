"""Generation: lm-eval's gen_kwargs to tokens, on the raw path and on onnxruntime-genai's.

Four rooms, by job:

- ``choice/``: choosing a token: a request's decoding settings, seeds, logits processors and draws,
  stop sequences, self-certainty (pure numpy; below the other three);
- ``rows/``: the raw K-row decoder: K samples of a prompt on one prompt pass, their KV (in place,
  on the device, or shared by the cascade graph) and the token choice of a decode batch;
- ``search/``: search and selection: beam search, MBR, process reward models and the
  verifier-guided step searches (PRM beam, DVTS, particles) with their raw-onnxruntime row model;
- ``og/``: onnxruntime-genai's Generators: the rewinding cursor's loop, batched greedy rows and
  their scheduling.

``canary.py`` checks the batch and prefix invariance of the raw and og paths.
"""
