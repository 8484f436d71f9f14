"""Integrations of csfmoe with model libraries.

`csfmoe.integrations.transformers`: Hugging Face transformers MoE models
(install with `pip install csfmoe[transformers]`)."""
