"""Native (C/CUDA) parts of edgepath and the generated Python view of the slot ABI."""
