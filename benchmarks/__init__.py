"""Side-by-side measurements against Hugging Face transformers: `jax-llama bench` runs them all
(benchmarks.suite); each bench_*.py also runs on its own (`python benchmarks/bench_train.py`)."""
