"""What the project's datamodules build on: the on-disk formats (``decode``, ``synthetic``), one
shard per rank (``sharding``) and batches from tensors in memory (``in_memory``). Importing this
package imports none of them, so ``decode`` stays importable without Lightning (the benchmark's
plain loop)."""
