"""The stage-bundle format (docs/bundle.md): its constants, reader and checks, plan and stage.py.

`index` checks bundle.json's fields, `plan` builds plan.json, `plan_check` checks one against
its stage manifest, `stage_py` renders a stage's plan as stage.py, `check` re-proves a bundle
against its input and `report` summarises one. This package imports nothing at load, so that the
runtime can read bundles without loading the compiler.
"""
