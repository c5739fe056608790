"""distributed: DDP, ZeRO, pipeline and tensor parallelism on torch.distributed."""
