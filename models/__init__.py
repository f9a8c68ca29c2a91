"""Models: the character tokenizer, named tiny models, loading/saving, and the shared log-prob
definition (`algos.logprobs.token_logprobs`) that inference and training both use."""
