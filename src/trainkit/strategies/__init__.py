"""Our Lightning strategies and plugins: ranks, launching, wrapping, backward and collectives,
knowing nothing of the task (docs/design.md, "Layers").

ddp.py (Lightning's DDP with ranks launched by trainkit.launch), dp.py (torch.nn.DataParallel),
pipeline.py (pipelined model parallelism), fsdp.py (torch's fully_shard per block),
sync_batchnorm.py (SyncBatchNorm on CPU/gloo).
"""
