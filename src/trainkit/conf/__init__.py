"""The library's config groups (strategy, trainer, logger, callbacks, paths, hydra, launcher,
debug), found by Hydra through ``hydra_plugins.trainkit_searchpath``: after the project's own
``conf/``, whose file of the same name wins."""
