"""Hydra finds the trainkit library's config groups (``trainkit/conf``) after the application's
own config directory, as Hydra's config search path plugins let a library ship configs: a user's
``hydra.searchpath`` adds to it rather than replacing it."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TrainkitSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="trainkit", path="pkg://trainkit.conf")
