"""The copy op family: ``copy_rows`` / ``copy_pages`` move rows or whole blocks of every layer.

- ``contract``: the argument rules (``check_copy_args``) and ``table_alignment``, shared by
  every implementation;
- ``reference``: the pure-torch definition, bit-exact oracle of the kernels and the
  ``torch`` backend;
- ``op``: the public ``copy_rows`` / ``copy_pages`` (backend choice, eager bypass) and the
  custom ops ``hisparse_triton::copy_rows`` / ``copy_pages`` registered at import.

The Triton kernel and launchers live in ``hisparse_triton.kernels.gather`` (host -> device:
``gather_rows``, ``restore_pages``) and ``hisparse_triton.kernels.backup`` (device -> host:
``backup_rows``, ``spill_pages``); they import the contract, never the reference.
"""
