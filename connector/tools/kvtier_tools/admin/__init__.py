"""Operating a kvtier store from its config: `kvtier doctor | ls | stats | purge`.

:mod:`~kvtier_tools.admin.cli` registers the four commands, :mod:`~kvtier_tools.admin.doctor`
holds the doctor's checks, :mod:`~kvtier_tools.admin.chunks` lists, counts and deletes stored
chunks.
"""
