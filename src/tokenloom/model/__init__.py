"""The model side: checkpoint loading, our own Llama-family layers, paged attention, the runner and the sampler."""
