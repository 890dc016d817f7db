"""The benchmark's own config options (``model=bench_transformer``, ``data=bench_wikitext``), found
by its cells' runs only (``hydra.searchpath=[pkg://trainkit.bench.conf]``)."""
