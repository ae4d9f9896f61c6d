"""edgepath: an edge-to-GPU zero-copy ingress data path for LLM serving."""

__version__ = "0.1.0"
