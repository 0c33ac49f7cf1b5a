"""Against Hugging Face: the machinery that runs transformers beside `fb.from_hf`, and every
test against transformers, its files or the Hub (parity_tests/README.md lists them by kind)."""
