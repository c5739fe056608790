"""Models and their specs: the readable GPT, the table of known architectures, HF builders."""
