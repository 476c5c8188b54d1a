"""The models recipes name by short name: the image models, the GPT, Hugging Face causal language
models; and what the trainer asks of any model's parameters (counting, weight-decay groups)."""
