"""Our Lightning strategies and plugins: what Lightning 2.6 lacks or gets wrong.

ddp.py (ddp that is right under Hydra multirun), dp.py (torch.nn.DataParallel), pipeline.py
(pipelined model parallelism), sync_batchnorm.py (SyncBatchNorm on CPU/gloo).
"""
