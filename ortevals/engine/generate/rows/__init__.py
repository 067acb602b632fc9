"""The raw K-row decoder: K samples of one prompt for little more than the cost of one.

``sampler.py`` runs generate_until on a DecoderRunner (one prompt pass, K rows decoded together);
``batch.py`` chooses the live rows' tokens a step at a time; ``kv.py`` holds the rows' KV (in place
on the host or the device, or a new cache per pass); ``cascade_kv.py`` lets rows share one copy of
their prompt's KV through the cascade decode graph.
"""
