"""apply: mechanisms that carry a memory plan out (checkpointing, offload, precision, ...)."""
