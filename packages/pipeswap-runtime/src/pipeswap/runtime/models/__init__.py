"""The models pipeswap trains out of the box (a GPT, a Llama-style model, Hugging Face causal
LMs split into stages), tied weights across stages, and the bundled corpus."""
