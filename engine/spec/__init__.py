"""Speculative decoding parts of the engine: the GPU n-gram proposer (seed 4), greedy
verification with the accepted-count forms of seed 2, the backup token ids of seed 1 and the
optimistic input correction of seed 5. Each file is usable alone; engine.engine wires them."""
