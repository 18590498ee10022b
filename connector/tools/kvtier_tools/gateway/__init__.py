"""`kvtier gateway`: profiles for OpenAI-compatible API gateways (add / use / status / test).

A profile is what users keep for their tools: where the API is, the key, which models to use.
The layout is the one the `gateway_profile` Ansible role writes, so both manage the same files::

    <profiles_dir>/<name>/config.toml     [api] [models] [proxy] [logging]  (the source of truth)
    <profiles_dir>/<name>/settings.json   the same values for editor and agent tools
    <profiles_dir>/active -> <name>       symlink; `use` switches it atomically

Files are 0600 and directories 0700: they hold API keys.
"""

# The package: profile.py (the profile, its files and the active pointer; config.toml read with
# tomllib, written with tomli-w), channel.py (the channel test through urllib and the
# classification of its failures), cli.py (`kvtier gateway`, also `python -m kvtier_tools.gateway`).
