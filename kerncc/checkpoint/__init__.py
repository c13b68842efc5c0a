"""Checkpoints: the safetensors reader (headers bounded, data memory-mapped) and shard indexes.

`safetensors` reads one file; `shards` finds the checkpoint beside a manifest (one
`model.safetensors`, or a `model.safetensors.index.json` naming shards beside it).
"""
