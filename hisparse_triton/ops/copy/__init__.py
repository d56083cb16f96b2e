"""The copy op family: ``copy_rows`` / ``copy_pages`` move rows or whole blocks of every layer.

Modules: ``contract`` (argument rules shared by every implementation), ``reference`` (the
pure-torch definition, bit-exact oracle and CPU backend). The Triton launchers live in
``hisparse_triton.kernels.gather`` (host -> device) and ``hisparse_triton.kernels.backup``
(device -> host).
"""
