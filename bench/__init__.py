"""The benchmarks a user runs, each a module run from the repository root with
`python -m bench.NAME` (`--help` works without a GPU). Each measures what it compares side by
side in one run, prints a table last, writes results.json under --out, and with
`--doc docs/benchmarks.md` writes its rows there (bench/report.py, shared by all).

  decode       decode and prefill on the GPU against the roofline (and PyTorch, two GPUs)
  serve        `kerncc serve` under load: tokens/s, TTFT, ITL (cuda, cpu, or a simulated device)
  host_step    the host's work a decode step, on the CPU (launches that do nothing)
  lower        the front end, each pass, and `kerncc lower` against `kerncc verify` (CPU)
  hf_fidelity  imported Hugging Face models against transformers itself (GPU)
  placement    stage processes against the in-process chain (one or two GPUs)

gpu.py, report.py, simulated.py and torch_ref.py are what they share.
"""
