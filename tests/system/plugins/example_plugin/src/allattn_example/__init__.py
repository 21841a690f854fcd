"""An example allattn-pipe plugin: the model kind `tiny_gru` and the stage kind
`corpus_stats`, registered by entry points in pyproject.toml."""
