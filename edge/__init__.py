"""The QUIC/HTTP edge: request parsing, tokenization, admission."""
