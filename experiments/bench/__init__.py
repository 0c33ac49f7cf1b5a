"""Speed benchmarks: each times one thing against what a user would otherwise run, in
interleaved repeats on the same machine, and writes its table under results/.

    python -m experiments.bench                 # the twins' blocks, JAX against torch (blocks.py)
    python -m experiments.bench.lab             # the lab against the torch loop it replaces
    python -m experiments.bench.load            # fb.from_hf against transformers' from_pretrained
    python -m experiments.bench.generate        # fb.generate against HF's generate
    python -m experiments.bench.moe             # the experts MLP at 8 and 64 experts against dense, the twin, HF
    python -m experiments.bench.long_attention  # long sequences: the blocked attention against torch
    python -m experiments.bench.xla_flags       # an XLA:CPU flag, settled in paired processes
    python -m experiments.bench.construction    # first construction: the library's model against plain Flax

timing.py holds the interleaved timer and the statistics they share.
"""
