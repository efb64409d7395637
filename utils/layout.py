"""The names of what a run writes under its output folder (docs/contracts.md "Files a run writes"): one home for
each, imported wherever such a path is built or read. The files inside a checkpoint are named in
utils/checkpoint/format.py, a dataset's in utils/data/dataset_info.py (dataset.json), utils/data/tokenizer.py
(tokenizer.json) and utils/data/partition.py (plan.json)."""
CHECKPOINTS = "checkpoints"  # checkpoint-epoch{E}-step{S}-files{F}/ folders
LOGS = "logs"
TRAINING_LOG = "training.log"  # in logs/: the console lines
METRICS = "metrics.jsonl"  # in logs/: one JSON row per logging step, eval, checkpoint
SAMPLES = "samples.jsonl"  # in logs/: sample continuations during training
BATCH_TRACE = "batch_trace.jsonl"  # in logs/, with NEOX_TRACE_BATCHES=1
FINAL_MODEL = "final_model"  # the exported model (HF format)
