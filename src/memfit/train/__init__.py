"""train: the readable GPT, the data pipeline and the training loop behind `memfit train`."""
