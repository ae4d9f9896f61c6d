"""The DPU-side agent: claims slots and writes requests over a transport."""
