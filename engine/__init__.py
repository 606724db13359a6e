"""A compact Llama-family inference engine in PyTorch + Triton.

Kept light on purpose: importing `engine` imports nothing heavy. The model lives in
`engine.model`, the paged attention backends in `engine.attention`, the Triton kernels in
`engine.kernels` (imported only when the Triton backend is used) and the checkpoint loader in
`engine.loader`.
"""
