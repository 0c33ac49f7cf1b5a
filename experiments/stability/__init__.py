"""The depth-stability lab: which residual placements (post-LN, pre-LN, DeepNorm, Peri-LN,
no skip, ...) train as the stack gets deeper, on tasks with a known optimal loss.

    python -m experiments.stability [--preset quick|cpu|depth|...]   # a sweep (sweep.py); `make run`
    python -m experiments.stability.report DIR                       # its report again, from the cells
    python -m experiments.stability.outward                          # the depth study on text and at d_model 64

Modules:
  tasks          synthetic sequence tasks with a known optimal loss (numpy + jittable samplers);
                 text: characters of CPython's documentation (text.py)
  model          embedding + flax_blocks stack + head, and the variant axis
  train          three compiled programs per (variant, depth) (init, probe, a chunk of steps
                 under scan), runs under vmap, sharded over devices
  program_cache  those programs and the task pools kept on disk, keyed by what decides them
  presets        the named grids;  sweep  the runner: cells on disk, resume, progress, summary
  analysis       failure criterion and fits (pure numpy)
  report, plots  markdown report with computed verdicts, PNG figures;  outward  the outward study

A run writes under runs/<preset>[-custom]/ (untracked) unless --out says otherwise; results/
holds the committed runs the docs quote (quick, cpu, depth, outward, cpu-moe).
"""
