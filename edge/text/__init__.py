"""The model's own text at the edge: tokenizers (``tokenizer``), chat templates (``chat``), incremental
detokenizing (``detokenize``) and stop strings (``stop``)."""
