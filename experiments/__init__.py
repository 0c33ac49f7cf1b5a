"""Depth-stability experiments on `flax_blocks`: synthetic tasks, jitted sweeps, report.

Entry point: `python -m experiments.stability` (see that module). Modules:
  tasks     synthetic sequence tasks with a known optimal loss (numpy + jittable samplers)
  model     embedding + flax_blocks.Encoder + head, and the variant axis
  train     three compiled programs per (variant, depth) (init, probe, a chunk of steps under
            scan), runs under vmap
  analysis  failure criterion and fits (pure numpy)
  stability the sweep: presets, cells on disk, resume, progress, summary table
  plots     PNG figures;  report  markdown report with computed verdicts
"""
