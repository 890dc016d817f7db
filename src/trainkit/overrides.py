"""A value typed on Hydra's command line, as its grammar reads it: a path with '=' or ','
quoted. Light (no torch): the entry points use it before Hydra composes the run."""

import re


def hydra_quoted(path: str) -> str:
    """A path as a Hydra override value: sweep job directories are named by their overrides
    (``0_seed=1``, ``3_data.batch_size=64,model.optimizer.lr=0.1``), and hold '=' and ','.

    In Hydra's quoted strings a backslash escapes only a quote or the closing quote: double the
    backslashes just before those, then escape the quotes."""
    path = re.sub(r'(\\+)(?="|$)', lambda m: m.group(1) * 2, path)
    return '"' + path.replace('"', '\\"') + '"'


def with_path_quoted(override: str, multirun: bool = False) -> str:
    """``ckpt_path=<sweep>/0_seed=1/checkpoints/last.ckpt`` as typed, which Hydra's grammar
    refuses ("mismatched input '='"), with its value quoted: one string, as meant. Only a path
    (a '/', and not a list, dict, sweep function, quoted string or ``==``), and under ``-m`` only
    one without ',' (which would separate a sweep's values); an override that Hydra parses as it
    is, or refuses quoted too, is left as typed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    key, _, value = override.partition("=")
    value = value.strip()  # (as Hydra reads an unquoted value)
    if "/" not in value or value[:1] in "[{'\"=" or "(" in value or (multirun and "," in value):
        return override
    parser = OverridesParser.create()
    try:
        parser.parse_override(override)
        return override
    except HydraException:
        quoted = f"{key}={hydra_quoted(value)}"
    try:
        parser.parse_override(quoted)
    except HydraException:
        return override
    return quoted
