"""minagent: a minimal tool-using language-model agent in numpy/JAX, written to be read."""
