"""What a run leaves behind: the result store and its scope, resume, result files, the cache."""
