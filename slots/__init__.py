"""The slot server, the model side's host: where the pool lives (host, GPU-mapped, GPU memory), the doorbell
pollers, the loop that starts, steps, streams and frees slots, the result write-back, and the handler API
(``handlers``) a model implements."""
