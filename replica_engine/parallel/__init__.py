"""One replica on several workers: tensor parallelism over torch.distributed (gloo on a CPU,
NCCL on a GPU)."""
