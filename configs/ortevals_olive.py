import ortevals.integrations.olive  # noqa: F401  registers OrtEvalsEvaluator; Olive imports this file twice: keep it one line
