"""The parity suite and two tools for your own models: `parity_tests.port` (a torch module
against its Flax port) and `parity_tests.check` (a checkpoint). What is where, and which part
is public: README.md beside this file.
"""
