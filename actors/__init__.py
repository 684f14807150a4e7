"""Generation: vLLM engines inside Ray actors, the reward functions that score them."""
