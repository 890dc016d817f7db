"""Our Lightning strategies and plugins: what Lightning 2.6 lacks or gets wrong.

dp.py (torch.nn.DataParallel), sync_batchnorm.py (SyncBatchNorm on CPU/gloo).
"""
