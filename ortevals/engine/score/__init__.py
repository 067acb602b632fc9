"""Log-likelihoods: token requests to scored passes (prefill with prefix reuse and batching, or og's
cursor), the pure scoring math, and the batch/prefix invariance checks and canary that guard them."""
