"""Data: a corpus -> tokenized `.npz` shards -> a validated shard index -> a resumable, rank-sharded batch stream.

Making shards (`prepare_data.py`, `download_training_data.py`):
- `corpus`: a corpus's input files (local or `gs://`) and the documents in them;
- `tokenizer`: the one place a tokenizer path becomes a `tokenizers.Tokenizer`;
- `partition`: the partition plan of a prepare run, its validation rule, and the work of one partition;
- `executors`: who runs the partitions, a local process pool or Ray;
- `output_store`: where prepare writes, a folder or a `gs://` prefix;
- `prepare`: the whole prepare run; `dataset_info`: the `dataset.json` it writes beside the shards;
- `download`: mirroring a prepared dataset from GCS; `demo`: the demo corpus, built with no network;
- `ray_reaper`: a local Ray's processes go with their driver.

Reading them (`train.py`), in the order the loop meets them:
- `shards`: one file's format, read and checked; `index`: every shard under a folder, validated once, cached;
- `source`: the data-source seam; `shard_source` ("shards", a folder) and `stream_source` ("stream", a
  `gs://` dataset fetched ahead of the loop into a bounded cache) implement it;
- `dataset`: sequence number -> token ids, read in place; `mixture`: which source each sequence of a
  weighted mixture comes from;
- `loader`: the deterministic per-rank order, the resumable stream, eval batches; `build`: a run's sources
  opened by type and this rank's loader over them.

May import: utils, utils.io, utils.runtime.
"""
