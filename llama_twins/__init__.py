"""llama_twins: the top layer of jax-llama, everything that needs both twins side by side.

The parity report (parity/) and the round-trip demo (demo.py), which load a checkpoint into
jax_llama and torch_llama at once; the benchmark suite (bench/), which runs each twin and
transformers in worker processes of their own; and the three commands that drive everything:
`llama-bridge`, `jax-llama` and `torch-llama` (cli/: one module per family of subcommands,
each parser beside its handlers), with `jax-llama serve`'s OpenAI-compatible app (server/).
Imports point down only: llama_twins -> jax_llama | torch_llama -> bridge (pyproject.toml's import-linter contracts, checked by tests/test_architecture.py).
"""
