"""Side-by-side measurements against Hugging Face transformers: `jax-llama bench` runs them all
(suite.py); forward, train, decode and convert also run on their own
(`python -m llama_twins.bench.train`). Results go to the directory given with --out, or the
current directory; never into the installed package."""
