"""Hugging Face models in, text out.

`config` parses and checks a checkpoint's config.json, `checkpoint` reads its tensor table from
the safetensors headers, `importer` builds the manifest with the example's builder
(`kerncc import`), `tokenizer` owns `TextCodec` (tokenizer.json, chat templates, eos ids) and
`cli` the command-line hooks (`kerncc import`, `kerncc run --text/--chat`).
"""
