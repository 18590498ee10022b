"""Operating a kvtier store from its config: `kvtier doctor | ls | stats | purge`.

:mod:`~kvtier.admin.cli` registers the four commands, :mod:`~kvtier.admin.doctor` holds the
doctor's checks, :mod:`~kvtier.admin.chunks` lists, counts and deletes stored chunks.
"""
