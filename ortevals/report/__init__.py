"""What a run leaves behind: the result store and its scope, resume, result files, the cache, and
comparison of finished runs.

:mod:`~ortevals.report.runs` reads finished runs (ortevals ``--output`` folders
or lm-eval ``--log_samples`` files), :mod:`~ortevals.report.stats` holds the
pure statistics, :mod:`~ortevals.report.compare` aligns runs and compares them
question by question, :mod:`~ortevals.report.output` prints and writes the
comparison, and :mod:`~ortevals.report.html` writes ``report.md`` and a
self-contained ``report.html``. Nothing here imports onnxruntime, lm-eval or
torch; matplotlib is imported only when a report is written.
"""
