"""Models: the character tokenizer, named tiny models, loading/saving, and the shared log-prob
definition (`models.logprobs.token_logprobs`) that inference and training both use."""
