"""Speculative decoding in the engine (n-gram prompt lookup, greedy verification).

- ngram_gpu: the device proposer and its per-slot token buffer (seed 4 "after");
- ngram_cpu: bubblesim.core.ngram over CPU token lists, synchronous (seed 4 "before");
- verify: greedy acceptance, accepted counts by cat+argmax or by sum (seed 2) and their D2H;
- backup_tokens: backup next-token ids by list + np.array or preallocated buffer (seed 1);
- slot_mapping: the GPU correction of optimistic positions / seq_lens / slots (seed 5);
- inputs: the k + 1-token input layout; decoder: what each loop phase does with drafts.
"""
