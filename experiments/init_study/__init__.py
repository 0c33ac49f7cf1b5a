"""The initialisation study: gradient norms at initialisation in Xiong et al.'s own setting
(6 + 6 encoder-decoder, d_model 512, fairseq's init) beside the lab's LM, across depth, with
bootstrap intervals; no training.

    python -m experiments.init_study --out experiments/init_study/results   # the study (minutes)
    python -m experiments.init_study.report DIR                             # its report again

Modules: study (the settings, the draws, the cells on disk) and report (verdicts with
intervals, tables, plots; numpy and matplotlib only). It builds on the lab's model, task and
cells (experiments.stability).
"""
