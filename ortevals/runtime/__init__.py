"""The runtimes at work: onnxruntime sessions and onnxruntime-genai models, opened for a package.

Owns providers and their options, opening sessions (checked against the provider asked for),
the decoder runner and its KV buffers, the derived scoring graph, one-node graphs on the device,
og's Generators (text and media) and free memory where the KV lives. The modules themselves are
imported lazily through :mod:`ortevals.install`; nothing here imports the engine above.
"""
