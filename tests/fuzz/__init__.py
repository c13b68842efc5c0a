"""The fuzz suite: mutated manifests, .kir texts, pipeline specs, bundles and command lines.

Every case drives an entry point (the CLI in process, the library API, a few real subprocesses)
and checks the contract README.md promises: bad input of any kind gives a located error and exit
code 1, never a traceback, never a half-written output directory, never a changed input file.
`harness.py` holds the invariants, `mutate.py` the mutations, `seeds.py` the valid inputs.
`HYPOTHESIS_PROFILE=long` runs many more cases; the session prints how many ran per entry point.
"""
