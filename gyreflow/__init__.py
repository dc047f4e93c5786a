"""gyreflow: elastic reinforcement learning on Dask for long-horizon LLM agents."""

__version__ = "0.1.0"
