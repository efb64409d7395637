"""Checkpoints, in three parts: `format` (the local atomic directory, its manifest, verification, reading,
retention), `writer` (writes on a background thread) and `upload` (sends finished ones to GCS), with
`resume` turning a `--resume` value into a verified local directory (downloading one from GCS if need be).
"""
