"""Tokenized `.npz` shards -> a validated shard index -> a resumable, rank-sharded batch stream.

In the order the training loop meets them: `shards` (one file's format, read and checked), `index` (every
shard under the data directory, validated once and cached), `dataset` (sequence number -> token ids, read in
place), `mixture` (which source each sequence of a weighted mixture comes from), `loader` (the deterministic
per-rank order, the resumable stream, eval batches); `demo` builds the demo corpus.
"""
