"""The bundle format's constants, defined once (docs/bundle.md).

The runtime, `emit`, `kerncc check` and `kerncc report` all take these names from here, so
the format string and the headline of every refusal cannot drift apart between the writer and
the readers.
"""

from __future__ import annotations

FORMAT = "kerncc-bundle/1"
# The headline of every refusal to read a bundle, whoever reads it.
HEADLINE = "not a valid kerncc bundle:"
# A stage's files, and the key of bundle.json's stage entry that records each one's sha256.
STAGE_FILES = (("manifest.json", "manifest_sha256"), ("plan.json", "plan_sha256"),
               ("stage.py", "stage_py_sha256"))
# The largest bundle.json, manifest, plan.json, stage.py or module file read (`--max-file-size`
# raises it): a real 36-layer stage is a few MB; a /dev/zero or a runaway file stops here.
MAX_FILE_SIZE = 256 * 1024 * 1024
# The files beside the input manifest that the text codec of `kerncc run --text/--chat` and
# `kerncc serve` reads (kerncc.hf.tokenizer): emit records each one there (bundle.json
# `tokenizer`: name, bytes, sha256), so one changed, added or removed after lowering is refused.
TOKENIZER_FILES = ("chat_template.jinja", "config.json", "generation_config.json",
                   "tokenizer.json", "tokenizer_config.json")
# The headline of a refusal to cut a manifest into stages (the `cut` and `share-states` passes).
CUT_HEADLINE = "manifest cannot be cut:"
